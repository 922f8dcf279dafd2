"""Multi-tensor plans: joint compile, verification, corrupted plans refused, and the executor bit for bit
against numpy slicing of each full tensor (in-process fake MPI and one real mpiexec launch)."""

from __future__ import annotations

import json
from dataclasses import replace
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from xmesh_plan.executor import ExecutorError, PlanMismatchError, ReshardingExecutor, TransferExecutor
from xmesh_plan.executor.lower import in_device_order, lower
from xmesh_plan.executor.passes import rank_program
from xmesh_plan.executor.mpi_engine import MpiEngine
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.transfer_io import build_transfer, load_any_problem
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import Plan, read_plan_file
from xmesh_plan.schemas.plan_check import check_plan, tags_used
from xmesh_plan.schemas.plan_tensors import tensor_plans
from tests.support.fake_mpi import FakeMPI, FakeWorld, WorldComm, out_of_device_order
from tests.support.launch import MPIEXEC, run_demo, torchrun
from tests.support.transfer import assert_every_shard, fake_executors, full_tensors, random_transfer, run_everywhere, slice_box, three_tensors

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "plans" / "weight_sync_small.problem.toml"
CHAINED = {"split_hosts": False, "coalesce": False}  # the plan a multi-tensor problem got by default before compile_defaults


@pytest.fixture(scope="module")
def plan():
    """Copies, sends and broadcasts of three tensors: the chained plan (both switches off), every kind the NCCL engine runs."""
    return compile_plan(three_tensors(), solver="greedy", **CHAINED)


# --- compile and verify -----------------------------------------------------------------------------------

def test_every_tensor_is_planned_and_the_plan_verifies(plan):
    report = verify_plan(plan)
    assert report.tensors == 3 and report.operations == len(plan.operations)
    assert {t.tensor for t in plan.tasks} == {0, 1, 2} and {op.tensor for op in plan.operations} == {0, 1, 2}
    assert {op.kind for op in plan.operations} >= {"copy", "broadcast"}
    assert len({t.id for t in plan.tasks}) == len(plan.tasks)  # task ids are global across tensors
    for op in plan.operations:  # every operation's box lies in its own tensor
        shape = plan.problem.tensors[op.tensor].shape
        assert len(op.region) == len(shape) and all(0 <= a < b <= n for (a, b), n in zip(op.region, shape))


def test_the_joint_plan_is_the_sum_of_its_tensors(plan):
    """Tasks and bytes match compiling each tensor alone; the joint bound is at least every tensor's own."""
    alone = [compile_plan(p, solver="greedy") for p in three_tensors().tensor_problems()]
    assert len(plan.tasks) == sum(len(a.tasks) for a in alone)
    for i, single in enumerate(alone):
        mine = [t for t in plan.tasks if t.tensor == i]
        assert sorted((t.region, t.nbytes, t.receivers) for t in mine) == sorted((t.region, t.nbytes, t.receivers) for t in single.tasks)
        assert plan.lower_bound_seconds >= single.lower_bound_seconds - 1e-12
    assert plan.predicted_seconds >= plan.lower_bound_seconds


def test_same_input_and_seed_give_a_byte_identical_plan_that_round_trips(plan):
    again = compile_plan(three_tensors(), solver="greedy", **CHAINED)
    assert again.to_json() == plan.to_json()
    assert Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    assert all("tensor" in op for op in data["operations"]) and all("tensor" in t for t in data["tasks"])


def test_a_single_tensor_plan_has_no_tensor_field_and_splits_into_itself():
    single = read_plan_file(ROOT / "plans" / "case3.plan.json")
    assert '"tensor"' not in single.to_json()
    assert tensor_plans(single) == [single]


def _without(plan: Plan, keep) -> Plan:
    ops = tuple(op for op in plan.operations if keep(op))
    return plan.model_copy(update={"operations": ops})


