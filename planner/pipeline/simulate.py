"""Replay a schedule in time: each stage's compute stream and the NICs are the resources.

A send starts its transfer at the first time the data exists and every NIC side it uses is free
for as long as it takes (earlier gaps are reused, busy NIC sides are never shared); with overlap
the stage goes on computing, without it the stage waits for the transfer to finish. A receive
waits until its transfer has arrived. Events run in time order (ties: lower stage first), so the
result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

from xmesh_plan.schemas.pipeline import PipelineProblem, PipelineSchedule, TransferCost

from .actions import Action, parse_actions
from .costs import signal_costs
from .validate import ScheduleError, validate


@dataclass(frozen=True, slots=True)
class ComputeSpan:
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class TransferSpan:
    """One transfer: issued by the sender at `issued_s`, on the wire from `start_s` to `end_s`."""

    tensor: str
    direction: str
    micro_batch: int
    src_stage: int
    dst_stage: int
    issued_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class WaitSpan:
    """A stage standing idle at a receive (or, without overlap, at a send)."""

    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    stages: int
    compute: tuple[ComputeSpan, ...]
    transfers: tuple[TransferSpan, ...]
    waits: tuple[WaitSpan, ...]

    @property
    def iteration_s(self) -> float:
        ends = [s.end_s for s in self.compute] + [w.end_s for w in self.waits] + [t.end_s for t in self.transfers]
        return max(ends, default=0.0)


def compute_seconds(problem: PipelineProblem, action: Action) -> float:
    stage = problem.stages[action.stage]
    return {"F": stage.forward_s, "B": stage.backward_s, "I": stage.backward_input_s, "W": stage.backward_weight_s}[action.kind]


class _Replay:
    """The mutable state of one replay; `run` returns the finished timeline."""

    def __init__(self, problem: PipelineProblem, stage_actions: list[list[Action]], costs: tuple[TransferCost, ...], overlap: bool):
        self.problem, self.actions, self.overlap = problem, stage_actions, overlap
        self.costs = {(c.tensor, c.direction): c for c in costs}
        self.position = [0] * len(stage_actions)
        self.clock = [0.0] * len(stage_actions)
        self.nic_busy: dict[str, list[tuple[float, float]]] = {}
        self.arrivals: dict[tuple[str, str, int], TransferSpan] = {}
        self.compute, self.transfers, self.waits = [], [], []

    def ready_time(self, stage: int) -> float | None:
        """When stage's next action can start, or None if it waits on a transfer not yet sent."""
        action = self.actions[stage][self.position[stage]]
        if action.kind.startswith("RECV"):
            span = self.arrivals.get(action.transfer)
            return None if span is None else max(self.clock[stage], span.end_s)
        return self.clock[stage]

    def run(self) -> Timeline:
        while True:
            ready = [(t, s) for s in range(len(self.actions)) if self.position[s] < len(self.actions[s])
                     for t in [self.ready_time(s)] if t is not None]
            if not ready:
                break
            start, stage = min(ready)
            self.step(stage, start)
        self._check_finished()
        return Timeline(len(self.actions), tuple(self.compute), tuple(self.transfers), tuple(self.waits))

    def step(self, stage: int, start: float) -> None:
        action = self.actions[stage][self.position[stage]]
        self.position[stage] += 1
        if action.is_compute:
            end = start + compute_seconds(self.problem, action)
            self.compute.append(ComputeSpan(action, start, end))
        elif action.kind.startswith("SEND"):
            end = self.send(action, start)
        else:
            end = start
        if end > self.clock[stage] and not action.is_compute:
            self.waits.append(WaitSpan(action, self.clock[stage], end))
        self.clock[stage] = end

    def send(self, action: Action, issued: float) -> float:
        """Start the transfer; return when the sending stage may go on."""
        cost = self.costs[(action.tensor, action.direction)]
        tensor = self.problem.tensor(action.tensor)
        src, dst = (tensor.src_stage, tensor.dst_stage) if action.direction == "F" else (tensor.dst_stage, tensor.src_stage)
        start = self.earliest_gap(cost.nics, issued, cost.seconds)
        end = start + cost.seconds
        for nic in cost.nics:
            self.nic_busy.setdefault(nic, []).append((start, end))
        span = TransferSpan(action.tensor, action.direction, action.micro_batch, src, dst, issued, start, end)
        self.arrivals[action.transfer] = span
        self.transfers.append(span)
        return issued if self.overlap else end

    def earliest_gap(self, nics: tuple[str, ...], issued: float, seconds: float) -> float:
        """First time from `issued` at which every NIC side in `nics` is free for `seconds` (gaps are reused)."""
        spans = [span for nic in nics for span in self.nic_busy.get(nic, [])]
        for start in sorted({issued} | {end for _, end in spans if end > issued}):
            if all(end <= start or begin >= start + seconds for begin, end in spans):
                return start
        return issued

    def _check_finished(self) -> None:
        stuck = [self.actions[s][p] for s, p in enumerate(self.position) if p < len(self.actions[s])]
        if stuck:
            raise ScheduleError("deadlock while simulating: stages wait at " + ", ".join(map(str, stuck))
                                + "; no matching send can run. Run the validator for the cycle")


def simulate(problem: PipelineProblem, stage_actions: list[list[Action]], costs: tuple[TransferCost, ...], overlap: bool = True) -> Timeline:
    return _Replay(problem, stage_actions, costs, overlap).run()


@dataclass(frozen=True)
class Metrics:
    """What a schedule costs: iteration time, idle share, time lost to communication, memory."""

    iteration_s: float
    bubble_fraction: float
    exposed_comm_s: float
    wait_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"iteration_s": self.iteration_s, "bubble_fraction": self.bubble_fraction, "exposed_comm_s": self.exposed_comm_s,
                "wait_s": list(self.wait_s), "peak_in_flight": list(self.peak_in_flight),
                "peak_activation_bytes": list(self.peak_activation_bytes)}


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward has run and whose backward has not finished (activations held)."""
    held = peak = 0
    for action in actions:
        held += {"F": 1, "B": -1, "W": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


def measure(problem: PipelineProblem, stage_actions: list[list[Action]], timeline: Timeline, signal: Timeline) -> Metrics:
    iteration = timeline.iteration_s
    busy = sum(s.end_s - s.start_s for s in timeline.compute)
    stages = len(stage_actions)
    bubble = 1.0 - busy / (stages * iteration) if iteration > 0 else 0.0
    wait = [0.0] * stages
    for span in timeline.waits:
        wait[span.action.stage] += span.end_s - span.start_s
    peaks = tuple(peak_in_flight(a) for a in stage_actions)
    memory = tuple(p * st.activation_bytes for p, st in zip(peaks, problem.stages))
    return Metrics(iteration, bubble, max(0.0, iteration - signal.iteration_s), tuple(wait), peaks, memory)


def schedule_actions(schedule: PipelineSchedule) -> list[list[Action]]:
    """Parse and validate a saved schedule's action lines."""
    actions = [parse_actions(line, stage) for stage, line in enumerate(schedule.stages)]
    validate(schedule.pipeline, actions)
    return actions


def evaluate(schedule: PipelineSchedule) -> tuple[Timeline, Metrics]:
    """Simulate a saved schedule, and once more with free transfers to see how much communication costs."""
    actions = schedule_actions(schedule)
    timeline = simulate(schedule.pipeline, actions, schedule.costs, schedule.overlap)
    signal = simulate(schedule.pipeline, actions, signal_costs(schedule.costs), schedule.overlap)
    return timeline, measure(schedule.pipeline, actions, timeline, signal)
