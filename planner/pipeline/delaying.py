"""Backward weight delaying: move each weight-gradient part just far enough to cover the backward transfers.

The cost model is the simulator. Starting from no delay, each stage in turn (last to first, twice)
takes the smallest delay that gives the shortest iteration, so no activation is kept longer than
it helps.
"""

from __future__ import annotations

from xmesh_plan.schemas.pipeline import PipelineProblem, TransferCost

from .schedules import stage_actions
from .simulate import simulate

MAX_DELAY = 4
PASSES = 2
TOLERANCE_S = 1e-12


def iteration_with(problem: PipelineProblem, name: str, delays: tuple[int, ...], costs: tuple[TransferCost, ...], overlap: bool) -> float:
    return simulate(problem, stage_actions(problem, name, delays), costs, overlap).iteration_s


def choose_weight_delay(problem: PipelineProblem, name: str, costs: tuple[TransferCost, ...], overlap: bool = True,
                        max_delay: int = MAX_DELAY) -> tuple[int, ...]:
    """Per-stage delay (in compute actions) for a `-wd` schedule; deterministic coordinate descent."""
    delays = [0] * len(problem.stages)
    best = iteration_with(problem, name, tuple(delays), costs, overlap)
    for _ in range(PASSES):
        for stage in reversed(range(len(delays))):
            for delay in range(max_delay + 1):
                trial = tuple(delays[:stage] + [delay] + delays[stage + 1:])
                seconds = iteration_with(problem, name, trial, costs, overlap)
                if seconds < best - TOLERANCE_S or (delay < delays[stage] and seconds <= best + TOLERANCE_S):
                    best, delays[stage] = min(best, seconds), delay
    return tuple(delays)
