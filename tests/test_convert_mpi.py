"""Conversion at the sender run by the MPI engine (`executor.convert_host`): under real `mpiexec` ranks, the plans of
tests/test_convert_torch.py (every sender hook on fp16, bf16, FP8 with block and per-tensor scales; per-tensor scales
over replicated and uneven sources, whose senders swap their amax), every destination element and scale bit for bit
against torch's own cast of the whole tensor (tests/workers/convert_worker.py); on the in-process fake MPI
(tests/support/fake_mpi.py), the same plans and checks with the order of each rank's casts and sends recorded: a
tensor is cast just before the first step reading it starts, after the sends of tensors read earlier."""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.support.launch import MPI_LAUNCH_TIMEOUT_S, MPIEXEC, ROOT, mpiexec

WORKER = ROOT / "tests" / "workers" / "convert_worker.py"
MPI_MARKS = [pytest.mark.mpi, pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)"),
             pytest.mark.timeout(2 * MPI_LAUNCH_TIMEOUT_S)]


def under_mpiexec(test):
    for mark in MPI_MARKS:
        test = mark(test)
    return test


@under_mpiexec
def test_every_sender_hook_and_swapped_scale_converts_bit_exact_on_4_mpi_ranks():
    result = mpiexec(4, str(WORKER), "mpi")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    runs = ["mpi device order", "mpi posted", "mpi replicated"]
    for rank in range(4):
        mine = sorted(line.split(": ", 1)[1] for line in lines if line.startswith(f"rank {rank}:"))
        assert mine == sorted([f"{run} step {k}: ok" for run in runs for k in (0, 1)] + ["one tensor: ok"]), lines


