"""problem + schedule name + transfer costs -> a validated, saveable `PipelineSchedule`."""

from __future__ import annotations

from xmesh_plan.schemas.pipeline import PipelineProblem, PipelineSchedule, TransferCost

from xmesh_plan.planner import __version__

from .actions import format_actions
from .delaying import choose_weight_delay
from .schedules import parse_schedule_name, stage_actions
from .validate import validate


def build_schedule(problem: PipelineProblem, name: str, costs: tuple[TransferCost, ...], overlap: bool = True,
                   weight_delay: tuple[int, ...] | None = None) -> PipelineSchedule:
    """Make schedule `name`; for `-wd` names the delay is chosen by the cost model unless given."""
    _, split = parse_schedule_name(name)
    if split and weight_delay is None:
        weight_delay = choose_weight_delay(problem, name, costs, overlap)
    delays = tuple(weight_delay or ()) if split else ()
    actions = stage_actions(problem, name, delays)
    validate(problem, actions)
    return PipelineSchedule(generator=f"xmesh-plan {__version__}", schedule=name, overlap=overlap, weight_delay=delays,
                            pipeline=problem, costs=costs, stages=tuple(format_actions(a) for a in actions))
