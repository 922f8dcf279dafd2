"""The shared structural checker: each fault the adversarial pass found is refused by `verify` and by the
executor's lowering with the same message, and `check` recomputes what it gates on.

Faults are planted in compiled plans through the JSON a user would edit, so they reach the checker
the way a plan file does (including NaN and Infinity, which Python's JSON reader accepts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from xmesh_plan.executor.errors import PlanMismatchError
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.planner.cli import main
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.plan_check import MAX_CHUNKS


@pytest.fixture
def case3(case, compile_quick):
    return compile_quick(case("case3"), "broadcast")


@pytest.fixture
def overlap(problem, compile_quick):
    """Meshes sharing devices 0-3, so the plan has local copies as well as network tasks."""
    return compile_quick(problem((8, 4), "1x4", "S0 R", {"shape": [2, 4], "devices": list(range(8))}, "R S1"), "broadcast")


def edited(plan: Plan, edit) -> Plan:
    raw = json.loads(plan.to_json())
    edit(raw)
    return Plan.model_validate(raw)


def both_refuse(plan: Plan) -> str:
    """verify's message; the lowering refuses on some rank with the same message (plus its advice)."""
    with pytest.raises(PlanError) as verdict:
        verify_plan(plan)
    refusals = []
    for device in plan_devices(plan):
        try:
            lower(plan, device)
        except PlanMismatchError as err:
            refusals.append(str(err))
    assert refusals, "the executor's lowering accepts a plan verify rejects"
    assert refusals[0].startswith(str(verdict.value)), (refusals[0], str(verdict.value))
    return str(verdict.value)


def first_op(kind: str):
    def pick(raw):
        return next(op for op in raw["operations"] if op["kind"] == kind)
    return pick


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_an_operation_time_that_is_not_a_finite_non_negative_number(case3, value):
    message = both_refuse(edited(case3, lambda raw: raw["operations"][1].update(start_s=value)))
    assert "operation" in message and ("finite" in message or "before time 0" in message)


def test_nan_start_cannot_hide_an_all_gather_part_sent_before_it_arrived(case, compile_quick):
    """NaN compares false with everything, so a check written as `start < arrival` would pass it: both the order
    check and the holds check must refuse it."""
    plan = compile_quick(case("case3"), "local_allgather")
    gather = next(op for op in plan.operations if op.kind == "allgather")
    ops = [op for op in plan.operations if op is not gather]
    early = gather.model_copy(update={"start_s": math.nan})
    message = both_refuse(plan.model_copy(update={"operations": (early, *ops)}))
    assert f"operation {gather.id} (task {gather.task}, allgather) runs @nan" in message


@pytest.mark.parametrize("kind", ["send", "broadcast"])
def test_a_copy_rewritten_as_a_message_to_itself(overlap, kind):
    message = both_refuse(edited(overlap, lambda raw: first_op("copy")(raw).update(kind=kind, task=raw["tasks"][0]["id"])))
    assert "sends to itself; a device that holds the box needs a copy" in message


def test_a_broadcast_with_an_empty_chain(case3):
    message = both_refuse(edited(case3, lambda raw: first_op("broadcast")(raw).update(dsts=[])))
    assert "a broadcast needs at least 1 devices in dsts, got []" in message


@pytest.mark.parametrize("device", [99, -1])
def test_an_empty_box_between_devices_in_neither_mesh(case3, device):
    def edit(raw):
        op = raw["operations"][0]
        op.update(src=device, dsts=[device + 1], region=[[0, 0], [0, 0], [0, 0]])
    message = both_refuse(edited(case3, edit))
    assert "is empty; drop operations that move nothing" in message


@pytest.mark.parametrize("device", [99, 16])
def test_a_device_that_does_not_exist(case3, device):
    message = both_refuse(edited(case3, lambda raw: raw["operations"][0]["dsts"].__setitem__(1, device)))
    assert f"device {device} receives" in message and "is not in the destination mesh" in message


@pytest.mark.parametrize("chunks", [10**9, 2**40, MAX_CHUNKS + 1])
def test_a_chunk_count_beyond_the_limit_is_refused_at_once(case3, chunks):
    """A chunk count of 2**40 is refused before the lowering loops over its chunks (which would never end while the
    peers time out)."""
    message = both_refuse(edited(case3, lambda raw: first_op("broadcast")(raw).update(chunks=chunks)))
    assert f"chunks {chunks} is above {MAX_CHUNKS}" in message