def test_a_plan_that_drops_one_tensor_is_refused_naming_it(plan):
    dropped = _without(plan, lambda op: op.tensor != 1)
    with pytest.raises(PlanError, match=r"tensor 'bias': destination device \d+ never receives"):
        verify_plan(dropped)


def test_a_plan_that_drops_one_box_of_one_tensor_is_refused_naming_tensor_and_box(plan):
    victim = next(op for op in plan.operations if op.tensor == 2 and op.kind != "copy")
    with pytest.raises(PlanError, match=r"tensor 'emb': destination device \d+ never receives \["):
        verify_plan(_without(plan, lambda op: op.id != victim.id))


def test_an_operation_moved_to_another_tensor_is_refused(plan):
    op = next(op for op in plan.operations if op.tensor == 0 and op.task >= 0)
    moved = tuple(o.model_copy(update={"tensor": 1}) if o.id == op.id else o for o in plan.operations)
    with pytest.raises(PlanError, match=rf"operation {op.id} \(tensor 1, task {op.task}.*belongs to task {op.task} of tensor 0"):
        check_plan(plan.model_copy(update={"operations": moved}))


@pytest.mark.parametrize("index, words", [(None, "gives every operation a tensor index"), (7, "names tensor 7")])
def test_a_tensor_index_missing_or_out_of_range_is_refused(plan, index, words):
    bad = tuple(o.model_copy(update={"tensor": index}) if o.id == 0 else o for o in plan.operations)
    with pytest.raises(PlanError, match=words):
        verify_plan(plan.model_copy(update={"operations": bad}))


def test_a_tensor_index_in_a_single_tensor_plan_is_refused():
    single = read_plan_file(ROOT / "plans" / "case3.plan.json")
    bad = tuple(o.model_copy(update={"tensor": 0}) for o in single.operations)
    with pytest.raises(PlanError, match="one tensor; drop the field"):
        check_plan(single.model_copy(update={"operations": bad}))


# --- CLI ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", [None, 999])
def test_inspect_refuses_a_bad_tensor_index_in_one_line(plan, tmp_path, index):
    bad = tuple(o.model_copy(update={"tensor": index}) if o.id == 0 else o for o in plan.operations)
    path = tmp_path / "bad.plan.json"
    path.write_text(plan.model_copy(update={"operations": bad}).to_json())
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().count("\n") == 0 and f"names tensor {index}" in result.stderr, result.stderr

def test_compile_verify_inspect_and_check_work_on_the_small_example(tmp_path):
    out = tmp_path / "small.plan.json"
    runner = CliRunner()
    result = runner.invoke(main, ["compile", str(SMALL), "-o", str(out), "--solver", "greedy", "--no-split-hosts", "--no-coalesce"])
    assert result.exit_code == 0, result.output
    assert "verified" in result.output
    result = runner.invoke(main, ["verify", str(out)])
    assert result.exit_code == 0 and "of each of 21 tensors" in result.output, result.output
    result = runner.invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert "21 tensors" in result.output and "model.layers.1.mlp.down_proj.weight" in result.output
    assert "S01 R -> R S1" in result.output
    result = runner.invoke(main, ["check", str(out), "--max-ratio", "100", "--tensors"])  # tiny tensors: per-message latency dominates
    assert result.exit_code == 0 and "ok" in result.output, result.output
    rows = {line.split()[0]: line.split()[1:] for line in result.output.splitlines()[2:]}
    assert len(rows) == 21 and rows["lm_head.weight"][0] == "4"  # 4 tasks: one per source shard of dim 0
    plan = read_plan_file(out)
    last = max(op.end_s for op in plan.operations if op.tensor == 20)
    assert float(rows["lm_head.weight"][1]) == pytest.approx(last, abs=1e-4)
    own = [float(r[2]) for r in rows.values()]
    assert all(0 <= b <= plan.lower_bound_seconds + 1e-4 for b in own) and max(own) > 0  # each alone needs no more than all
    broken = read_plan_file(out)
    broken = broken.model_copy(update={"operations": tuple(op for op in broken.operations if op.tensor != 20)})
    (tmp_path / "broken.plan.json").write_text(broken.to_json())
    result = runner.invoke(main, ["check", str(tmp_path / "broken.plan.json"), "--max-ratio", "100"])
    assert result.exit_code == 1 and "does not verify: tensor 'lm_head.weight'" in result.output, result.output


