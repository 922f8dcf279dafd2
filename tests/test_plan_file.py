"""A rank lowers a plan from its part alone: the whole plan is checked once per plan object, and a rank of a
compact plan file reads, checks and lowers only the operations its device takes part in (`executor.plan_file`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from xmesh_plan.executor import PlanMismatchError, TransferExecutor
from xmesh_plan.executor.executor import plan_fingerprint
from xmesh_plan.executor.lower import lower, lower_device_ops
from xmesh_plan.executor.mpi_engine import MpiEngine
from xmesh_plan.executor.passes import rank_program
from xmesh_plan.executor.plan_file import PlanFile, open_plan
from xmesh_plan.executor.ranks import plan_devices, rank_of_devices
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Plan, read_plan_file
from xmesh_plan.schemas.files import write_atomic
from xmesh_plan.schemas.plan_compact import compact_bytes
from xmesh_plan.schemas.plan_io import read_plan_ops
from tests.support.fake_mpi import FakeComm, FakeMPI, FakeWorld, WorldComm
from tests.support.launch import MPIEXEC, mpiexec
from tests.support.transfer import assert_every_shard, full_tensors, random_transfer, run_everywhere, three_tensors

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = sorted((ROOT / "plans").glob("*.plan.json"))


def _compact(plan: Plan, tmp_path: Path, name: str = "x.plan.npz") -> Path:
    path = tmp_path / name
    write_atomic(path, compact_bytes(plan))
    return path


def _same_programs_from_the_file(plan: Plan, path: Path) -> None:
    """Every device's program from its part of the file equals the whole plan's, posted and after the passes."""
    source = PlanFile.read(path)
    for device in plan_devices(plan):
        assert lower_device_ops(read_plan_ops(path, device), device, 2**20) == lower(plan, device, 2**20), device
        for order, concurrent in (("device", True), ("posted", False), ("posted", True)):
            whole = rank_program(plan, device, order, concurrent, 2**20)
            assert rank_program(source, device, order, concurrent, 2**20) == whole
            # an engine that replays steps gets the same program, less the group calls only NCCL's replays
            assert rank_program(source, device, order, concurrent, 2**20, collectives=False) == replace(whole, collectives=())


@pytest.mark.parametrize("path", REFERENCE, ids=lambda p: p.name)
def test_a_rank_lowers_the_same_program_from_its_part_of_a_reference_plan(path, tmp_path):
    plan = read_plan_file(path)
    _same_programs_from_the_file(plan, _compact(plan, tmp_path))


def test_a_plan_file_s_header_is_read_with_the_collector_paused(tmp_path, monkeypatch):
    """`PlanFile.read` parses a large problem's header (10^6 lists and tuples) with the cyclic collector off, whose passes
    over them would cost more than the parse, and on again after it."""
    import gc

    from xmesh_plan.executor import plan_file

    plan = compile_plan(three_tensors(), strategy="auto", seed=0)
    path = _compact(plan, tmp_path)
    seen, read = [], plan_file.read_plan_head
    monkeypatch.setattr(plan_file, "read_plan_head", lambda *args: seen.append(gc.isenabled()) or read(*args))
    assert gc.isenabled()
    PlanFile.read(path).close()
    assert seen == [False] and gc.isenabled()


def test_a_plan_file_s_header_is_parsed_once_for_the_header_and_every_part_read(tmp_path, monkeypatch):
    """The parts read through `PlanFile.device_ops` take the header `PlanFile.read` checked (less the problem, which the
    `PlanFile` holds), not a second parse of its JSON (megabytes for a large problem's boxes)."""
    from xmesh_plan.schemas import plan_compact

    plan = compile_plan(three_tensors(), strategy="auto", seed=0)
    path = _compact(plan, tmp_path)
    parsed, read = [], plan_compact._read_header
    monkeypatch.setattr(plan_compact, "_read_header", lambda m: parsed.append(1) or read(m))
    source = PlanFile.read(path)
    parts = [source.device_ops(device) for device in plan_devices(plan)]
    source.close()
    assert len(parsed) == 1
    assert [p.operations for p in parts] == [read_plan_ops(path, device).operations for device in plan_devices(plan)]


@pytest.mark.parametrize("seed", range(12))
def test_a_rank_lowers_the_same_program_from_its_part_of_a_random_multi_tensor_plan(seed, tmp_path):
    plan = compile_plan(random_transfer(seed, max_devices=8), strategy="auto", seed=0)
    _same_programs_from_the_file(plan, _compact(plan, tmp_path))


def _file_executors(path: Path, order: str, then=lambda: None) -> list[TransferExecutor]:
    """One TransferExecutor per rank from the file entry over one fake MPI world, each with the program prepare()
    makes (its own part of the file, `passes.rank_program` on `ex.plan`) replayed by an MpiEngine; `then()` runs
    after every rank made its executor, before any reads its part."""
    head = PlanFile.read(path)
    devices, rank_of = plan_devices(head), rank_of_devices(head)
    head.close()
    world = FakeWorld()
    executors = [TransferExecutor.from_file(path, WorldComm(world, rank, len(devices)), order=order) for rank in range(len(devices))]
    then()
    out = []
    for rank, ex in enumerate(executors):
        assert isinstance(ex.plan, PlanFile)
        ex.program = rank_program(ex.plan, ex.device, order, True, tag_limit=2**20, collectives=ex.entry.collectives)
        assert not ex.program.collectives  # the MPI engine replays the steps: the lowering leaves the group calls out
        ex.engine = MpiEngine(ex.program, FakeComm(world, rank), rank_of, 5.0, (1e-5, 1e-4))
        ex.engine.setup(mpi=FakeMPI)
        out.append(ex)
    return out


@pytest.mark.parametrize("order", ["device", "posted"])
@pytest.mark.parametrize("seed", range(6))
def test_executors_from_a_compact_file_run_bit_exact_on_fake_mpi(seed, order, tmp_path):
    plan = compile_plan(three_tensors() if seed == 0 else random_transfer(seed, max_devices=8), strategy="auto", seed=0)
    executors = _file_executors(_compact(plan, tmp_path), order)
    for it in range(2):
        full = full_tensors(plan, seed=it)
        assert_every_shard(plan, run_everywhere(plan, executors, full), full)


def test_a_file_replaced_after_the_executors_were_made_is_run_as_the_file_they_read(tmp_path):
    """A recompile renames a new file over the path between from_file() and prepare(): every rank still reads its
    operations and the fingerprint from the file it read the header of (its open handle), not the new one."""
    plan = compile_plan(three_tensors(), strategy="auto", seed=0)
    moved = compile_plan(three_tensors(dst_devices=(3, 5, 4)), strategy="auto", seed=0)  # the same devices, other boxes
    path = _compact(plan, tmp_path)
    executors = _file_executors(path, "device", then=lambda: write_atomic(path, compact_bytes(moved)))
    first = PlanFile.read(_compact(plan, tmp_path, "first.plan.npz"))  # a copy of the file the executors were made on
    assert {plan_fingerprint(ex.plan).tobytes() for ex in executors} == {plan_fingerprint(first).tobytes()}
    first.close()
    full = full_tensors(plan, seed=0)
    assert_every_shard(plan, run_everywhere(plan, executors, full), full)
    for ex in executors:
        ex.close()
        assert ex.plan.handle.closed  # close() closes the file from_file() opened


def test_every_rank_of_one_file_agrees_on_its_fingerprint_and_another_file_differs(tmp_path):
    plan = compile_plan(three_tensors(), strategy="auto", seed=0)
    path = _compact(plan, tmp_path)
    copy = tmp_path / "copy.plan.npz"
    copy.write_bytes(path.read_bytes())
    assert np.array_equal(plan_fingerprint(open_plan(path)), plan_fingerprint(open_plan(copy)))
    other = compile_plan(random_transfer(3, max_devices=8), strategy="auto", seed=0)
    assert not np.array_equal(plan_fingerprint(open_plan(path)), plan_fingerprint(open_plan(_compact(other, tmp_path, "o.plan.npz"))))
    assert isinstance(open_plan(ROOT / "plans" / "case3.plan.json"), Plan)  # JSON has no index: read whole


def test_a_rank_refuses_a_fault_in_its_own_operations_with_the_checker_s_message(tmp_path):
    plan = compile_plan(three_tensors(), strategy="auto", seed=0)
    k = next(i for i, op in enumerate(plan.operations) if op.kind == "broadcast")
    op = plan.operations[k]
    outside = tuple((a, b + 1000) for a, b in op.region)
    bad = plan.model_copy(update={"operations": (*plan.operations[:k], op.model_copy(update={"region": outside}),
                                                 *plan.operations[k + 1:])})
    path = _compact(bad, tmp_path)
    with pytest.raises(PlanMismatchError) as whole:
        lower(bad, op.src)
    with pytest.raises(PlanMismatchError) as part:
        lower_device_ops(read_plan_ops(path, op.src), op.src)
    assert str(part.value) == str(whole.value) and "is not a box inside the tensor" in str(part.value)
    other = next(d for d in plan_devices(plan) if d not in (op.src, *op.dsts))
    lower_device_ops(read_plan_ops(path, other), other)  # a rank the operation does not touch lowers its part


def _counting_checks(monkeypatch) -> list[int]:
    """Count whole-plan checks (`check_plan` starts with the ids-and-order pass)."""
    import xmesh_plan.schemas.plan_check as plan_check

    calls: list[int] = []
    inner = plan_check._check_ids_and_order
    monkeypatch.setattr(plan_check, "_check_ids_and_order", lambda plan: calls.append(1) or inner(plan))
    return calls


@pytest.mark.parametrize("order", ["device", "posted"])
def test_a_rank_checks_its_plan_once(order, monkeypatch):
    """Each rank holds its own plan object: making its executor and its program (what prepare() lowers) checks the
    whole plan once, not once in the constructor and again per lowering."""
    text = compile_plan(three_tensors(), strategy="auto", seed=0).to_json()
    calls = _counting_checks(monkeypatch)
    world = FakeWorld()
    devices = plan_devices(Plan.model_validate_json(text))
    for rank, device in enumerate(devices):
        plan = Plan.model_validate_json(text)  # as a rank reads it
        ex = TransferExecutor(plan, WorldComm(world, rank, len(devices)), order=order)
        ex.program = rank_program(plan, ex.device, order, True, tag_limit=2**20)
        lower(plan, device)
        assert len(calls) == rank + 1, f"rank {rank} checked the plan {len(calls) - rank} times"


def test_a_plan_the_check_refuses_is_refused_on_every_call(monkeypatch):
    plan = compile_plan(three_tensors(), strategy="auto", seed=0)
    op = plan.operations[0]
    bad = plan.model_copy(update={"operations": (op.model_copy(update={"chunks": 10**6}), *plan.operations[1:])})
    calls = _counting_checks(monkeypatch)
    messages = set()
    for _ in range(3):
        with pytest.raises(PlanMismatchError) as err:
            lower(bad, plan_devices(bad)[0])
        messages.add(str(err.value))
    assert len(messages) == 1 and "recompile the plan" in messages.pop() and len(calls) == 1


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)")
def test_a_compact_plan_file_runs_bit_exact_on_mpi_each_rank_reading_its_part(tmp_path):
    """8 MPI ranks, each `TransferExecutor.from_file(...).prepare()` on the small weight sync's compact file (the ranks
    agree on the file's fingerprint in prepare()), three reshards checked bit for bit (tests/workers/staging_transfer_worker.py)."""
    plan = read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")
    path = _compact(plan, tmp_path, "weight_sync_small.plan.npz")
    result = mpiexec(8, str(ROOT / "tests" / "workers" / "staging_transfer_worker.py"), str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok weight_sync_small order posted" in result.stdout, result.stdout