def test_more_chunks_than_elements_is_refused(problem, compile_quick):
    plan = compile_quick(problem((4,), "1x1", "R", "1x2", "R"), "broadcast")
    message = both_refuse(edited(plan, lambda raw: first_op("broadcast")(raw).update(chunks=5)))
    assert "chunks 5 is above 4, the most for a box of 4 elements" in message


def test_a_bad_nic_side_in_the_host_order(case3):
    message = both_refuse(edited(case3, lambda raw: raw["host_order"][0].update(side="send:x")))
    assert "has side 'send:x'; use send or recv" in message


def test_overlapping_all_gather_parts_are_refused(case, compile_quick):
    plan = compile_quick(case("case3"), "local_allgather")
    def edit(raw):
        gather = first_op("allgather")(raw)
        gather["parts"][1] = gather["parts"][0]
    message = both_refuse(edited(plan, edit))
    assert "no member contributes" in message or "overlap" in message


# --- check recomputes what it gates on ------------------------------------------------------------

def check(tmp_path, plan_or_text, *flags):
    path = tmp_path / "p.plan.json"
    path.write_text(plan_or_text if isinstance(plan_or_text, str) else plan_or_text.to_json())
    return CliRunner().invoke(main, ["check", str(path), *flags])


def test_check_passes_a_compiled_plan(tmp_path, case3):
    result = check(tmp_path, case3, "--max-ratio", "2")
    assert result.exit_code == 0 and result.output.rstrip().endswith("ok"), result.output


@pytest.mark.parametrize("field,value,words", [
    ("predicted_seconds", "NaN", "predicted_seconds is nan"),
    ("lower_bound_seconds", "NaN", "lower_bound_seconds is nan"),
    ("lower_bound_seconds", "100.0", "above predicted_seconds"),
])
def test_check_refuses_numbers_it_cannot_trust(tmp_path, case3, field, value, words):
    raw = json.loads(case3.to_json())
    text = json.dumps(raw).replace(f'"{field}": {raw[field]}', f'"{field}": {value}')
    assert value in text
    result = check(tmp_path, text)
    assert result.exit_code == 1 and "FAIL does not verify" in result.output and words in result.output, result.output


def test_check_recomputes_the_bound_instead_of_trusting_it(tmp_path, case3):
    result = check(tmp_path, case3.model_copy(update={"lower_bound_seconds": case3.predicted_seconds}))
    assert result.exit_code == 1 and "disagrees with 0.8589934592 s recomputed from the problem" in result.output, result.output


def test_check_retimes_the_operations(tmp_path, case3):
    faster = tuple(op.model_copy(update={"end_s": op.start_s + (op.end_s - op.start_s) / 2}) for op in case3.operations)
    tampered = case3.model_copy(update={"operations": faster, "predicted_seconds": max(op.end_s for op in faster)})
    result = check(tmp_path, tampered)
    assert result.exit_code == 1 and "but the simulator times it" in result.output, result.output


def test_check_verifies_the_plan(tmp_path, case3):
    result = check(tmp_path, case3.model_copy(update={"operations": case3.operations[:-1]}))
    assert result.exit_code == 1 and "FAIL does not verify: destination device" in result.output, result.output


@pytest.mark.parametrize("side", ["send:", "send:00", "recv:7", "both"])
def test_a_malformed_nic_side_is_refused(case3, side):
    """A malformed side such as `send:` is refused by the checker, not left to crash `check` in the simulator's NIC lookup."""
    message = both_refuse(edited(case3, lambda raw: raw["host_order"][0].update(side=side)))
    assert f"has side {side!r}; use send or recv" in message


def test_a_nic_side_listed_twice_or_on_a_foreign_host(case3):
    assert "twice" in both_refuse(edited(case3, lambda raw: raw["host_order"].append(dict(raw["host_order"][0]))))
    assert "holds no device of either mesh" in both_refuse(edited(case3, lambda raw: raw["host_order"][0].update(host=40)))


def test_the_tag_budget_is_a_plan_rule_and_the_mpi_limit_an_executor_one(case3, monkeypatch):
    """A plan over the format's tag budget is refused by both sides; the lowering applies a smaller
    TAG_UB only when a backend passes one (the planner made 33,124-tag plans that verify passed)."""
    needed = sum(op.chunks for op in case3.operations)
    lower(case3, 8)  # no backend limit given: fine
    with pytest.raises(PlanMismatchError, match=f"needs {needed} message tags but this MPI allows tags up to 10"):
        lower(case3, 8, tag_limit=10)
    monkeypatch.setattr("xmesh_plan.schemas.plan_check.MAX_TAGS", needed - 1)
    fresh = case3.model_copy()  # the lowering checks a plan object once (`plan_index`); this one is checked under the new budget
    assert f"the plan needs {needed} message tags" in both_refuse(fresh)