def test_compare_prices_every_solver_and_alpa_on_all_tensors_together(tmp_path):
    result = CliRunner().invoke(main, ["compare", str(SMALL), "--time-limit", "0.5"])
    assert result.exit_code == 0, result.output
    assert "alpa-send-recv" in result.output and "broadcast + greedy" in result.output and "lower bound" in result.output


# --- executor -----------------------------------------------------------------------------------------------

def test_tensors_sharing_a_communicator_get_disjoint_tags(plan):
    """Every tensor's messages take tags from its own block, the blocks one after another in tensor order."""
    counts = [sum(tags_used(op) for op in plan.operations if op.tensor == k) for k in range(len(plan.problem.tensors))]
    offsets = [sum(counts[:k]) for k in range(len(counts))]
    assert all(counts)
    seen = set()
    for ex in fake_executors(plan):
        for s in ex.program.steps:
            if s.action in ("send", "recv"):
                assert offsets[s.tensor] <= s.tag < offsets[s.tensor] + counts[s.tensor], (ex.device, s.tensor, s.tag)
                seen.add(s.tensor)
    assert seen == set(range(len(counts)))


def test_the_executor_delivers_every_tensor_bit_exact_against_numpy_slicing(plan):
    executors = fake_executors(plan)
    for seed in (1, 2):  # twice: the second run overwrites the first's buffers with other data
        full = full_tensors(plan, seed)
        out = run_everywhere(plan, executors, full)
        for device in plan_devices(plan):
            expected = {t.name: slice_box(full[t.name], p.blocks("dst")[device])
                        for t, p in zip(plan.problem.tensors, plan.problem.tensor_problems()) if device in p.blocks("dst")}
            assert set(out[device]) == set(expected), device
            for name, want in expected.items():
                got = out[device][name]
                assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), (device, name)


def test_the_executor_catches_a_shard_handed_in_under_the_wrong_name():
    """Two tensors of one shape: swapping their source shards must show in the output (the names matter)."""
    twin = compile_plan(build_transfer({"src_mesh": "1x2", "dst_mesh": "1x2", "tensors": [
        {"name": "p", "shape": [4, 4], "src": "S1 R", "dst": "R S1"}, {"name": "q", "shape": [4, 4], "src": "S1 R", "dst": "R S1"}]}),
        solver="greedy")
    full = full_tensors(twin, 3)
    swapped = {"p": full["q"], "q": full["p"]}
    out = run_everywhere(twin, fake_executors(twin), swapped)
    device = twin.problem.dst_mesh.devices[0]
    block = twin.problem.tensor_problem(0).blocks("dst")[device]
    assert np.array_equal(out[device]["p"], slice_box(full["q"], block)) and not np.array_equal(out[device]["p"], slice_box(full["p"], block))


def test_the_executor_refuses_missing_and_unknown_names(plan):
    executors = fake_executors(plan)
    source = next(ex for ex in executors if ex.program.src_block is not None)
    with pytest.raises(PlanMismatchError, match=r"'nope' is not a tensor of this plan"):
        source.start({"nope": np.zeros(1)})
    with pytest.raises(PlanMismatchError, match=r"in the source mesh; pass its shard of 'w' \(and 2 more\)"):
        source.start({})
    with pytest.raises(PlanMismatchError, match=r"shards is a list; pass a mapping of tensor name to this rank's source shard"):
        source.run([np.zeros(1), np.zeros(1)])


@pytest.mark.parametrize("concurrent,order", [(True, "posted"), (False, "posted"), (True, "device")],
                         ids=["posted-at-once", "one-after-another", "device-order"])
