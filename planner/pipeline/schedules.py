"""Compute orders of the pipeline schedules, and the pass that adds the communication actions.

A compute order is one stage's list of (kind, micro-batch). 1F1B runs `min(m, S-i-1)` warm-up
forwards on stage i (0-based) of S stages; eager-1F1B runs `min(m, 2*(S-i)-1)`, so other work can
fill the time a transfer takes. A `-wd` suffix splits each backward into its input-gradient part
(I, whose output is sent) and its weight-gradient part (W), moved `delay` compute actions later.

>>> one_f_one_b(stage=0, stages=2, micro_batches=4)
[('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2), ('B', 3)]
>>> split_backward([('F', 0), ('B', 0), ('F', 1), ('B', 1)], delay=1)
[('F', 0), ('I', 0), ('F', 1), ('W', 0), ('I', 1), ('W', 1)]
"""

from __future__ import annotations

from typing import Callable

from xmesh_plan.schemas.pipeline import PipelineProblem

from .actions import Action

ComputeOrder = list[tuple[str, int]]
WEIGHT_DELAY_SUFFIX = "-wd"


def gpipe(stage: int, stages: int, micro_batches: int) -> ComputeOrder:
    """All forwards, then all backwards in the same micro-batch order."""
    del stage, stages
    return [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]


def warmup_then_alternate(warmup: int, micro_batches: int) -> ComputeOrder:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining backwards."""
    order: ComputeOrder = [("F", m) for m in range(warmup)]
    for step in range(micro_batches - warmup):
        order += [("F", warmup + step), ("B", step)]
    return order + [("B", m) for m in range(micro_batches - warmup, micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> ComputeOrder:
    """1F1B (PipeDream-Flush): `min(m, S-i-1)` warm-up forwards."""
    return warmup_then_alternate(min(micro_batches, stages - stage - 1), micro_batches)


def eager_one_f_one_b(stage: int, stages: int, micro_batches: int) -> ComputeOrder:
    """Eager-1F1B: `min(m, 2*(S-i)-1)` warm-up forwards, so forward transfers overlap other forwards."""
    return warmup_then_alternate(min(micro_batches, 2 * (stages - stage) - 1), micro_batches)


ORDERS: dict[str, Callable[[int, int, int], ComputeOrder]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "eager-1f1b": eager_one_f_one_b,
}
SCHEDULE_NAMES = tuple(ORDERS) + tuple(name + WEIGHT_DELAY_SUFFIX for name in ORDERS)


def parse_schedule_name(name: str) -> tuple[str, bool]:
    """'eager-1f1b-wd' -> ('eager-1f1b', True); the error lists the valid names."""
    base = name.removesuffix(WEIGHT_DELAY_SUFFIX)
    if base not in ORDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULE_NAMES)}")
    return base, name.endswith(WEIGHT_DELAY_SUFFIX)


def split_backward(order: ComputeOrder, delay: int) -> ComputeOrder:
    """Replace each B by I, and put its W after the next `delay` compute actions (or at the end)."""
    out: ComputeOrder = []
    pending: list[list[int]] = []  # [compute actions still to pass, micro-batch], oldest first
    for kind, micro_batch in order:
        out.append(("I", micro_batch) if kind == "B" else (kind, micro_batch))
        for item in pending:
            item[0] -= 1
        while pending and pending[0][0] <= 0:
            out.append(("W", pending.pop(0)[1]))
        if kind == "B" and delay <= 0:
            out.append(("W", micro_batch))
        elif kind == "B":
            pending.append([delay, micro_batch])
    return out + [("W", micro_batch) for _, micro_batch in pending]


def with_communication(problem: PipelineProblem, stage: int, order: ComputeOrder) -> list[Action]:
    """Receive each input just before the compute that needs it; send each output right after it is made."""
    tensors = problem.tensors
    actions: list[Action] = []
    for kind, m in order:
        if kind == "F":
            actions += [Action(stage, "RECV_F", m, t.name) for t in tensors if t.dst_stage == stage]
        elif kind in ("B", "I"):
            actions += [Action(stage, "RECV_B", m, t.name) for t in tensors if t.src_stage == stage and t.backward]
        actions.append(Action(stage, kind, m))
        if kind == "F":
            actions += [Action(stage, "SEND_F", m, t.name) for t in tensors if t.src_stage == stage]
        elif kind in ("B", "I"):
            actions += [Action(stage, "SEND_B", m, t.name) for t in tensors if t.dst_stage == stage and t.backward]
    return actions


def stage_actions(problem: PipelineProblem, name: str, weight_delay: tuple[int, ...] = ()) -> list[list[Action]]:
    """Every stage's action list for schedule `name`; `weight_delay` (per stage) applies to `-wd` names."""
    base, split = parse_schedule_name(name)
    stages = len(problem.stages)
    delays = weight_delay or (0,) * stages
    if split and len(delays) != stages:
        raise ValueError(f"weight_delay has {len(delays)} entries for {stages} stages; give one per stage")
    out = []
    for stage in range(stages):
        order = ORDERS[base](stage, stages, problem.micro_batches)
        if split:
            order = split_backward(order, delays[stage])
        out.append(with_communication(problem, stage, order))
    return out