@pytest.mark.parametrize("seed", range(10, 22))
def test_check_passes_what_compile_just_wrote(tmp_path, seed):
    """`check` re-times a fresh plan exactly as `compile` timed it, though `compile` lists operations by predicted start
    (the listing must not change the simulator's NIC queues; seed 14's global all-gather is one plan where it would)."""
    from tests.support.cases import compiled, random_problem

    for strategy in ("global_allgather", "auto"):
        plan = compiled(random_problem(seed, max_devices=4 + seed % 9, exact=False), strategy)
        result = check(tmp_path, plan, "--max-ratio", "1e12")  # tiny tensors: latency dwarfs the byte bound
        assert result.exit_code == 0, result.output


def test_check_re_times_a_plan_that_claims_the_schedule_timed_it(tmp_path, case3):
    faster = tuple(op.model_copy(update={"end_s": op.start_s + (op.end_s - op.start_s) / 2}) for op in case3.operations)
    details = {**case3.solver.details, "timed_by": "schedule (too many operations to simulate)"}
    forged = case3.model_copy(update={"operations": faster, "predicted_seconds": max(op.end_s for op in faster),
                                      "solver": case3.solver.model_copy(update={"details": details})})
    result = check(tmp_path, forged)
    assert result.exit_code == 1 and "but the simulator times it" in result.output, result.output


def test_an_operation_repeated_on_a_tensor_of_another_layout_is_checked_again():
    """The check passes an operation whose structure already passed on a tensor of the same shape and layouts without
    a second look (a model's layers repeat their operations); on a tensor of another layout it is checked again, and
    refused there as on its own."""
    from pathlib import Path

    from xmesh_plan.schemas import read_plan_file
    from xmesh_plan.schemas.plan_check import check_device_ops
    from xmesh_plan.schemas.plan_compact import DeviceOps

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.plan.json")
    problems = plan.problem.tensor_problems()
    op = next(o for o in plan.operations if o.kind == "bundle")
    layout = lambda t: (tuple(problems[t].shape), problems[t].src, problems[t].dst)
    other = next(t for t in range(len(problems)) if layout(t) != layout(op.tensor) and len(problems[t].shape) == len(problems[op.tensor].shape))
    moved = op.model_copy(update={"tensor": other, "id": op.id + 10**6})

    def check(*operations):
        check_device_ops(DeviceOps(plan.schema_version, plan.problem, operations, tuple(range(len(operations))),
                                   (0,) * len(operations), 1, None))

    check(op)
    with pytest.raises(PlanError) as alone:
        check(moved)
    with pytest.raises(PlanError) as after:
        check(op, moved)
    assert str(after.value) == str(alone.value)


@pytest.mark.parametrize("batch_cells, batch_boxes", [(1 << 20, 1 << 15), (40, 5)])
def test_uncovered_each_names_what_uncovered_names_block_by_block(batch_cells, batch_boxes, monkeypatch):
    """The rank's batched coverage check (every destination shard on one padded grid, `uncovered_each`) against the
    one-block check (`uncovered`) on random blocks and boxes of 1-3 dims: boxes outside, overlapping, empty, none at
    all, and whole blocks; also taken in parts (a small `BATCH_CELLS` and `BATCH_BOXES`)."""
    import random

    from xmesh_plan.schemas import plan_check
    monkeypatch.setattr(plan_check, "BATCH_CELLS", batch_cells)
    monkeypatch.setattr(plan_check, "BATCH_BOXES", batch_boxes)
    rng = random.Random(7)
    for _ in range(200):
        blocks, written = [], []
        for _ in range(rng.randint(1, 12)):
            dims = rng.randint(1, 3)
            block = tuple((a, a + rng.randint(0, 5)) for a in (rng.randint(0, 4) for _ in range(dims)))
            boxes = [tuple((x, x + rng.randint(0, 4)) for x in (rng.randint(0, 8) for _ in range(dims))) for _ in range(rng.randint(0, 8))]
            blocks.append(block)
            written.append(boxes + [block] * (rng.random() < 0.3))
        want = [plan_check.uncovered(block, boxes) for block, boxes in zip(blocks, written)]
        assert plan_check.uncovered_each(blocks, written) == want


