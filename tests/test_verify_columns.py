"""`verify` of a compact plan proved from its columns (`planner.verify_columns`) passes exactly plans the record path
(`verify_plan` of the plan read as records) passes, with the same report; anything else goes to the record path, so
every verdict and message stays that path's."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.verify import PlanError, verify_plan, verify_plan_file
from xmesh_plan.planner.verify_columns import verify_compact
from xmesh_plan.schemas import Plan, read_plan_file
from xmesh_plan.schemas.plan import PlanFileError
from xmesh_plan.schemas.plan_compact import CompactPlanError, archive_bytes, compact_arrays, compact_bytes
from tests.support.cases import STRATEGIES, compiled, random_problem
from tests.support.mutations import as_lists, mutate, mutate_multi
from tests.support.transfer import three_tensors

ROOT = Path(__file__).resolve().parents[1]


def _quiet(*_) -> None:
    return None


def _written(plan: Plan, folder: Path, name: str = "x") -> Path:
    path = folder / f"{name}.plan.npz"
    path.write_bytes(compact_bytes(plan))
    return path


def _verdict(call) -> str:
    try:
        return str(call())
    except (PlanError, PlanFileError) as err:
        return f"{type(err).__name__}: {err}"


@functools.cache
def _bases() -> tuple[Plan, ...]:
    """Every committed plan, random single-tensor plans under every strategy and multi-tensor ones; made once for
    the module's tests (plans are frozen)."""
    plans = [read_plan_file(p) for p in sorted((ROOT / "plans").glob("*.plan.json"))]
    plans += [compiled(random_problem(seed, max_devices=4 + seed % 5, exact=False), s) for seed in range(6) for s in STRATEGIES]
    plans += [compile_plan(three_tensors(), strategy="auto", solver="greedy", split_hosts=False), compile_plan(three_tensors(), solver="greedy")]
    return tuple(p for p in plans if p.operations)


def test_plans_get_the_record_path_s_report(tmp_path):
    proved, kinds = 0, set()
    for k, plan in enumerate(_bases()):
        path = _written(plan, tmp_path, f"p{k}")
        assert str(verify_plan_file(path)) == str(verify_plan(plan))
        if verify_compact(path, _quiet, _quiet) is not None:
            proved += 1
            kinds |= {op.kind for op in plan.operations} | {"carrier" for op in plan.operations if op.carrier is not None}
    assert proved >= 30  # single- and multi-tensor plans are proved from columns, with their all-gathers and bundles as records
    assert {"allgather", "bundle", "carrier", "broadcast"} <= kinds


MUTANTS, ALL_MUTANTS = 200, 400  # `make test` / `pytest --all-mutants`


def test_mutants_proved_from_columns_pass_the_record_path(tmp_path, monkeypatch, request):
    """Schema-valid mutants written compact: where the columns prove one, the record path passes it with the same
    report; verify's verdict and message on the file are the record path's on every one. `make test` checks 200
    mutants, `pytest --all-mutants` 400 (the thresholds below scale with the count)."""
    from xmesh_plan.planner import verify as verify_module

    wanted = ALL_MUTANTS if request.config.getoption("--all-mutants") else MUTANTS
    columns_said: list = []  # what verify_plan_file's own column proof returned (run once per mutant, not again here)
    monkeypatch.setattr(verify_module, "verify_compact", lambda *a: columns_said.append(verify_compact(*a)) or columns_said[-1])
    rng = random.Random(2911)
    plans = _bases()
    bases = [as_lists(p.model_dump()) for p in plans]
    bases += [b for b, p in zip(bases, plans) if any(op.kind == "bundle" for op in p.operations)] * 30  # half of them bundle plans
    checked = proved = rejected_by_records = bundles = 0
    while checked < wanted:
        raw = as_lists(rng.choice(bases))
        mutate_multi(rng, raw) if "tensors" in raw["problem"] else mutate(rng, raw)
        try:
            mutant = Plan.model_validate(raw)
        except ValidationError:
            continue
        try:
            path = _written(mutant, tmp_path)
        except CompactPlanError:  # an operation whose messages cannot be numbered is not written; verify refuses it
            with pytest.raises(PlanError):
                verify_plan(mutant)
            continue
        checked += 1
        records = _verdict(lambda: verify_plan(mutant))
        rejected_by_records += records.startswith("PlanError")
        columns_said.clear()
        assert _verdict(lambda: verify_plan_file(path)) == records
        assert len(columns_said) == 1  # the file went through the column proof first
        if columns_said[0] is not None:
            proved += 1
            bundles += any(op.kind == "bundle" for op in mutant.operations)
            assert not records.startswith("PlanError"), records
    assert rejected_by_records > checked // 2 and proved > checked // 20 and bundles > checked // 80  # both sides were asked


@pytest.mark.parametrize("column, value", [("operations.kind.names", '["teleport"]'), ("operations.chunks", 0),
                                           ("operations.id", 1.5), ("tasks.strategy.names", '["magic"]'),
                                           ("operations.tensor", -1), ("operations.needers.inner", None),
                                           ("operations.parts.values", None)])
def test_a_bad_column_gets_the_record_reader_s_message(tmp_path, column, value):
    plan = compiled(random_problem(1, max_devices=5, exact=False), "broadcast")
    arrays = compact_arrays(plan)
    if value is None:  # a member the record reader opens even where no row has an entry in it
        del arrays[column]
    elif isinstance(value, str):
        arrays[column] = np.frombuffer(value.encode(), dtype=np.uint8)
    else:
        arrays[column] = np.full(arrays[column].shape, value, dtype=np.float64 if isinstance(value, float) else np.int64)
        if column == "operations.tensor":
            arrays["operations.tensor.none"] = np.zeros(arrays[column].shape, dtype=bool)
    path = tmp_path / "bad.plan.npz"
    path.write_bytes(archive_bytes(arrays))
    assert verify_compact(path, _quiet, _quiet) is None
    with pytest.raises(PlanFileError) as caught:
        verify_plan_file(path)
    assert _verdict(lambda: read_plan_file(path)) == f"PlanFileError: {caught.value}"
