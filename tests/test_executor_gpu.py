"""NCCL backend: on a real GPU (skipped with the reason without one), and against a fake CuPy on CPU.

The fake (below) checks every CuPy / NCCL call the engine makes against the real API's signatures
and rules and moves the bytes in host memory, so a wrong argument order or type, a count in the
wrong unit, a buffer of the wrong rank, a call order that deadlocks, or a form of the unique id a
CuPy version refuses fails here, without a GPU. What it cannot tell is listed in docs/executor.md.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from xmesh_plan.executor import ExecutorError, PeerTimeoutError, PlanMismatchError
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.pattern import fill, mismatches
from tests.support.cases import STRATEGIES, all_fixed_plans, compiled, problem, random_problem, write_plans
from tests.support.launch import mpiexec
from tests.support.fake_gpu import FakeGpu, drive, fake_nccl_transfer, nccl_engines, run_on_fake
from tests.support.real_gpu import GPU_REASON

ROOT = Path(__file__).resolve().parents[1]


needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")]


def _run(n: int, *args: str) -> subprocess.CompletedProcess:
    return mpiexec(n, "-m", "xmesh_plan.executor.run", *args, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
def test_single_gpu_copies_and_pack_unpack_bit_exact(tmp_path):
    """One rank that is both meshes: local copies of strided boxes on the GPU."""
    one = problem("gpu_local", (64, 48, 8), (1,), (0,), "R R R", (1,), (0,), "R R R")
    path = write_plans(tmp_path, [compiled(one, "broadcast")])[0]
    result = _run(1, path, "--backend", "nccl", "--check", "--scale", "1,1,1")
    assert result.returncode == 0 and "check ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
def test_two_ranks_share_one_gpu_with_fake_hosts(tmp_path):
    """NCCL_HOSTID per rank + socket transport: the workaround for 'Duplicate GPU detected'."""
    two = problem("gpu_pair", (64, 48), (1,), (0,), "R R", (1,), (1,), "R S0")
    path = write_plans(tmp_path, [compiled(two, "send_recv")])[0]
    result = _run(2, path, "--backend", "nccl", "--check", "--gpu", "0", "--fake-hosts", "--scale", "1,1")
    assert result.returncode == 0 and "check ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
@pytest.mark.parametrize("order", ["device", "posted"])
def test_a_multi_tensor_plan_runs_bit_exact_with_eight_ranks_on_one_gpu(order):
    """`executor.run` on a weight sync (21 tensors, 8 ranks): device order replays every tensor through the joint
    NCCL engine, posted order one tensor after another; the source shards go to the GPU first (CuPy raises
    "Unsupported type" on a numpy shard)."""
    path = ROOT / "plans" / "weight_sync_small.plan.json"
    result = _run(8, str(path), "--backend", "nccl", "--check", "--gpu", "0", "--fake-hosts", "--max-mb", "1", "--order", order)
    assert result.returncode == 0 and "check ok: 21 tensors" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("api,signed", [(14, True), (13, True), (13, False)], ids=["cupy14-bytes-id", "cupy13-x86", "cupy13-arm"])
@pytest.mark.parametrize("plan", all_fixed_plans(), ids=lambda p: f"{p.problem.name}-{p.strategy}")
def test_engine_on_fake_cupy_is_bit_exact(plan, api, signed, monkeypatch):
    gpu = FakeGpu(api=api, char_signed=signed).install(monkeypatch)
    run_on_fake(plan, gpu)
    assert any(entry[0] == "bcast" for entry in gpu.log) or all(op.kind == "copy" for op in plan.operations)
    assert {entry[1:] for entry in gpu.log if entry[0] == "bcast"} <= {("int",) * 5}, "bcast takes five plain ints"


@pytest.mark.parametrize("seed", range(10))
def test_engine_on_fake_cupy_random_cases(seed, monkeypatch):
    plan = compiled(random_problem(seed, exact=False), STRATEGIES[seed % 4])
    run_on_fake(plan, FakeGpu(api=14 if seed % 2 else 13).install(monkeypatch), iterations=2)


def test_calls_longer_than_the_limit_are_split_the_same_on_every_rank(monkeypatch):
    """CuPy < 13 declares `int count`: the engine cuts calls to MAX_CALL_BYTES (here 8 B; the fake refuses more)."""
    import xmesh_plan.executor.nccl_plan as nccl_plan
    monkeypatch.setattr(nccl_plan, "MAX_CALL_BYTES", 8)
    gpu = FakeGpu(api=13, max_count=9).install(monkeypatch)
    plan = all_fixed_plans()[2]
    run_on_fake(plan, gpu, iterations=1)
    assert sum(entry[0] == "bcast" for entry in gpu.log) > len(plan.operations)


def _two_ranks(fake, uid, gpu, buffer):
    """Two ranks of one communicator on the fake: per rank, its GPU `gpu(rank)`, a communicator, `buffer(rank)`
    and a non-blocking stream."""
    nccl, cupy = fake.modules["cupy.cuda.nccl"], fake.cupy
    comms, bufs, streams = [], [], []
    for rank in range(2):
        fake.process = rank
        cupy.cuda.Device(gpu(rank)).use()
        comms.append(nccl.NcclCommunicator(2, uid, rank))
        bufs.append(buffer(rank))
        streams.append(cupy.cuda.Stream(non_blocking=True))
    return comms, bufs, streams


def test_fake_refuses_what_the_real_api_refuses(monkeypatch):
    """The harness itself: each of these mistakes must fail, or the tests above prove nothing."""
    gpu = FakeGpu(api=14).install(monkeypatch)
    nccl, cupy = gpu.modules["cupy.cuda.nccl"], gpu.cupy
    uid = nccl.get_unique_id()
    comms, bufs, streams = _two_ranks(gpu, uid, gpu=lambda rank: rank, buffer=lambda rank: cupy.empty(16, np.int32))
    gpu.check_init_order()
    with pytest.raises(TypeError, match="expected bytes, got tuple"):
        nccl.NcclCommunicator(2, tuple(uid), 0)
    c, b, s = comms[0], bufs[0], streams[0]
    with pytest.raises(TypeError, match="plain int"):
        c.bcast(b, 16, nccl.NCCL_INT32, 0, s.ptr)  # the array, not b.data.ptr
    with pytest.raises(TypeError, match="plain int"):
        c.bcast(b.data.ptr, 16, nccl.NCCL_INT32, 0, s)  # the Stream, not s.ptr
    with pytest.raises(OverflowError, match="root="):
        c.bcast(b.data.ptr, 16, nccl.NCCL_INT32, s.ptr, 0)  # root and stream swapped (NCCL: invalid argument)
    with pytest.raises(AssertionError, match="not a Stream"):
        c.bcast(b.data.ptr, 16, nccl.NCCL_INT32, 0, 0)  # the legacy default stream, not the executor's
    with pytest.raises(AssertionError, match="not inside one allocation"):
        c.bcast(b.data.ptr, 64, nccl.NCCL_INT32, 0, s.ptr)  # a count in bytes with a 4-byte datatype
    with pytest.raises(AssertionError, match="another rank"):
        c.bcast(bufs[1].data.ptr, 16, nccl.NCCL_INT32, 0, s.ptr)
    with pytest.raises(ValueError, match="no ncclRedOp_t"):
        c.allReduce(b.data.ptr, b.data.ptr, 16, nccl.NCCL_FLOAT32, 9, s.ptr)
    with pytest.raises(AssertionError, match="not inside one allocation"):
        c.allReduce(b.data.ptr, b.data.ptr, 64, nccl.NCCL_FLOAT32, nccl.NCCL_MAX, s.ptr)  # a count in bytes
    with pytest.raises(TypeError, match="plain int"):
        c.allReduce(b.data.ptr, b.data.ptr, 16, nccl.NCCL_FLOAT32, nccl.NCCL_MAX, s)  # the Stream, not s.ptr
    with pytest.raises(TypeError, match="Cannot cast"):
        with s:
            cupy.copyto(cupy.empty(4, np.uint16), cupy.empty(4, np.int16))
    with pytest.raises(AssertionError, match="misaligned"):
        with s:
            cupy.copyto(cupy.empty(12, np.uint8)[1:9].view(np.int32), cupy.empty(2, np.int32))
    # two ranks that both send first, without a group: deadlock; with groupStart/groupEnd: fine
    for rank in range(2):
        gpu.process = rank
        comms[rank].send(bufs[rank].data.ptr, 8, nccl.NCCL_INT32, 1 - rank, streams[rank].ptr)
        comms[rank].recv(bufs[rank].data.ptr + 32, 8, nccl.NCCL_INT32, 1 - rank, streams[rank].ptr)
    with pytest.raises(AssertionError, match="deadlock"):
        gpu.drain()


def test_fake_completes_grouped_exchange_and_catches_mismatched_collectives(monkeypatch):
    gpu = FakeGpu(api=13).install(monkeypatch)
    nccl = gpu.modules["cupy.cuda.nccl"]
    uid = nccl.get_unique_id()
    comms, bufs, streams = _two_ranks(gpu, uid, gpu=lambda rank: 0,
                                      buffer=lambda rank: gpu.wrap(np.arange(16, dtype=np.int32) + 100 * rank))
    for rank in range(2):
        gpu.process = rank
        nccl.groupStart()
        comms[rank].send(bufs[rank].data.ptr, 8, nccl.NCCL_INT32, 1 - rank, streams[rank].ptr)
        comms[rank].recv(bufs[rank].data.ptr + 32, 8, nccl.NCCL_INT32, 1 - rank, streams[rank].ptr)
        nccl.groupEnd()
    gpu.drain()
    assert list(bufs[0][8:]) == list(range(100, 108)) and list(bufs[1][8:]) == list(range(8))
    for rank in range(2):  # the max of both ranks' values, in place on each
        gpu.process = rank
        comms[rank].allReduce(bufs[rank].data.ptr, bufs[rank].data.ptr, 4, nccl.NCCL_INT32, nccl.NCCL_MAX, streams[rank].ptr)
    gpu.drain()
    assert list(bufs[0][:4]) == list(bufs[1][:4]) == [100, 101, 102, 103]
    comms[0].bcast(bufs[0].data.ptr, 4, nccl.NCCL_INT32, 0, streams[0].ptr)
    comms[1].bcast(bufs[1].data.ptr, 4, nccl.NCCL_INT32, 1, streams[1].ptr)  # another root
    with pytest.raises(AssertionError, match="different collectives"):
        gpu.drain()


def test_engine_mutations_are_caught(monkeypatch):
    """A count in bytes passed with a 4-byte datatype overruns the buffers: the fake must say so."""
    plan = compiled(problem("pairs", (8, 6), (2,), (0, 1), "S0 R", (2,), (2, 3), "R S0"), "send_recv")

    def four_byte_datatype(engine):  # counts stay in bytes
        engine.uint8 = engine.nccl.NCCL_INT32

    with monkeypatch.context() as m:
        with pytest.raises(AssertionError, match="not inside one allocation"):
            run_on_fake(plan, FakeGpu().install(m), iterations=1, mutate=four_byte_datatype)



def test_fake_catches_communicators_created_in_different_orders(monkeypatch):
    """ncclCommInitRank blocks until every member calls it: rank 0 making A then B while rank 1 makes B then A hangs."""
    gpu = FakeGpu(api=14).install(monkeypatch)
    nccl = gpu.modules["cupy.cuda.nccl"]
    first, second = nccl.get_unique_id(), nccl.get_unique_id()
    for rank, order in enumerate([(first, second), (second, first)]):
        gpu.process = rank
        gpu.cupy.cuda.Device(rank).use()
        for uid in order:
            nccl.NcclCommunicator(2, uid, rank)
    with pytest.raises(AssertionError, match="creation deadlocks"):
        gpu.check_init_order()


def test_a_rank_that_never_starts_times_out_and_aborts(monkeypatch):
    plan = compiled(problem("pair", (8, 6), (1,), (0,), "R R", (1,), (1,), "R S0"), "send_recv")
    gpu = FakeGpu().install(monkeypatch)
    engines = nccl_engines(plan, gpu, timeout_s=0.05)
    gpu.process = 0
    sender = engines[0]
    sender.start(sender.adopt(fill(sender.program.src_block, plan.problem.shape, sender.dtype)))
    with pytest.raises(PeerTimeoutError, match=r"op \d+ .* in group \[0, 1\] from device 0 did not finish .* aborted"):
        sender.wait()
    assert all(c.alive == "abort" for c in sender.communicators.values())
    with pytest.raises(ExecutorError, match="stopped after an error"):  # the same class as the MPI engine's
        sender.start(None)


def test_a_shard_on_another_gpu_is_refused(monkeypatch):
    plan = compiled(problem("pair", (8, 6), (1,), (0,), "R R", (1,), (1,), "R S0"), "send_recv")
    gpu = FakeGpu().install(monkeypatch)
    engine = nccl_engines(plan, gpu)[0]
    gpu.process = 0
    gpu.cupy.cuda.Device(3).use()
    elsewhere = gpu.cupy.asarray(np.zeros(engine.program.src_shape, engine.dtype))
    with pytest.raises(PlanMismatchError, match="is on GPU 3 but this rank runs on GPU 0"):
        engine.adopt(elsewhere)


def test_unique_id_forms_round_trip():
    from xmesh_plan.executor.nccl_engine import unique_id_bytes, unique_id_forms

    raw = np.arange(128, dtype=np.int64) * 2 % 256
    for uid in (raw.astype(np.uint8).tobytes(), tuple(int(x) for x in raw.astype(np.uint8).view(np.int8)), tuple(int(x) for x in raw)):
        got = unique_id_bytes(uid)
        assert got.dtype == np.uint8 and np.array_equal(got, raw)
        as_bytes, signed, unsigned = unique_id_forms(got)
        assert as_bytes == raw.astype(np.uint8).tobytes() and min(signed) < 0 <= min(unsigned) and max(unsigned) > 127


def test_nccl_plan_docstring_examples_hold():
    import doctest

    import xmesh_plan.executor.nccl_plan as nccl_plan

    result = doctest.testmod(nccl_plan)
    assert result.attempted > 0 and result.failed == 0


def test_bundles_run_bit_exact_on_fake_cupy(monkeypatch):
    """Coalesced plans (`bundle` operations: gathers, one cross-host message, scatters) on the fake NCCL: each
    message a broadcast in a group of two over staging, every destination shard bit for bit, on the first 6
    random problems that form bundles; the staging the engine allocates stays within the device-order peak
    `schemas.staging` states for the plan."""
    from xmesh_plan.planner.compile import compile_plan

    ran = 0
    for seed in range(40):
        plan = compile_plan(random_problem(seed, exact=False), solver="greedy", coalesce=True, bucket_bytes=4096)
        if not any(op.kind == "bundle" for op in plan.operations):
            continue
        run_bundles_on_fake(plan, FakeGpu(api=14 if seed % 2 else 13).install(monkeypatch))
        ran += 1
        if ran == 6:
            break
    assert ran == 6


# ---------------------------------------------------------------------------------------------
# Bundles on the reference problems and the weight sync
# ---------------------------------------------------------------------------------------------

REFERENCE_WITH_BUNDLES = ("case1", "case3", "case4", "case6", "case7", "case9", "one_to_1x4", "one_to_2x2", "one_to_4x2")


def shrunk_problem(name: str, max_bytes: int = 2**16):
    """plans/<name>.problem.json with its shape divided as `executor.scale` would shrink its plan, so that its
    boxes are small enough to bundle and the fake moves few bytes."""
    from xmesh_plan.executor.scale import factors_for
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.problem_io import load_problem
    from xmesh_plan.schemas.problem import ReshardingProblem

    full = load_problem(ROOT / "plans" / f"{name}.problem.json")
    factors = factors_for(compile_plan(full), max_bytes)
    return ReshardingProblem.model_validate({**full.model_dump(), "shape": [n // f for n, f in zip(full.shape, factors)]})


def run_bundles_on_fake(plan, gpu, iterations: int = 2) -> None:
    """`run_on_fake`, then: bundle messages went over NCCL, and no engine allocated more staging than the
    device-order peak `schemas.staging.staging_peaks` states for the plan."""
    from xmesh_plan.executor.lower import StagedCall
    from xmesh_plan.schemas.staging import staging_peaks

    engines = run_on_fake(plan, gpu, iterations=iterations)
    assert any(isinstance(c, StagedCall) and c.action == "bcast" for e in engines for c in e.calls.actions)
    peaks = staging_peaks(plan, "device")
    for e in engines:
        assert e.calls.stage_bytes <= peaks.get(e.program.device, 0), f"device {e.program.device}"
        assert e.stage.nbytes <= max(peaks.get(e.program.device, 0), 1), f"device {e.program.device}"


@pytest.mark.parametrize("name", REFERENCE_WITH_BUNDLES)
def test_coalesced_reference_problems_run_bit_exact_on_fake_nccl(name, monkeypatch):
    """Each reference problem (shrunk), compiled with coalesce=True, has bundles; on the fake NCCL every
    destination shard is bit-exact and staging stays within the device-order peak."""
    from xmesh_plan.planner.compile import compile_plan

    plan = compile_plan(shrunk_problem(name), coalesce=True)
    assert any(op.kind == "bundle" for op in plan.operations), name
    run_bundles_on_fake(plan, FakeGpu(api=14 if len(name) % 2 else 13).install(monkeypatch))


def test_every_tensor_of_the_small_weight_sync_runs_on_fake_nccl(monkeypatch):
    """The default multi-tensor plan of plans/weight_sync_small.problem.toml (bundles, shared messages), shrunk,
    as the NCCL engine's posted order runs it: its tensors one after another, each bit-exact with the staging
    of its own device-order peak, and every tensor's bundles run."""
    from xmesh_plan.executor.scale import factors_per_tensor, scale_tensors
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.transfer_io import load_any_problem
    from xmesh_plan.schemas.plan_tensors import tensor_plans

    plan = compile_plan(load_any_problem(ROOT / "plans" / "weight_sync_small.problem.toml"))
    assert any(op.carrier is not None for op in plan.operations)
    singles = tensor_plans(scale_tensors(plan, factors_per_tensor(plan, 2**16)))
    assert len(singles) > 1 and all(any(op.kind == "bundle" for op in s.operations) for s in singles)
    for single in singles:
        with monkeypatch.context() as m:
            run_bundles_on_fake(single, FakeGpu(api=14).install(m), iterations=1)


