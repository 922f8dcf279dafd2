"""Read pipeline problems and saved schedules from files, with one-line errors that name the field.

A stage's `mesh` may be shorthand: `"AxB"` is A hosts of B devices, placed on fresh hosts after the
previous stage's (stage 0 from host 0). An object `{"shape": [2, 2], "devices": [0, 1, 2, 3]}`
places it explicitly (e.g. a 2x2 mesh inside one 4-device host).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from xmesh_plan.planner.problem_io import InputError, describe_validation_error, hosts_used, parse_cluster, parse_mesh, parse_shape, read_data_file
from xmesh_plan.schemas.pipeline import PipelineProblem, PipelineSchedule
from xmesh_plan.schemas.limits import quoted


def build_pipeline(raw: Any) -> PipelineProblem:
    """A pipeline problem from plain data, expanding mesh and shape shorthand."""
    if not isinstance(raw, dict) or not isinstance(raw.get("stages"), list):
        raise InputError("pipeline: the file must hold one object with stages (a list), tensors and micro_batches")
    data = dict(raw)
    cluster = data["cluster"] = parse_cluster(data.get("cluster", {}))
    stages, next_host = [], 0
    for index, stage in enumerate(data["stages"]):
        if not isinstance(stage, dict) or "mesh" not in stage:
            raise InputError(f"stages.{index}: give an object with mesh, forward_s and backward_input_s")
        mesh = parse_mesh(stage["mesh"], f"stages.{index}.mesh", next_host, cluster.devices_per_host)
        next_host = max(next_host, hosts_used(mesh, cluster.devices_per_host))
        stages.append({**stage, "mesh": mesh})
    data["stages"] = stages
    data["tensors"] = [_tensor(t, i) for i, t in enumerate(data.get("tensors", []))]
    try:
        return PipelineProblem.model_validate(data)
    except ValidationError as err:
        raise InputError(describe_validation_error(err)) from None


def _tensor(raw: Any, index: int) -> Any:
    if isinstance(raw, dict) and isinstance(raw.get("shape"), str):
        return {**raw, "shape": parse_shape(raw["shape"], f"tensors.{index}.shape")}
    return raw


def load_pipeline(path: str | Path) -> PipelineProblem:
    """Read a `.json` or `.toml` pipeline file; every error names the path once."""
    raw = read_data_file(path, "pipeline file")  # its errors already start with the path
    try:
        return build_pipeline(raw)
    except InputError as err:
        raise InputError(f"{quoted(path)}: {err}") from None


def load_schedule(path: str | Path) -> PipelineSchedule:
    """Read a schedule written by `xmesh-plan schedule`."""
    raw = read_data_file(path, "schedule")
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != 1 or "stages" not in raw:
        raise InputError(f"{quoted(path)}: not a schedule of schema_version 1; make one with `xmesh-plan schedule PIPELINE.json -o schedule.json`")
    try:
        return PipelineSchedule.model_validate(raw)
    except ValidationError as err:
        raise InputError(f"{quoted(path)}: {describe_validation_error(err)}") from None
