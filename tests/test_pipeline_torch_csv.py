"""Schedules exported as torch.distributed.pipelining's schedule CSV, read back by torch's own parser and checks."""

from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner

from xmesh_plan.planner.cli import main
from xmesh_plan.planner.pipeline.build import build_schedule
from xmesh_plan.planner.pipeline.io import build_pipeline
from xmesh_plan.planner.pipeline.schedules import SCHEDULE_NAMES
from xmesh_plan.planner.pipeline.simulate import schedule_actions
from xmesh_plan.planner.pipeline.torch_csv import check_torch_chain, torch_csv
from xmesh_plan.schemas.pipeline import TransferCost

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
STAGE = {"forward_s": 0.002, "backward_input_s": 0.002, "backward_weight_s": 0.001}
TENSOR = {"shape": "8,64", "src_spec": "S0 R", "dst_spec": "S0 R"}
CHAIN = {  # two tensors cross the first boundary: torch sends them as one action
    "name": "chain", "micro_batches": 5,
    "stages": [{"mesh": "1x2", **STAGE}, {"mesh": "1x2", **STAGE}, {"mesh": "1x1", **STAGE}],
    "tensors": [{"name": "h0", "src_stage": 0, "dst_stage": 1, **TENSOR}, {"name": "h0b", "src_stage": 0, "dst_stage": 1, **TENSOR},
                {"name": "h1", "src_stage": 1, "dst_stage": 2, **TENSOR}],
}


def chain_schedule(name: str, raw: dict = CHAIN):
    pipeline = build_pipeline(raw)
    costs = tuple(TransferCost(tensor=t, direction=d, seconds=0.003) for t, d in pipeline.transfers())
    return build_schedule(pipeline, name, costs)


def parse_with_torch(text: str) -> dict[int, list]:
    """What torch's `_load_csv` does to each row: csv.reader, then `_Action.from_str` per cell."""
    return {rank: [schedules._Action.from_str(cell) for cell in row] for rank, row in enumerate(csv.reader(io.StringIO(text)))}


def bare_runtime(stages: int, micro_batches: int):
    """A `_PipelineScheduleRuntime` with only what `_load_csv` and `_dump_csv` read (no process group, no modules)."""
    runtime = schedules._PipelineScheduleRuntime.__new__(schedules._PipelineScheduleRuntime)
    runtime.__dict__.update(_stages=[], _num_stages=stages, pp_group_size=stages, _n_microbatches=micro_batches,
                            pipeline_order={}, _defer_pp_recv=False, stage_index_to_group_rank={})
    return runtime


def as_tuples(actions) -> list[tuple]:
    return [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_compute_only_rows_are_our_compute_order_as_torch_parses_it(name):
    ours = schedule_actions(chain_schedule(name))
    parsed = parse_with_torch(torch_csv(ours, "compute_only"))
    assert sorted(parsed) == [0, 1, 2]
    for stage, actions in enumerate(ours):
        assert as_tuples(parsed[stage]) == [(a.stage, a.kind, a.micro_batch) for a in actions if a.is_compute]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_compute_comms_rows_keep_our_sends_and_receives_one_per_step(name):
    ours = schedule_actions(chain_schedule(name))
    parsed = parse_with_torch(torch_csv(ours, "compute_comms"))
    for stage, actions in enumerate(ours):
        steps = [(a.stage, a.kind, a.micro_batch) for a in actions]
        expected = [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]]  # h0 and h0b: one torch action
        got = as_tuples(parsed[stage])
        reduce_at = got.index((stage, "REDUCE_GRAD", None))
        assert got[:reduce_at] + got[reduce_at + 1:] == expected
        assert all(kind.startswith("SEND") for _, kind, _ in got[reduce_at + 1:])  # only sends after the reduction
    assert sum(kind == "SEND_F" for _, kind, _ in as_tuples(parsed[0])) == CHAIN["micro_batches"]