def test_a_wrong_later_input_is_refused_before_any_tensor_starts_and_the_executor_stays_usable(plan, concurrent, order):
    """The last tensor's shard has the wrong dtype on one source rank: start() refuses it before starting any tensor
    (nothing moved), so the same executor runs the corrected call and every peer's reshard completes bit-exact."""
    executors = fake_executors(plan, concurrent=concurrent, order=order)
    full = full_tensors(plan, 6)
    source = next(ex for ex in executors if all(t.src_block is not None for t in ex.program.tensors))
    shards = {name: slice_box(full[name], t.src_block) for name, t in zip(source.names, source.program.tensors)}
    last = source.names[-1]
    with pytest.raises(PlanMismatchError, match=f"{last}|dtype|element type|float64"):
        source.start({**shards, last: shards[last].astype(np.float64)})
    assert_every_shard(plan, run_everywhere(plan, executors, full), full)


def test_one_tensor_after_another_as_the_torch_and_nccl_engines_run_them_is_bit_exact(plan):
    """Engines that do not run reshards concurrently get the tensors one after another; the fake MPI
    stands in for them (concurrency off), so the sequencing itself is what is checked."""
    executors = fake_executors(plan, concurrent=False, order="posted")
    for seed in (4, 5):
        full = full_tensors(plan, seed)
        out = run_everywhere(plan, executors, full)
        for device, shards in out.items():
            for name, got in shards.items():
                index = plan.problem.index_of(name)
                want = slice_box(full[name], plan.problem.tensor_problem(index).blocks("dst")[device])
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (device, name)
        assert sum(len(s) for s in out.values()) == sum(len(p.blocks("dst")) for p in plan.problem.tensor_problems())
    with pytest.raises(ExecutorError, match="wait\\(\\) called without start\\(\\)"):
        executors[0].wait()


def test_a_multi_tensor_plan_is_refused_by_the_single_tensor_executor(plan):
    with pytest.raises(TypeError, match="moves 3 tensors; run it with executor.TransferExecutor"):
        ReshardingExecutor(plan, WorldComm(FakeWorld(), 0, 6))


def test_the_nccl_engine_runs_the_tensors_in_device_order_by_default_and_one_after_another_posted(plan):
    """Device order (the default on NCCL) replays every tensor's operations in the plan's order across tensors;
    posted runs them one after another, NCCL not being concurrent (tests/test_executor_gpu.py runs both on the fake CuPy)."""
    for order in ("device", None):
        ex = TransferExecutor(plan, WorldComm(FakeWorld(), 0, 6), backend="nccl", order=order)
        assert ex.order == "device" and not ex.entry.concurrent
    ex = TransferExecutor(plan, WorldComm(FakeWorld(), 0, 6), backend="nccl", order="posted")
    assert ex.order == "posted"
    position = {op.id: k for k, op in enumerate(plan.operations)}
    spans = 0
    for device in plan_devices(plan):
        joint = rank_program(plan, device, "device", concurrent=False)
        assert joint.order == "device" and [position[s.op] for s in joint.steps] == sorted(position[s.op] for s in joint.steps)
        spans += len({s.tensor for s in joint.steps}) > 1 and [s.tensor for s in joint.steps] != sorted(s.tensor for s in joint.steps)
        posted = rank_program(plan, device, "posted", concurrent=False)
        assert [s.tensor for s in posted.steps] == sorted(s.tensor for s in posted.steps)
        assert [c.tensor for c in posted.collectives] == sorted(c.tensor for c in posted.collectives)
    assert spans  # device order interleaves tensors somewhere; one after another never does


