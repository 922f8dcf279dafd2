"""A compile assembles its plan as rows (`planner.plan_rows`): the rows state the plan its records state, field for
field and byte for byte in either file format, and `xmesh-plan compile -o x.npz` writes the file from the rows."""

import tomllib

import numpy as np
from click.testing import CliRunner

from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan, compile_rows
from xmesh_plan.planner.plan_rows import OperationRow, PlanRows, TaskRow
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, Layout, weight_sync_toml
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.schemas import Operation, UnitTask
from xmesh_plan.schemas.plan_compact import compact_arrays, compact_bytes
from xmesh_plan.schemas.plan_io import read_plan_file


def _small(**layout):
    name, model, base = WEIGHT_SYNC["weight_sync_small"]
    return build_transfer(tomllib.loads(weight_sync_toml(name, model, Layout(**{**base.__dict__, **layout}))))


def test_rows_have_the_records_fields_in_their_order_and_make_the_records():
    assert OperationRow._fields == tuple(Operation.model_fields)
    assert TaskRow._fields == tuple(UnitTask.model_fields)
    op = OperationRow(3, 1, 0, "send", 0, (4,), ((0, 2),), (), 1, (), (), None, 0.5, 1.0)
    assert op.record() == Operation(id=3, task=1, tensor=0, kind="send", src=0, dsts=(4,), region=((0, 2),), start_s=0.5, end_s=1.0)
    assert op.model_copy(update={"id": 4}) == op._replace(id=4) and op.model_copy(update={"id": 4}).record().id == 4


def test_rows_state_the_plan_the_records_state_in_both_formats():
    single = build_problem({"shape": "64,32", "dtype": "float32", "src": {"mesh": "2x2", "spec": "S0 R"},
                            "dst": {"mesh": "2x2", "spec": "R S1"}})
    for problem, settings in ((_small(), {}), (_small(nics=2, devices_per_host=2), {}), (single, {"strategy": "auto"}),
                              (_small(), {"max_staging_bytes": 2**14})):
        rows = compile_rows(problem, **settings)
        plan = compile_plan(problem, **settings)
        assert isinstance(rows, PlanRows)
        assert rows.to_plan() == plan
        assert rows.to_json() == plan.to_json()
        assert compact_bytes(rows) == compact_bytes(plan)
        arrays = compact_arrays(rows)
        assert all(np.array_equal(a, b) for a, b in zip(arrays.values(), compact_arrays(plan).values()))
        assert (rows.predicted_seconds, rows.executor_prediction, rows.staging) == \
            (plan.predicted_seconds, plan.executor_prediction, plan.staging)
        assert (plan.staging is not None) == ("max_staging_bytes" in settings)


def test_rows_refuse_a_dump_with_their_tables():
    rows = compile_rows(_small())
    try:
        rows.model_dump(mode="json")
    except ValueError as err:
        assert "exclude tasks, operations and host_order" in str(err)
    else:
        raise AssertionError("model_dump of the rows with their tables was not refused")


def test_compile_to_npz_writes_the_plan_from_its_rows_verified(tmp_path):
    problem_file = tmp_path / "small.problem.toml"
    name, model, layout = WEIGHT_SYNC["weight_sync_small"]
    problem_file.write_text(weight_sync_toml(name, model, layout))
    out = tmp_path / "small.plan.npz"
    result = CliRunner().invoke(main, ["compile", str(problem_file), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "verified (84 operations replayed)" in result.output
    plan = compile_plan(build_transfer(tomllib.loads(problem_file.read_text())))
    assert out.read_bytes() == compact_bytes(plan)
    assert read_plan_file(out) == plan


def test_rows_refuse_the_shells_names_that_would_drop_their_tables():
    rows = compile_rows(_small())
    for name in ("model_copy", "model_dump_json", "model_fields_set", "json", "dict", "copy"):
        try:
            getattr(rows, name)
        except AttributeError as err:
            assert f"PlanRows.{name}" in str(err) and "call .to_plan() first" in str(err)
        else:
            raise AssertionError(f"rows.{name} was handed to the plan with no tasks or operations")
    assert rows.to_plan().model_copy(update={"strategy": rows.strategy}).operations == rows.to_plan().operations
    assert (rows.solver, rows.predicted_seconds, rows.efficiency) == (rows.shell.solver, rows.shell.predicted_seconds,
                                                                      rows.shell.efficiency)


def test_a_staging_limit_is_stated_from_the_rows_without_their_records(monkeypatch):
    def refused(self):
        raise AssertionError("compile_rows made the plan's records")
    stated = compile_rows(_small(), max_staging_bytes=2**14).staging
    monkeypatch.setattr(PlanRows, "to_plan", refused)
    rows = compile_rows(_small(), max_staging_bytes=2**14)
    assert rows.staging == stated and rows.staging.limit_bytes == 2**14 and rows.staging.peak_bytes



def test_rows_of_a_reference_case_make_its_committed_plan():
    """Against files `make plans` wrote and checked in (an independent source: a row field out of place changes the
    bytes, which comparing rows with records made from the same rows cannot see)."""
    from pathlib import Path

    for name in ("case3", "weight_sync_small"):
        path = Path(__file__).resolve().parent.parent / "plans" / f"{name}.plan.json"
        assert compile_rows(read_plan_file(path).problem).to_json() == path.read_text()
