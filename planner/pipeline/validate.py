"""Check a schedule before use: every action present once and in dependency order, and no deadlock.

Deadlock check: actions are nodes; each stage's list is a chain, and each send points to its
receive (a receive waits for its send). A cycle means some stage waits forever.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx

from xmesh_plan.schemas.pipeline import PipelineProblem

from .actions import Action


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order, or deadlocks."""


def expected_actions(problem: PipelineProblem, stage: int, split: bool) -> Counter:
    """The multiset of actions stage `stage` must run in one iteration."""
    kinds = ("F", "I", "W") if split else ("F", "B")
    out = Counter(Action(stage, k, m) for m in range(problem.micro_batches) for k in kinds)
    for t in problem.tensors:
        for m in range(problem.micro_batches):
            if t.src_stage == stage:
                out[Action(stage, "SEND_F", m, t.name)] += 1
                out.update([Action(stage, "RECV_B", m, t.name)] if t.backward else [])
            if t.dst_stage == stage:
                out[Action(stage, "RECV_F", m, t.name)] += 1
                out.update([Action(stage, "SEND_B", m, t.name)] if t.backward else [])
    return out


def _check_complete(problem: PipelineProblem, stage: int, actions: list[Action]) -> None:
    split = any(a.kind in ("I", "W") for a in actions)
    want, have = expected_actions(problem, stage, split), Counter(actions)
    for action in sorted(set(want) | set(have)):
        if have[action] != want[action]:
            verb = "is missing" if have[action] < want[action] else f"appears {have[action]} times"
            extra = "" if want[action] else " (not part of this pipeline; check the stage, tensor and micro-batch)"
            raise ScheduleError(f"stage {stage}: action {action} {verb}{extra}; every action must appear exactly once")


def _check_local_order(stage: int, actions: list[Action]) -> None:
    """Forward before backward, I before W, sends after and receives before the compute they serve."""
    position = {a: i for i, a in enumerate(actions)}
    for i, a in enumerate(actions):
        needs = []
        if a.kind in ("B", "I", "SEND_F"):
            needs.append(Action(stage, "F", a.micro_batch))
        if a.kind == "W":
            needs.append(Action(stage, "I", a.micro_batch))
        if a.kind == "SEND_B":
            needs.append(Action(stage, "I" if Action(stage, "I", a.micro_batch) in position else "B", a.micro_batch))
        for need in needs:
            if position.get(need, len(actions)) > i:
                raise ScheduleError(f"stage {stage}: {a} comes before {need}, which it depends on; move it after")
        follower = {"RECV_F": "F", "RECV_B": "I" if Action(stage, "I", a.micro_batch) in position else "B"}.get(a.kind)
        if follower and position[Action(stage, follower, a.micro_batch)] < i:
            raise ScheduleError(f"stage {stage}: {a} comes after {Action(stage, follower, a.micro_batch)}, which needs it; move it before")


def dependency_graph(stage_actions: list[list[Action]]) -> nx.DiGraph:
    """Program order within each stage, plus send -> receive of the same transfer."""
    graph = nx.DiGraph()
    sends = {}
    for actions in stage_actions:
        graph.add_nodes_from(actions)
        graph.add_edges_from(zip(actions, actions[1:]))
        sends.update({a.transfer: a for a in actions if a.kind.startswith("SEND")})
    for actions in stage_actions:
        graph.add_edges_from((sends[a.transfer], a) for a in actions if a.kind.startswith("RECV"))
    return graph


def check_deadlock_free(stage_actions: list[list[Action]]) -> None:
    graph = dependency_graph(stage_actions)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    waits = " -> ".join(str(u) for u, _ in cycle)
    raise ScheduleError(f"deadlock: {waits} -> {cycle[0][0]} wait on each other in a cycle; "
                        "reorder so every receive comes after the send it waits for can run")


def validate(problem: PipelineProblem, stage_actions: list[list[Action]]) -> None:
    """Raise ScheduleError naming the first bad action; return None for a usable schedule."""
    if len(stage_actions) != len(problem.stages):
        raise ScheduleError(f"schedule has {len(stage_actions)} stages but the pipeline has {len(problem.stages)}; give one list per stage")
    for stage, actions in enumerate(stage_actions):
        wrong = next((a for a in actions if a.stage != stage), None)
        if wrong is not None:
            raise ScheduleError(f"action {wrong} is in the list of stage {stage}; put it in stage {wrong.stage}'s list")
        _check_complete(problem, stage, actions)
        _check_local_order(stage, actions)
    check_deadlock_free(stage_actions)