def test_the_default_order_is_posted_for_a_multi_tensor_plan_on_mpi_device_otherwise(plan):
    """Measured: the joint weight sync ran 2.76x faster posted on MPI; torch's posted runs tensors one after another."""
    from xmesh_plan.executor.transfer_executor import default_order
    from xmesh_plan.schemas.plan_tensors import tensor_plans
    single = tensor_plans(plan)[0]
    assert [default_order(plan, b) for b in ("mpi", "nccl", "torch")] == ["posted", "device", "device"]
    assert [default_order(single, b) for b in ("mpi", "nccl", "torch")] == ["device"] * 3
    assert TransferExecutor(plan, WorldComm(FakeWorld(), 0, 6)).order == "posted"
    from xmesh_plan.executor.engines import engine_entry
    for backend in ("gloo", "nccl", "torch"):  # over a torch process group each names the torch engine
        assert default_order(plan, engine_entry(backend, "torch").name) == "device"
    with pytest.raises(ValueError, match="order 'fifo' is unknown; use one of: posted, device"):
        TransferExecutor(plan, WorldComm(FakeWorld(), 0, 6), order="fifo")


def _demo_on_the_small_weight_sync(tmp_path, ranks: int, *flags: str, timeout: float) -> subprocess.CompletedProcess:
    """`mpiexec -n ranks python -m xmesh_plan.executor.run` on the small weight sync's plan, with --check."""
    path = tmp_path / "weight_sync_small.plan.json"
    path.write_text(compile_plan(load_any_problem(SMALL), solver="greedy", **CHAINED).to_json())
    return run_demo(ranks, path, "--check", *flags, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC}")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("order", [None, "device", "posted"])
def test_mpiexec_runs_the_small_weight_sync_bit_exact(tmp_path, order):
    """In device order one joint engine per rank runs all 21 tensors; posted (the default on MPI), one engine per tensor."""
    flags = ("--order", order) if order else ()
    result = _demo_on_the_small_weight_sync(tmp_path, 8, "--iters", "2", "--warmup", "1", *flags, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check ok: 21 tensors x 4 destination shards bit-exact" in result.stdout, result.stdout
    assert f"({order or 'posted'} order)" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC}")
@pytest.mark.timeout(300)
def test_a_world_of_the_wrong_size_is_refused_naming_the_plan_not_a_tensor(tmp_path):
    result = _demo_on_the_small_weight_sync(tmp_path, 3, timeout=250)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "plan weight_sync_small uses 8 devices" in result.stderr and "mpiexec -n 8" in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(800)
@pytest.mark.parametrize("order, how", [(None, "device order across tensors"), ("posted", "tensors one after another")])
def test_torchrun_runs_the_small_weight_sync_on_gloo_bit_exact(tmp_path, order, how):
    """The torch engine (device order: one joint engine; posted: tensors one after another), each destination
    shard against numpy slicing of its tensor's pattern."""
    pytest.importorskip("torch")
    path = tmp_path / "weight_sync_small.plan.json"
    path.write_text(compile_plan(load_any_problem(SMALL), solver="greedy", **CHAINED).to_json())
    result = torchrun(8, "xmesh_plan.executor.torch_run", str(path), "--check", "--iters", "2", *(("--order", order) if order else ()),
                      timeout=700)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"21 tensors, 8 ranks, 100 ops, torch/gloo ({how})" in result.stdout, result.stdout
    assert "check ok: every destination shard of every tensor bit-exact" in result.stdout, result.stdout


# --- verify and the executor's lowering agree on mutated multi-tensor plans --------------------------------

def _lowering_refuses(plan: Plan) -> str | None:
    """What TransferExecutor does on every rank before a byte moves: the shared checks, then each tensor lowered."""
    try:
        check_plan(plan)
    except PlanError as err:
        return str(err)
    for single in tensor_plans(plan):
        for device in plan_devices(plan):
            try:
                lower(single, device)
            except PlanMismatchError as err:
                return str(err)
    return None


