"""Replay one stage's pipeline schedule every iteration: user compute callbacks plus non-blocking reshards.

    executors = pipeline_executors(schedule, plans, MPI.COMM_WORLD)     # once, on every rank
    runner = PipelineRunner(schedule, stage_fns, executors, stage)
    runner.run_iteration()                                              # every training step

World rank r plays global device r, so a rank belongs to the stage whose mesh holds device r.
Every transfer (tensor, direction, micro-batch) has its own `ReshardingExecutor`: receivers post
all of theirs at the start of an iteration, a sender starts its own when the schedule says SEND,
and the stage waits only at RECV, so transfers run while the stage computes. Without overlap
(`schedule.overlap` false) each send is waited for at once.

`stage_fns` provides, for this rank's local shards (numpy arrays keyed by tensor name):
    forward(micro_batch, inputs) -> outputs            # tensors this stage sends
    backward_input(micro_batch, grads) -> input_grads  # grads of outputs in, grads of inputs out
    backward_weight(micro_batch) -> None               # weight gradients; an action B runs both parts
"""

from __future__ import annotations

import time
from typing import Mapping, Protocol

from xmesh_plan.schemas.pipeline import Action, PipelineSchedule, parse_actions
from xmesh_plan.schemas.plan import Plan

from .errors import ExecutorError
from .timeouts import check_timeout

Transfer = tuple[str, str, int]  # tensor, direction ('F' or 'B'), micro-batch
POLL_S = 2e-4


class StageFunctions(Protocol):
    def forward(self, micro_batch: int, inputs: dict) -> dict: ...
    def backward_input(self, micro_batch: int, grads: dict) -> dict: ...
    def backward_weight(self, micro_batch: int) -> None: ...


class TransferExecutor(Protocol):
    """What the runner needs of a `ReshardingExecutor` (after `prepare()`)."""

    def start(self, local_shard=None) -> None: ...
    def test(self) -> bool: ...
    def wait(self): ...


def stage_of_device(schedule: PipelineSchedule, device: int) -> int | None:
    """The stage whose mesh holds `device`, or None."""
    for index, stage in enumerate(schedule.pipeline.stages):
        if device in stage.mesh.devices:
            return index
    return None


def transfer_stages(schedule: PipelineSchedule, tensor: str, direction: str) -> tuple[int, int]:
    """(sending stage, receiving stage) of a transfer."""
    t = schedule.pipeline.tensor(tensor)
    return (t.src_stage, t.dst_stage) if direction == "F" else (t.dst_stage, t.src_stage)


def pipeline_executors(schedule: PipelineSchedule, plans: Mapping[tuple[str, str], Plan], world, timeout_s: float = 60.0,
                       executor_cls=None) -> dict[Transfer, TransferExecutor]:
    """Prepared executors for every transfer this rank takes part in; all ranks call it (collective).

    `plans[(tensor, direction)]` is that transfer's compiled plan. Each transfer pair gets a
    communicator of the two meshes' ranks (ordered by device id, as the executor expects); the
    ranks create and prepare them in one global order, so the collective calls match up.
    """
    check_timeout(timeout_s)
    if executor_cls is None:
        from .executor import ReshardingExecutor as executor_cls
    rank, pipeline = world.Get_rank(), schedule.pipeline
    mine = stage_of_device(schedule, rank)
    out: dict[Transfer, TransferExecutor] = {}
    for name, direction in pipeline.transfers():
        if (name, direction) not in plans:
            raise ExecutorError(f"no plan for transfer {name}/{direction}; compile one plan per tensor and direction")
        pair = transfer_stages(schedule, name, direction)
        devices = sorted(set(pipeline.stages[pair[0]].mesh.devices) | set(pipeline.stages[pair[1]].mesh.devices))
        if mine not in pair:
            continue
        comm = world.Create_group(world.Get_group().Incl(devices))
        for micro_batch in range(pipeline.micro_batches):
            out[(name, direction, micro_batch)] = executor_cls(plans[(name, direction)], comm, timeout_s=timeout_s).prepare()
    return out


class PipelineRunner:
    """Runs stage `stage`'s action list once per `run_iteration()`; see the module docstring."""

    def __init__(self, schedule: PipelineSchedule, stage_fns: StageFunctions, executors: Mapping[Transfer, TransferExecutor],
                 stage: int, timeout_s: float = 60.0):
        check_timeout(timeout_s)
        if not 0 <= stage < len(schedule.stages):
            raise ExecutorError(f"stage {stage} is not in this schedule (stages 0..{len(schedule.stages) - 1})")
        self.schedule, self.fns, self.executors, self.stage = schedule, stage_fns, executors, stage
        self.actions = parse_actions(schedule.stages[stage], stage)
        self.timeout_s = float(timeout_s)
        missing = [a for a in self.actions if not a.is_compute and a.transfer not in executors]
        if missing:
            raise ExecutorError(f"stage {stage}: no executor for {missing[0]}; build them with pipeline_executors() on every rank")

    def run_iteration(self) -> None:
        """One training step's worth of this stage's actions."""
        self.received: dict[Transfer, object] = {}
        self.outputs: dict[tuple[str, int], dict] = {}
        self.in_flight: list[TransferExecutor] = []
        for action in self.actions:
            if action.kind.startswith("RECV"):
                self.executors[action.transfer].start(None)
                self.in_flight.append(self.executors[action.transfer])
        for action in self.actions:
            self.step(action)
            self.progress()
        while self.in_flight:
            self.finish(self.in_flight[0])

    def step(self, action: Action) -> None:
        m, kind = action.micro_batch, action.kind
        if kind == "F":
            self.outputs[("F", m)] = self.fns.forward(m, self.inputs(action, "F"))
        elif kind in ("B", "I"):
            self.outputs[("B", m)] = self.fns.backward_input(m, self.inputs(action, "B"))
            if kind == "B":
                self.fns.backward_weight(m)
        elif kind == "W":
            self.fns.backward_weight(m)
        elif kind.startswith("SEND"):
            self.send(action)
        else:
            self.received[action.transfer] = self.finish(self.executors[action.transfer]).copy()

    def inputs(self, action: Action, direction: str) -> dict:
        """The received tensors this compute step consumes, by tensor name."""
        return {t: v for (t, d, m), v in self.received.items() if d == direction and m == action.micro_batch}

    def send(self, action: Action) -> None:
        outputs = self.outputs[(action.direction, action.micro_batch)]
        if action.tensor not in outputs:
            kind = "forward" if action.direction == "F" else "backward_input"
            raise ExecutorError(f"stage {self.stage}: {kind}({action.micro_batch}) returned no {action.tensor!r} "
                                f"for {action}; return every tensor this stage sends")
        executor = self.executors[action.transfer]
        executor.start(outputs[action.tensor])
        self.in_flight.append(executor)
        if not self.schedule.overlap:
            self.finish(executor)

    def progress(self) -> None:
        """Let in-flight transfers advance between compute steps (receives were posted up front)."""
        for executor in self.in_flight:
            executor.test()

    def finish(self, executor: TransferExecutor):
        """Wait for one transfer while driving the others, so relays through this rank keep moving."""
        deadline = time.monotonic() + self.timeout_s
        while not executor.test():
            self.progress()
            if time.monotonic() > deadline:
                raise ExecutorError(f"stage {self.stage}: a transfer did not finish within {self.timeout_s:g} s; "
                                    "check that every rank runs the same schedule")
            time.sleep(POLL_S)
        self.in_flight.remove(executor)
        return executor.wait()