@under_mpiexec
def test_the_mpi_demo_refuses_a_converting_plan_in_one_line_on_every_rank(tmp_path):
    """The demo fills and checks shards of the source dtype, which a conversion does not keep: refused before any byte
    moves, as the torch demo refuses it (the MPI engine itself runs such a plan)."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.problem_io import build_problem
    from xmesh_plan.schemas.plan_io import write_plan_file

    mesh = {"shape": [2], "devices": [0, 1]}
    plan = compile_plan(build_problem({"shape": [8, 4], "dtype": "float32", "dst_dtype": "fp16", "src": {"mesh": mesh, "spec": "S0 R"},
                                       "dst": {"mesh": mesh, "spec": "R S0"}}), solver="greedy")
    path = tmp_path / "cast.plan.json"
    write_plan_file(path, plan)
    result = mpiexec(2, "-m", "xmesh_plan.executor.run", str(path), "--check")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "check ok" not in result.stdout
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert "the plan converts float32 to float16 at the sender, and this command fills and checks shards of the source dtype" \
        in result.stderr, result.stderr


TAG_UB = 2**21  # the fake's tag limit: above every plan tag (lowered with tag_limit 2**20), so the amax swaps' tag is free


class _TagMPI:
    """`tests.support.fake_mpi.FakeMPI` with the attribute key the engine asks the communicator for."""

    from tests.support.fake_mpi import FakeMPI as _base

    BYTE, Exception, TAG_UB = _base.BYTE, _base.Exception, "tag_ub"


def fake_ranks(raw: dict, order: str):
    """(plan, world, one TransferExecutor per rank over one fake MPI world, set up as prepare() sets it up, each rank's
    casts logged into the world's log as ("cast", (rank, tensor)) next to its ("send", (rank, peer, tag)) events)."""
    from xmesh_plan.executor import TransferExecutor
    from xmesh_plan.executor.mpi_engine import MpiEngine
    from xmesh_plan.executor.passes import rank_program
    from xmesh_plan.executor.ranks import plan_devices, rank_of_devices
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.transfer_io import build_transfer
    from tests.support.fake_mpi import FakeComm, FakeWorld, WorldComm

    class TagComm(FakeComm):
        """Answers TAG_UB, and moves the amax swaps' float32 buffers as their bytes (the fake moves uint8 buffers)."""

        def Get_attr(self, key):
            assert key == _TagMPI.TAG_UB
            return TAG_UB

        def Send_init(self, spec, dest: int, tag: int):
            return super().Send_init([spec[0].view(np.uint8), *spec[1:]], dest, tag)

        def Recv_init(self, spec, source: int, tag: int):
            return super().Recv_init([spec[0].view(np.uint8), *spec[1:]], source, tag)

    plan = compile_plan(build_transfer(raw))
    devices, rank_of = plan_devices(plan), rank_of_devices(plan)
    world, out = FakeWorld(), []
    for rank, device in enumerate(devices):
        ex = TransferExecutor(plan, WorldComm(world, rank, len(devices)), order=order)
        ex.program = rank_program(plan, device, order, True, tag_limit=2**20)
        ex.engine = MpiEngine(ex.program, TagComm(world, rank), rank_of, 5.0, (1e-5, 1e-4))
        ex.engine.setup(mpi=_TagMPI)
        _log_casts(ex.engine, world.log, rank)
        out.append(ex)
    return plan, world, out


def _log_casts(engine, log: list, rank: int) -> None:
    """Make `engine` log each cast it does (the converted shard it writes names the tensor) into `log`."""
    real = engine.convert

    def convert_shard(out, *rest):
        log.append(("cast", (rank, next(t for t, typed in enumerate(engine.src_typed) if typed is out))))
        real.convert_shard(out, *rest)

    engine.convert = types.SimpleNamespace(amax=real.amax, tensor_scale=real.tensor_scale, block_scales=real.block_scales,
                                           put=real.put, convert_shard=convert_shard)


def run_fake(plan, executors: list, step: int, into=None) -> tuple[list[dict], dict]:
    """Every rank's reshard of the convert worker's values at `step` (`into`: per rank, its mapping or None); the
    outputs and the whole tensors."""
    from tests.workers.convert_worker import box_of, cut, whole

    problem = plan.problem
    fulls = {t.name: whole(t.name, t.shape, t.dtype, step) for t in problem.tensors if t.scale_of is None}
    for rank, ex in enumerate(executors):
        shards = {name: cut(full, box_of(problem, name, "src", rank)).contiguous()
                  for name, full in fulls.items() if box_of(problem, name, "src", rank) is not None}
        ex.start(shards or None, None if into is None else into[rank])
    for _ in range(10_000):
        if all([ex.test() for ex in executors]):
            break
    else:
        pytest.fail("stalled")
    return [ex.wait() for ex in executors], fulls


def wrong_elements(plan, outs: list[dict], fulls: dict) -> list[str]:
    """The destination shards (and scales) of every rank that differ in any bit from torch's own cast of the whole tensor."""
    from tests.workers.convert_worker import as_torch, bits, box_of, cut, reference
    import torch

    wrong = []
    for rank, out in enumerate(outs):
        for t in plan.problem.tensors:
            if t.scale_of is not None:
                continue
            values, scales = reference(t, fulls[t.name])
            for name, want in ((t.name, values), (t.name + ".scale", scales)):
                box = box_of(plan.problem, name, "dst", rank) if want is not None else None
                if box is None:
                    continue
                got = as_torch(out[name], str(want.dtype).removeprefix("torch."))
                if got.dtype != want.dtype or not torch.equal(bits(got), bits(cut(want, box))):
                    wrong.append(f"rank {rank} {name}")
    return wrong


def _carried(engine, step) -> frozenset:
    """The tensors whose source shard (cast or not) a send step of `engine` carries: its own, or those packed into the
    staging it sends (the packs it waits for)."""
    if step.data.buffer == "src":
        return frozenset([step.data.tensor])
    packs = [engine.steps[d] for d in step.deps]
    return frozenset(p.box.tensor for p in packs if p.action == "pack" and p.box.side == "src")


SINGLE = {"src_mesh": {"shape": [1], "devices": [0]}, "dst_mesh": {"shape": [2], "devices": [1, 2]}, "dtype": "float32",
          "tensors": [{"name": "s", "shape": [40, 6], "src": "R R", "dst": "S0 R", "dst_dtype": "fp8", "scale": "tensor"},
                      {"name": "h", "shape": [8, 3], "src": "R R", "dst": "R R", "dst_dtype": "float16"}]}
SPLIT = {"src_mesh": {"shape": [2], "devices": [0, 1]}, "dst_mesh": {"shape": [1], "devices": [2]}, "dtype": "float32",
         "tensors": [{"name": "t", "shape": [1, 6], "src": "S0 R", "dst": "R R", "dst_dtype": "fp8", "scale": "tensor"}]}


def _plans():
    """The convert worker's plans, and two whose per-tensor scale has a single sender, which swaps no amax and takes its
    own at cast time (`conversions.cast_once`): a one-device source mesh, and a split whose other sender's box is empty."""
    from tests.workers.convert_worker import HOOKS, REPLICATED4

    return {"hooks": HOOKS, "replicated": REPLICATED4, "single": SINGLE, "split": SPLIT}


@pytest.mark.parametrize("order", ["device", "posted"])
@pytest.mark.parametrize("name", ["hooks", "replicated", "single", "split"])
def test_each_tensor_is_cast_just_before_its_first_reader_after_earlier_tensors_sends(name, order):
    """Bit for bit against torch's `.to()` twice, and per rank: each tensor it sends is cast once, before any send of
    it; on the hooks plan, some tensor that no amax swap holds back is cast after a send of another tensor was started
    (a rank casting those in start(), before its first message, fails this; tensors whose per-tensor scale waits for
    the swap were cast after other sends either way). The swapped per-tensor scales (replicated, uneven senders) too,
    and a per-tensor scale of a single sender, whose amax is taken at cast time (single, split)."""
    plan, world, executors = fake_ranks(_plans()[name], order)
    for step in range(2):
        del world.log[:]
        outs, fulls = run_fake(plan, executors, step)
        assert wrong_elements(plan, outs, fulls) == []
        later = []  # (rank, tensor cast, the tensors a send started before it carries)
        for rank, ex in enumerate(executors):
            engine = ex.engine
            carries = {(engine.peer_rank[s.index], s.tag): _carried(engine, s) for s in engine.steps if s.action == "send"}
            events = [(kind, key[1] if kind == "cast" else carries.get((key[1], key[2]), frozenset()))
                      for kind, key in world.log if key[0] == rank and kind != "recv"]
            cast_at = {t: k for k, (kind, t) in enumerate(events) if kind == "cast"}
            converted = {t for t, _, buffer in engine.converting if buffer is not None}
            unswapped = {t for t, conversion, _ in engine.converting if not conversion.peers}
            assert set(cast_at) == converted and len(cast_at) == sum(kind == "cast" for kind, _ in events), (rank, events)
            for k, (kind, what) in enumerate(events):
                if kind == "send":
                    assert all(cast_at[t] < k for t in what & converted), f"rank {rank} sent {what} before casting it"
                elif what in unswapped:
                    later += [(rank, what, sent) for was, sent in events[:k] if was == "send" and sent and what not in sent]
        assert later or name != "hooks", "every rank cast every tensor that no swap holds back before its first send"