def test_verify_and_the_lowering_agree_on_mutated_multi_tensor_plans():
    import random

    from pydantic import ValidationError
    from tests.support.mutations import as_lists, mutate

    bases = [compile_plan(three_tensors(), solver="greedy", **CHAINED),
             compile_plan(three_tensors(), strategy="local_allgather", solver="greedy", **CHAINED),
             compile_plan(load_any_problem(SMALL), strategy="auto", solver="greedy", **CHAINED)]
    assert {op.kind for b in bases for op in b.operations} == {"copy", "broadcast", "send", "allgather"}
    raws = [as_lists(b.model_dump()) for b in bases]
    rng = random.Random(11)
    valid = rejected = 0
    disagreements = []
    while valid < 300:
        raw = as_lists(rng.choice(raws))
        if rng.random() < 0.15:  # move an operation to another tensor, or past the last one
            op = rng.choice(raw["operations"])
            op["tensor"] = rng.choice([0, 1, 2, len(raw["problem"]["tensors"]), op["tensor"] + 1])
            kind = "tensor"
        else:
            try:
                kind = mutate(rng, raw)
            except KeyError:  # the single-tensor "shape" mutation: change one tensor's shape instead
                tensor = rng.choice(raw["problem"]["tensors"])
                tensor["shape"][0] = max(0, tensor["shape"][0] + rng.choice([-1, 1, 7]))
                kind = "shape"
        if not raw["operations"]:
            continue
        try:
            mutant = Plan.model_validate(raw)
        except ValidationError:
            continue
        valid += 1
        try:
            verify_plan(mutant)
            verdict = None
        except PlanError as err:
            verdict = str(err)
        refusal = _lowering_refuses(mutant)
        rejected += verdict is not None
        if (verdict is None) != (refusal is None):
            disagreements.append(f"{kind}: verify {verdict or 'passes'}; lowering {refusal or 'accepts'}")
    assert not disagreements, "\n".join(disagreements[:10])
    assert rejected > valid // 2


# --- one unit task per receiving host (--split-hosts) ------------------------------------------------------

def test_split_hosts_gives_one_task_per_receiving_host_and_stays_correct(plan):
    split = compile_plan(three_tensors(), solver="greedy", split_hosts=True, coalesce=False)
    verify_plan(split)
    host = split.problem.cluster.host_of
    assert all(len({host(d) for d in t.receivers}) == 1 for t in split.tasks)
    expected = sum(len({host(d) for d in t.receivers}) for t in plan.tasks)  # the unsplit plan's boxes, one per receiving host
    assert len(split.tasks) == expected > len(plan.tasks)
    assert split.lower_bound_seconds == plan.lower_bound_seconds  # a bound of the problem, not of how it is cut
    assert split.solver.details["split_hosts"] == "one unit task per receiving host" and "split_hosts" not in plan.solver.details
    full = full_tensors(split, 9)
    out = run_everywhere(split, fake_executors(split), full)
    for device, shards in out.items():
        for name, got in shards.items():
            want = slice_box(full[name], split.problem.tensor_problem(split.problem.index_of(name)).blocks("dst")[device])
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (device, name)


def test_split_hosts_beats_the_chained_plan_on_the_small_weight_sync():
    """Each box of the weight sync goes to one device on each of two hosts: a two-hop chain holds both
    hosts' receive sides, one task per host does not (predicted by the same simulator)."""
    small = load_any_problem(SMALL)
    chained, split = compile_plan(small, **CHAINED), compile_plan(small, split_hosts=True, coalesce=False)
    assert split.predicted_seconds < chained.predicted_seconds
    assert split.lower_bound_seconds == chained.lower_bound_seconds


def test_each_tensor_of_a_multi_tensor_plan_runs_bit_exact_on_the_fake_nccl(plan, monkeypatch):
    """Each tensor's plan of a multi-tensor plan on its own (as the NCCL engine's posted order runs them, one
    after another) on the fake CuPy/NCCL of test_executor_gpu (every CuPy call checked against the real API), bit for bit."""
    from tests.support.fake_gpu import FakeGpu, run_on_fake

    for single in tensor_plans(plan):
        run_on_fake(single, FakeGpu(api=14).install(monkeypatch), iterations=2)