def _bundle_faults(op, rng) -> list:
    """Copies of bundle `op` (unvalidated, as a damaged file reads) each with one fault or none of its own."""
    k = rng.randrange(len(op.parts))
    part = op.parts[k]

    def with_part(new):
        return op.model_copy(update={"parts": op.parts[:k] + (new,) + op.parts[k + 1:]})

    def with_needers(new):
        return op.model_copy(update={"needers": op.needers[:k] + (new,) + op.needers[k + 1:]})

    def with_holder(new):
        return op.model_copy(update={"holders": op.holders[:k] + (new,) + op.holders[k + 1:]})

    (a, b), rest = part[0], part[1:]
    return [with_part(((a, a),) + rest), with_part(((a, b + 1),) + rest), with_part(((a - 1, b),) + rest), with_part(((b, a),) + rest),
            with_part(part + ((0, 1),)), with_needers(()), with_needers(op.needers[k] * 2), with_needers(op.needers[k] + (op.src,)),
            with_needers(op.needers[k] + (op.dsts[0] + 100,)), with_needers((-1,)), with_holder(op.dsts[0]), with_holder(op.src + 1),
            with_holder(-op.src - 1), with_holder(op.src + 100), with_holder(2**62), with_needers((2**62,)),
            op.model_copy(update={"chunks": 2}), op.model_copy(update={"dsts": op.dsts + (op.dsts[0] + 1,)}),
            op.model_copy(update={"dsts": (op.src + 1,)}), op.model_copy(update={"dsts": (op.src,)}),
            op.model_copy(update={"region": ((a, b),) + op.region[1:]}), op.model_copy(update={"holders": op.holders[1:]}),
            op.model_copy(update={"src": None}), op.model_copy(update={"kind": "send"}), op]


def test_bundles_proven_with_arrays_are_those_the_one_by_one_check_passes():
    """`plan_check_arrays.proven_bundles` (every part of every bundle at once) against `_check_operation` (one bundle, one
    part at a time) on the small weight sync's bundles and copies of them with one fault each: a part empty, outside its
    box or the tensor, or of another rank; needers none, repeated, off the receiving host or of no shard; a holder off the
    sending host or of no shard; chunks, relays, box and counts wrong. It proves exactly the ones that pass."""
    import random

    from xmesh_plan.schemas import read_plan_file
    from xmesh_plan.schemas.plan_check import _check_operation, _Shards
    from xmesh_plan.schemas.plan_check_arrays import proven_bundles

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.plan.json")
    problems = plan.problem.tensor_problems()
    rng = random.Random(5)
    ops = [fault for op in plan.operations if op.kind == "bundle" for fault in _bundle_faults(op, rng)]
    proven = proven_bundles(ops, [op.tensor for op in ops], problems, MAX_CHUNKS).tolist()
    passes = []
    for op in ops:
        try:
            _check_operation(op, _Shards(problems[op.tensor]))
            passes.append(True)
        except (PlanError, ValueError, IndexError):
            passes.append(False)
    assert proven == passes
    assert 0 < sum(proven) < len(proven)


def test_a_bundle_number_past_int64_leaves_its_batch_to_the_one_by_one_check():
    """A part bound past int64 (a damaged file) cannot go into the arrays: no bundle of the batch is proven there,
    and the one-by-one check names the part."""
    from xmesh_plan.schemas import read_plan_file
    from xmesh_plan.schemas.plan_check import _check_operation, _Shards
    from xmesh_plan.schemas.plan_check_arrays import proven_bundles

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.plan.json")
    problems = plan.problem.tensor_problems()
    ops = [op for op in plan.operations if op.kind == "bundle" and len(op.region) == 2]  # one batch: tensors of 2 dims
    (a, _), rest = ops[0].parts[0][0], ops[0].parts[0][1:]
    bad = ops[0].model_copy(update={"parts": (((a, 2**70),) + rest,) + ops[0].parts[1:]})
    assert proven_bundles(ops, [op.tensor for op in ops], problems, MAX_CHUNKS).all()
    assert not proven_bundles([bad] + ops[1:], [op.tensor for op in [bad] + ops[1:]], problems, MAX_CHUNKS).any()
    with pytest.raises(PlanError, match="not a box"):
        _check_operation(bad, _Shards(problems[bad.tensor]))