# ---------------------------------------------------------------------------------------------
# A multi-tensor plan with a staging limit through TransferExecutor on the fake NCCL
# ---------------------------------------------------------------------------------------------

def run_transfer_on_fake(executors, gpu, runs: int = 3) -> None:
    """Three reshards through every rank's TransferExecutor, other bits each time; every destination shard of
    every tensor checked bit for bit against its pattern; then close()."""
    from xmesh_plan.executor.pattern import tensor_salt

    for run in range(runs):
        salts = {name: tensor_salt(k) + 101 * run for k, name in enumerate(executors[0].names)}
        for ex in executors:
            gpu.process = ex.device
            shards = {name: ex.engine.adopt(fill(t.src_block, problem.shape, dtype, salts[name]))
                      for name, t, problem, dtype in zip(ex.names, ex.program.tensors, ex.problems, ex.engine.dtypes)
                      if t.src_block is not None}
            ex.engine.poison()
            ex.start(shards)
        drive(executors, gpu)
        for ex in executors:
            gpu.process = ex.device
            out = ex.wait()
            for name, t, problem in zip(ex.names, ex.program.tensors, ex.problems):
                assert (name in out) == (t.dst_block is not None)
                if name in out:
                    bad, first = mismatches(gpu.cupy.asnumpy(out[name]), t.dst_block, problem.shape, salts[name])
                    assert bad == 0, f"run {run}: device {ex.device}: {name}: {bad} elements differ, first at {first}"
    for ex in executors:
        gpu.process = ex.device
        ex.close()