# --- device order across tensors -----------------------------------------------------------------------------

def test_the_whole_plan_lowering_is_each_tensors_lowering_in_the_plans_order(plan):
    """`lower(plan, device)` keeps every step and dependency each tensor's own plan lowers to, puts them in the
    plan's operation order, and numbers each tensor's tags after the tensors before it; device order gates the same
    steps and re-bases their staging."""
    position = {op.id: k for k, op in enumerate(plan.operations)}
    counts = [sum(tags_used(op) for op in plan.operations if op.tensor == k) for k in range(len(plan.problem.tensors))]
    for device in plan_devices(plan):
        whole = lower(plan, device)
        assert [position[s.op] for s in whole.steps] == sorted(position[s.op] for s in whole.steps)
        for t, single in enumerate(tensor_plans(plan)):
            mine = lower(single, device).steps
            theirs = [s for s in whole.steps if s.tensor == t]
            assert len(theirs) == len(mine)
            local = {s.index: j for j, s in enumerate(theirs)}
            for s, own in zip(theirs, mine):
                assert all(d < s.index for d in s.deps)
                moved = replace(s, index=local[s.index], deps=tuple(sorted(local[d] for d in s.deps)), tag=s.tag - sum(counts[:t]) if s.action.is_message else s.tag,
                                tensor=0, data=None, box=s.box and replace(s.box, tensor=0), target=s.target and replace(s.target, tensor=0))
                assert moved == replace(own, data=None)
                assert (s.data is None) == (own.data is None) and (s.data is None or s.data.nbytes == own.data.nbytes)
        gated = in_device_order(whole)
        assert gated.order == "device" and [replace(s, deps=(), data=None) for s in gated.steps] == \
            [replace(s, deps=(), data=None) for s in whole.steps]
        assert [s.data.nbytes for s in gated.steps if s.data] == [s.data.nbytes for s in whole.steps if s.data]


def test_device_order_refuses_calls_out_of_turn_after_an_error_and_after_close(plan):
    from xmesh_plan.executor import PeerTimeoutError

    executors = fake_executors(plan)
    receiver = next(ex for ex in executors if ex.program.src_block is None)
    with pytest.raises(ExecutorError, match=r"wait\(\) called without start\(\)"):
        receiver.wait()
    assert receiver.test()  # nothing in flight
    receiver.engine.timeout_s = 0.05
    receiver.start()  # alone: nobody sends
    with pytest.raises(PeerTimeoutError, match=rf"device {receiver.device} .*nothing completed for 0.05 s"):
        receiver.wait()
    with pytest.raises(ExecutorError, match=r"this executor stopped after an error \(nothing completed for 0.05 s\); close\(\) it"):
        receiver.start()
    receiver.close()
    with pytest.raises(ExecutorError, match=r"run\(\) or start\(\) after close\(\)"):
        receiver.run()


def _order_plans() -> list[Plan]:
    """Multi-tensor plans with every operation kind and several tensors interleaved in one plan."""
    return [compile_plan(three_tensors(), solver="greedy", **CHAINED),
            compile_plan(three_tensors(), strategy="local_allgather", solver="greedy", **CHAINED),
            compile_plan(load_any_problem(SMALL), solver="greedy", **CHAINED),
            compile_plan(load_any_problem(SMALL), split_hosts=True, coalesce=False),
            compile_plan(load_any_problem(SMALL), solver="greedy", split_hosts=True, coalesce=True)]


def _violations(plan: Plan, order: str, executors: list[TransferExecutor] | None = None) -> list[str]:
    """Run once on the fake MPI in `order`; messages that moved ahead of an earlier operation with other peers."""
    executors = executors or fake_executors(plan, order=order)
    run_everywhere(plan, executors, full_tensors(plan, 8))
    steps = {ex.device: ex.engine.program.steps for ex in executors}
    world = executors[0].engine.comm.world
    return out_of_device_order(plan, world, steps_of=steps.get)