@pytest.mark.parametrize("form", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_torchs_load_csv_validates_lowers_and_dumps_the_same_bytes(tmp_path, name, form):
    ours = schedule_actions(chain_schedule(name))
    path, dumped = tmp_path / "ours.csv", tmp_path / "torch.csv"
    path.write_text(torch_csv(ours, form), newline="")
    runtime = bare_runtime(len(ours), CHAIN["micro_batches"])
    runtime._load_csv(str(path), format=form)  # runs torch's _validate_schedule
    assert runtime.stage_index_to_group_rank == {0: 0, 1: 1, 2: 2}
    runtime._dump_csv(str(dumped), format=form)
    assert dumped.read_bytes() == path.read_bytes()
    comms = {rank: [a for a in acts if a.is_compute_op or "SEND" in a.computation_type.value or "RECV" in a.computation_type.value]
             for rank, acts in runtime.pipeline_order_with_comms.items()}
    simulated = schedules._simulate_comms_compute(comms, lambda stage: stage, len(ours))  # raises on a deadlock
    assert sum(a is not None for acts in simulated.values() for a in acts) == sum(map(len, comms.values()))


def test_torchs_checks_can_fail_on_a_broken_export(tmp_path):
    """The round trip would catch a bad export: a W before its I, and a receive after its forward."""
    text = torch_csv(schedule_actions(chain_schedule("1f1b-wd")), "compute_comms")
    rows = [row.split(",") for row in text.split("\r\n") if row]
    row = rows[1]
    i, w = row.index("1I0"), row.index("1W0")
    row[i], row[w] = row[w], row[i]
    path = tmp_path / "bad.csv"
    path.write_text("\r\n".join(",".join(r) for r in rows) + "\r\n", newline="")
    with pytest.raises(AssertionError, match="Backward Weight"):
        bare_runtime(3, CHAIN["micro_batches"])._load_csv(str(path), format="compute_comms")
    late = [r[:] for r in parse_with_torch(text).values()]
    first_recv = next(k for k, a in enumerate(late[1]) if a.computation_type.value == "RECV_F")
    late[1].insert(first_recv + 2, late[1].pop(first_recv))  # after 1F0, which needs it
    with pytest.raises(ValueError, match="not progressing"):
        schedules._simulate_comms_compute(dict(enumerate(late)), lambda stage: stage, 3)


@pytest.mark.parametrize("change, expect", [
    ({"tensors": CHAIN["tensors"] + [{"name": "skip", "src_stage": 0, "dst_stage": 2, **TENSOR}]}, "'skip' goes from stage 0 to 2"),
    ({"tensors": [{**CHAIN["tensors"][0], "backward": False}] + CHAIN["tensors"][1:]}, "'h0' has backward off"),
    ({"tensors": CHAIN["tensors"][:2]}, "no boundary tensor goes from stage 1 to 2"),
])
def test_pipelines_torch_cannot_run_are_refused_with_the_reason(change, expect):
    with pytest.raises(ValueError, match=expect):
        check_torch_chain(build_pipeline({**CHAIN, **change}))


def test_cli_writes_the_csv_and_refuses_skips_in_one_line(tmp_path):
    pipeline_file, out = tmp_path / "chain.json", tmp_path / "s.csv"
    pipeline_file.write_text(json.dumps(CHAIN))
    result = CliRunner().invoke(main, ["schedule", str(pipeline_file), "--schedule", "eager-1f1b-wd", "-o", str(tmp_path / "s.json"),
                                       "--torch-csv", str(out), "--torch-format", "compute_comms"])
    assert result.exit_code == 0, result.output
    assert "format='compute_comms'" in result.output
    saved = (tmp_path / "s.json").read_text()
    from xmesh_plan.schemas.pipeline import PipelineSchedule

    assert out.read_bytes() == torch_csv(schedule_actions(PipelineSchedule.from_json(saved)), "compute_comms").encode()
    skipping = {**CHAIN, "tensors": CHAIN["tensors"] + [{"name": "skip", "src_stage": 0, "dst_stage": 2, **TENSOR}]}
    pipeline_file.write_text(json.dumps(skipping))
    result = CliRunner().invoke(main, ["schedule", str(pipeline_file), "--torch-csv", str(tmp_path / "t.csv")])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "--torch-csv: tensor 'skip' goes from stage 0 to 2" in result.output
    assert not (tmp_path / "t.csv").exists()


@pytest.mark.slow
def test_exported_schedules_train_in_torchs_runtime_with_gloo(tmp_path):
    """Four CPU processes load our CSVs into `_PipelineScheduleRuntime` and match one process's gradients."""
    from xmesh_plan.executor.examples.torch_pipeline_csv import run_csvs

    stages = [{"mesh": "1x1", **STAGE} for _ in range(4)]
    tensors = [{"name": f"h{s}", "src_stage": s, "dst_stage": s + 1, **TENSOR} for s in range(3)]
    raw = {"name": "mlp", "micro_batches": 6, "stages": stages, "tensors": tensors}
    runs = []
    for name, form in [("eager-1f1b-wd", "compute_comms"), ("eager-1f1b-wd", "compute_only"), ("1f1b", "compute_comms"),
                       ("gpipe", "compute_only")]:
        path = tmp_path / f"{name}.{form}.csv"
        path.write_text(torch_csv(schedule_actions(chain_schedule(name, raw)), form), newline="")
        runs.append((str(path), form))
    assert run_csvs(runs, micro_batches=6) == []