@pytest.fixture(scope="module")
def limited_sync():
    """The small weight sync compiled with --max-staging-mb 16 KiB (bundles, shared messages)."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.transfer_io import load_any_problem

    plan = compile_plan(load_any_problem(ROOT / "plans" / "weight_sync_small.problem.toml"), solver="greedy",
                        max_staging_bytes=16 * 2**10)
    assert any(op.carrier is not None for op in plan.operations)
    return plan


def test_a_limited_weight_sync_runs_posted_on_fake_nccl_in_one_staging_area(limited_sync, monkeypatch):
    """order='posted' on NCCL: the tensors run one after another through one staging area per rank, the largest any
    tensor's calls need, within the peak the plan states (a quarter of the sum of the tensors' own areas on the
    trainer devices); every destination shard of every tensor bit for bit, three times."""
    plan = limited_sync
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch, order="posted")
    from xmesh_plan.executor.nccl_plan import nccl_program
    from xmesh_plan.schemas.plan_tensors import tensor_plans

    sums = []
    singles = tensor_plans(plan)
    for ex in executors:
        stage = ex.engine.stage  # one staging buffer per rank, not one per tensor
        needs = [nccl_program(lower(single, ex.device)).stage_bytes for single in singles]
        assert ex.stage_bytes == stage.nbytes == max(needs) <= plan.staging.peak_bytes[ex.device]
        sums.append(sum(needs))
    assert max(sums) > 2 * max(plan.staging.peak_bytes.values())  # one area per tensor would pass the limit
    run_transfer_on_fake(executors, gpu)


def crossing_messages(executors) -> int:
    """Cross-host bundle messages the source relays send (each counted once however NCCL calls cut it)."""
    count = 0
    for ex in executors:
        calls = ex.engine.calls.actions
        count += len({(c.op, c.group) for c in calls if getattr(c, "crossing", False) and c.root == ex.device})
    return count


@pytest.mark.parametrize("limited", [False, True], ids=["default", "max-staging"])
def test_the_weight_sync_runs_on_fake_nccl_in_device_order_with_shared_messages(limited, limited_sync, monkeypatch):
    """The default order on NCCL for a multi-tensor plan: one joint stream per rank in the plan's order
    (`JointNcclEngine`), one communicator per device group for every tensor, each shared message's bundles
    sent as one cross-host message (as many as the plan's groups, fewer than its bundles), staging within
    the device-order peak the plan states; every destination shard of every tensor bit for bit."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.transfer_io import load_any_problem
    from xmesh_plan.schemas.carriers import message_groups
    from xmesh_plan.schemas.staging import staging_peaks

    plan = limited_sync if limited else compile_plan(load_any_problem(ROOT / "plans" / "weight_sync_small.problem.toml"))
    gpu = FakeGpu(api=13).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    assert all(ex.order == "device" and ex.program.order == "device" for ex in executors)
    peaks = staging_peaks(plan, "device")
    for ex in executors:
        assert ex.stage_bytes == ex.engine.stage.nbytes or ex.stage_bytes == 0
        assert ex.stage_bytes <= peaks.get(ex.device, 0), ex.device
        assert len(ex.engine.communicators) == len(ex.engine.calls.groups) == len(set(ex.engine.calls.groups))
    bundles = [op for op in plan.operations if op.kind == "bundle"]
    groups = [g for g in message_groups(plan.operations) if g[0].kind == "bundle"]
    assert len(groups) < len(bundles)
    assert crossing_messages(executors) == len(groups)
    # one broadcast per pair of devices of each shared message (its carrier's): each other holder's, the crossing, each other needer's
    shared = [g for g in groups if len(g) > 1]
    want = sum(1 + len({h for op in g for h in op.holders if h != g[0].src})
               + len({d for op in g for need in op.needers for d in need if d != g[0].dsts[0]}) for g in shared)
    heads = {g[0].id for g in shared}
    sent = sum(1 for ex in executors for c in ex.engine.calls.actions
               if getattr(c, "action", None) == "bcast" and c.root == ex.device and c.op in heads)
    assert shared and sent == want
    run_transfer_on_fake(executors, gpu)


def test_random_coalesced_transfers_run_on_fake_nccl_in_device_order(monkeypatch):
    """Random multi-tensor problems (mixed element sizes, overlapping meshes), coalesced with tiny buckets so
    bundles of several tensors share messages: the joint NCCL program bit for bit, in both orders."""
    from xmesh_plan.planner.compile import compile_plan
    from tests.support.transfer import random_transfer

    ran = 0
    for seed in range(30):
        plan = compile_plan(random_transfer(seed, 6, exact=False), solver="greedy", coalesce=True, bucket_bytes=2048)
        if not any(op.carrier is not None for op in plan.operations):
            continue
        for order in ("device", "posted"):
            with monkeypatch.context() as m:
                gpu = FakeGpu(api=14 if seed % 2 else 13).install(m)
                run_transfer_on_fake(fake_nccl_transfer(plan, gpu, m, order=order), gpu, runs=2)
        ran += 1
        if ran == 4:
            break
    assert ran == 4


def test_nccl_refuses_a_plan_stating_less_staging_than_its_calls_need(monkeypatch):
    """A plan whose stated peak on one device is below what it needs there is refused before any communicator is
    made, by the checker every reader shares (the same message as `xmesh-plan verify`), naming the bytes, the device
    and the fix."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.transfer_io import load_any_problem

    plan = compile_plan(load_any_problem(ROOT / "plans" / "weight_sync_small.problem.toml"), solver="greedy",
                        max_staging_bytes=16 * 2**10)
    peaks = {**plan.staging.peak_bytes, 0: 64}
    wrong = plan.model_copy(update={"staging": plan.staging.model_copy(update={"peak_bytes": peaks})})
    for order in ("device", "posted"):
        with pytest.raises(PlanMismatchError, match=r"staging.peak_bytes states 64 B for device 0, but the plan needs \d+ B "
                                                    r"there .* recompile the plan and check it with `xmesh-plan verify`") as refused:
            with monkeypatch.context() as m:
                gpu = FakeGpu(api=14).install(m)
                try:
                    fake_nccl_transfer(wrong, gpu, m, order=order)
                finally:
                    assert not any(gpu.init_order.values()), "refused after creating communicators"
        assert str(refused.value).count("recompile the plan") == 1, refused.value  # the advice said once