@pytest.mark.parametrize("index", range(5))
def test_device_order_spans_tensors_one_operation_at_a_time_on_the_wire(index):
    """No message of a later operation moves before an earlier one's with other peers has landed, whichever
    tensors the two belong to (the plans interleave tensors, so per-tensor order alone would fail this)."""
    plan = _order_plans()[index]
    assert len({op.tensor for op in plan.operations}) > 1
    assert _violations(plan, "device") == []


def test_posted_order_and_per_tensor_device_order_send_ahead_of_earlier_operations():
    """The check above can fail: posting every message at once, or ordering each tensor's operations apart
    (the joint engine's steps with the gates of their own tensor only), starts some messages early."""
    assert sum(len(_violations(p, "posted")) for p in _order_plans()) > 0
    plan = _order_plans()[2]
    executors = fake_executors(plan, order="posted")
    for ex in executors:  # each tensor in device order on its own, all tensors at once
        ex.engine = MpiEngine(_each_tensor_in_device_order(ex.program), ex.engine.comm, ex.engine.rank_of, 5.0, (1e-5, 1e-4))
        ex.engine.setup(mpi=FakeMPI)
    assert _violations(plan, "posted", executors)


def _each_tensor_in_device_order(program):
    """`in_device_order` applied to each tensor's steps alone (gates within a tensor only), every tensor posted at
    once, each in its own part of staging."""
    steps, base = [], 0
    for t in range(len(program.tensors)):
        mine = [s for s in program.steps if s.tensor == t]
        local = {s.index: j for j, s in enumerate(mine)}
        alone = in_device_order(replace(program, steps=tuple(replace(s, index=local[s.index], deps=tuple(local[d] for d in s.deps))
                                                            for s in mine)))
        first = len(steps)
        for s in alone.steps:
            data = s.data
            if data is not None and data.buffer == "stage":
                data = replace(data, start=data.start + base, stop=data.stop + base)
            steps.append(replace(s, index=s.index + first, deps=tuple(d + first for d in s.deps), data=data))
        base += alone.stage_bytes
    return replace(program, steps=tuple(steps), stage_bytes=base, order="device")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), strategy=st.sampled_from(("broadcast", "send_recv", "local_allgather", "global_allgather", "auto")),
       devices=st.integers(1, 9), order=st.sampled_from(("device", "posted")), coalesce=st.booleans(),
       split_hosts=st.booleans())
def test_random_multi_tensor_plans_are_bit_exact_in_both_orders(seed, strategy, devices, order, coalesce, split_hosts):
    plan = compile_plan(random_transfer(seed, devices), strategy=strategy, solver="greedy", seed=0, coalesce=coalesce,
                        split_hosts=split_hosts, bucket_bytes=256)
    verify_plan(plan)
    executors = fake_executors(plan, order=order)
    for it in range(2):  # twice: the second run overwrites the first's buffers with other data
        full = full_tensors(plan, seed + it)
        assert_every_shard(plan, run_everywhere(plan, executors, full), full)
    if order == "device" and len(plan.problem.tensors) > 1:
        assert _violations(plan, "device") == []


def test_lowering_walks_only_the_operations_its_device_takes_part_in(plan, monkeypatch):
    """`lower(plan, device)` reads the plan's per-device index, so its cost grows with the device's share of the plan:
    every lowering call it makes is for an operation the device is a member of, each once, in plan order."""
    from xmesh_plan.executor import lower as lowering
    from xmesh_plan.schemas.op_kinds import members

    seen = []
    for pattern, handler in dict(lowering._LOWER).items():
        monkeypatch.setitem(lowering._LOWER, pattern, lambda b, op, base, handler=handler: (seen.append(op.id), handler(b, op, base))[1])
    for device in plan_devices(plan):
        seen.clear()
        lowering.lower(plan, device)
        assert seen == [op.id for op in plan.operations if device in members(op)], device
        assert len(seen) < len(plan.operations)
