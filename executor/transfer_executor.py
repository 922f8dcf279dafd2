"""`TransferExecutor`: replay a multi-tensor plan, a name -> shard mapping in and out on every rank.

    ex = TransferExecutor(plan, MPI.COMM_WORLD).prepare()        # once, on every rank
    new = ex.run({"embed.weight": e, "layers.0.q.weight": q})  # this rank's source shards by name
    new["layers.0.q.weight"]                                      # its destination shards by name

The plan is split into one single-tensor plan per tensor (`schemas.plan_tensors`), keeping the joint
plan's operations, ids and order; each gets its own `ReshardingExecutor`, which lowers it and owns its
buffers. A rank outside the source mesh passes None (or {}); outside the destination mesh it gets {}.
A single-tensor plan works too, its one tensor named by the problem's name. How the tensors run:

- `order=None` (the default): `default_order`: `posted` for a multi-tensor plan on the `mpi` engine
  (measured faster) unless the plan states a staging limit (`compile --max-staging-mb`), `device` otherwise.
- `order="device"`: each device takes part in one operation at a
  time in the joint plan's order, across tensors (`executor.joint`): one engine replays this device's
  steps of every tensor, with each tensor's buffers and one staging area shared by every tensor, re-used
  run after run (`stage_bytes`; what `schemas.staging.staging_peaks` computes and a limited plan
  states); its tensors' tags are numbered one after another on one communicator. On `mpi` and `torch`.
  The `nccl` engine merges the tensors' calls its own way (`nccl_plan.joint_nccl_program`): one stream in
  the joint plan's order, one communicator per group for every tensor, staging the largest operation's
  (a shared message's bundles together, sent as one message), `stage_bytes` what its engine allocated.
- `order="posted"`: on `mpi` every message of every tensor is posted at once: each tensor's reshard
  is started before any is waited for, and a waiting MPI engine drives the others this thread
  started; they share one duplicated communicator, each tensor's tags numbered after the ones before
  it. The torch engine (one process group for all tensors, NCCL pairing messages by order) and the
  NCCL engine do not run several reshards in flight, so they run the tensors one after another in
  tensor order: `start()` starts the first, `test()` and `wait()` start each next one as the one
  before finishes. On `mpi` each tensor has its own staging area (the sum over tensors), so a plan
  compiled with `--max-staging-mb` is refused posted there where that sum is above the peak it states;
  the tensors that run one after another share one area, the largest any of them needs (on NCCL each
  call's own staging, within the device-order peak a limited plan states, which `prepare()` checks).

Every engine takes and returns the same name -> shard mappings.
"""

from __future__ import annotations

from typing import Any, Mapping

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.carriers import has_carriers
from xmesh_plan.schemas.plan_check import PlanError, check_plan, tags_used
from xmesh_plan.schemas.plan_tensors import is_multi, mpi_transfer_order, tensor_names, tensor_plans
from xmesh_plan.schemas.staging import staging_peaks

from .errors import ExecutorError, PlanMismatchError
from .engines import ENGINES, TransportOptions, engine_entry
from .executor import DEFAULT_POLL_S, Flight, Flying, ReshardingExecutor
from .joint import JointProgram, join_programs, tensor_programs
from .lower import ORDERS, refusal_advice
from .ranks import device_of_rank
from .worlds import is_mpi_comm


def default_order(plan: Plan, engine: str) -> str:
    """The order a plan runs in when none is given, by the engine that runs it (`engines.engine_entry`:
    `gloo`, or `nccl` over a torch process group, is the torch engine): `device`, except a multi-tensor
    plan on `mpi`, which posts every tensor's messages at once and measured faster so (the small weight
    sync on 8 MPI ranks: 2.76x; BENCHMARKS.md, "Weight sync on the executor"). The torch and NCCL engines'
    posted order runs the tensors one after another (on NCCL with a communicator per group per tensor,
    and no shared messages), so they keep device order; and a plan that states a staging limit
    (`--max-staging-mb`) keeps it on `mpi` too, since posted order stages every box at once."""
    if not is_multi(plan) or not ENGINES[engine].concurrent:
        return "device"
    return mpi_transfer_order(plan.staging is not None)


def check_transfer_staging(plan: Plan, order: str, engine: str) -> None:
    """Refuse (on every rank alike: it reads only the plan) to run a multi-tensor plan that states a staging
    limit in a way that would allocate more than the peak it states on some device. NCCL's need (its largest
    operation, or shared message in device order, on each device) is known once every tensor is lowered:
    `TransferExecutor.prepare()` checks it on every rank before anything is allocated."""
    entry = ENGINES[engine]
    if not is_multi(plan) or plan.staging is None or entry.own_staging:
        return
    stated = plan.staging.peak_bytes
    if order == "posted" and not entry.concurrent:  # one tensor after another, in one shared area
        need: dict[int, int] = {}
        for single in tensor_plans(plan):
            for device, nbytes in staging_peaks(single, "posted").items():
                need[device] = max(need.get(device, 0), nbytes)
        how = "the largest tensor's staged boxes at once"
    else:
        need = staging_peaks(plan, order)
        how = "every tensor's staged boxes at once" if order == "posted" else "one area shared by every tensor"
    for device, nbytes in need.items():
        if nbytes > stated.get(device, 0):
            raise PlanMismatchError(f"order={order!r} needs {nbytes} B of staging on device {device} ({how}), but the plan states "
                                    f"{stated.get(device, 0)} B there (compiled with a staging limit of {plan.staging.limit_bytes} B, "
                                    f"--max-staging-mb, for order={plan.staging.order!r}); run it with order={plan.staging.order!r}, "
                                    "or recompile it without --max-staging-mb to run it in this order", same_on_every_rank=True)


class TransferExecutor(Flying):
    """Replays every tensor of a plan on this rank; see the module docstring for the calling pattern. `engine`: in
    device order the joint engine (None before prepare(), and for the other ways of running)."""

    def __init__(self, plan: Plan, comm=None, backend: str | None = None, timeout_s: float = 60.0,
                 poll_s: tuple[float, float] = DEFAULT_POLL_S, gpu: int | None = None, order: str | None = None,
                 transport: TransportOptions | None = None):
        if not isinstance(plan, Plan):
            raise TypeError(f"plan is a {type(plan).__name__}; pass a schemas.Plan, e.g. schemas.read_plan_file('x.plan.json')")
        world = "mpi" if is_mpi_comm(comm) else "torch"
        entry = engine_entry(backend, world)
        order = order or default_order(plan, entry.name)
        if order not in ORDERS:
            raise ValueError(f"order {order!r} is unknown; use one of: {', '.join(ORDERS)}")
        try:
            check_plan(plan)  # tensor indices in range before splitting
        except PlanError as err:
            raise PlanMismatchError(refusal_advice(str(err)),
                                    same_on_every_rank=True) from None  # every rank reads the same plan
        named = backend or world
        check_transfer_staging(plan, order, entry.name)
        self.concurrent = entry.concurrent
        self.plan, self.names, self.order = plan, tensor_names(plan), order
        self.parts = [ReshardingExecutor(p, comm, backend, timeout_s, poll_s, gpu, order, transport) for p in tensor_plans(plan)]
        self.entry = self.parts[0].entry
        # one engine replays every tensor's steps (executor.joint): in device order, and posted on MPI where
        # bundles of several tensors share messages (one message needs one staging area)
        self.joined = is_multi(plan) and (order == "device" or (self.concurrent and has_carriers(plan.operations)))
        if self.joined and self.entry.join is None:
            raise PlanMismatchError(f"backend {named!r} runs a multi-tensor plan's tensors one after another, not in the plan's "
                                    "operation order across tensors; pass order='posted' (--order posted) to run them so, "
                                    "or use backend 'mpi' or 'torch'", same_on_every_rank=True)
        first = 0
        for part in self.parts if self.concurrent or self.joined else ():  # tags of tensor k follow those of tensors 0..k-1
            part.tag_offset, part.joined = first, self.joined
            first += sum(map(tags_used, part.plan.operations))
        self.given: dict[str, Any] = {}
        self.results: list[Any] = [None] * len(self.parts)
        self.current = len(self.parts)  # one after another: the tensor in flight (len(parts): none)
        self.running = False  # one after another: between start() and wait()
        self.flight = Flight()  # device order: the joint engine (made by prepare()) and the calls into it
        self.joint: JointProgram | None = None  # device order: this device's steps of every tensor, made by prepare()
        self.area: int | None = None  # one after another: the staging area every tensor shares, made by prepare()

    @property
    def device(self) -> int:
        return self.parts[0].device

    @property
    def stage_bytes(self) -> int:
        """Bytes of staging this rank allocated: in device order one area every tensor shares (`executor.joint`),
        posted on MPI each tensor's own (the sum), one after another one area the size of the largest need.
        At most what the plan states for this device when it states any."""
        own = getattr(self.engine, "stage_bytes", None)  # a joint engine that lays staging out its own way (NCCL)
        if own is not None:
            return own
        if self.joint is not None:
            return self.joint.stage_bytes
        if self.area is not None:
            return self.area
        return sum(part.program.stage_bytes for part in self.parts if part.program is not None)

    def prepare(self) -> "TransferExecutor":
        """Check and set up every tensor's executor (in tensor order, on every rank).

        Every tensor's plan is lowered (and agreed on by every rank) first; in device order the joint
        program then lays their staging out in one area, which the first tensor's engine allocates and
        the others share. On MPI the first tensor's executor duplicates the communicator and the others
        share it, each numbering its tags after the tensors before it (a plan's tags fit MPI's TAG_UB together)."""
        first, world = self.parts[0], self.parts[0].world  # the world's size against the joint plan, named as the user knows it
        joint = first.plan.model_copy(update={"problem": first.plan.problem.model_copy(update={"name": self.plan.problem.name})})
        device_of_rank(joint, world.rank, world.size, world.label, world.launch)
        for part in self.parts:
            part.lower_program()
        self._allocate()
        return self

    def _allocate(self) -> None:
        """`prepare()` once every tensor is lowered: lay out their staging (one joint program, or one area
        used in turn), check it against the plan's stated peak on every rank, then set up the engines."""
        refusal = None
        if self.joined:
            try:
                self._join()
            except PlanMismatchError as err:  # this device's steps alone may show it: every rank learns of it below
                refusal = err
        elif not self.concurrent and len(self.parts) > 1:
            self.area = max(self.entry.stage_need(part.program) for part in self.parts)
        if refusal is None and self.plan.staging is not None:
            refusal = self._over_stated(self._planned_staging())
        if self.joined or self.plan.staging is not None:  # the same on every rank: every rank agrees here, before any allocation
            self.parts[0]._agree(refusal)
        self._setup_engines()

    def _planned_staging(self) -> int:
        """Bytes of staging the engines will allocate on this rank (what `stage_bytes` says once they are set up)."""
        programs = [part.program for part in self.parts]
        if self.joined:
            return self.entry.joint_stage_need(self.joint, programs)
        if self.area is not None:
            return self.area
        return sum(self.entry.stage_need(p) for p in programs)

    def _setup_engines(self) -> None:
        """`prepare()` after lowering: every tensor's engine in tensor order (the same on every rank), sharing
        the first one's communicator and staging where the plan's tensors run through one area."""
        sequential = self.area is not None
        stage = None
        for k, part in enumerate(self.parts):
            if (self.concurrent or self.joined) and k:
                part.shared_comm = self.parts[0].comm
            part.setup_engine(stage, stage_bytes=self.area if k == 0 else None)
            if self.joined or sequential:
                stage = part.engine.stage  # the first tensor's engine allocated the area; the rest share it
        if self.joined:
            self.engine = self.entry.make_joint(self.joint, [part.engine for part in self.parts])
            self.engine.setup()

    def _over_stated(self, need: int) -> PlanMismatchError | None:
        """The error to raise where this rank would allocate `need` bytes of staging, more than the plan states for its
        device (a plan compiled with `--max-staging-mb`). On MPI and torch `check_transfer_staging` refuses that from
        the plan alone in the constructor; NCCL's need is known once every tensor is lowered."""
        stated = self.plan.staging.peak_bytes.get(self.device, 0)
        if need <= stated:
            return None
        return PlanMismatchError(f"backend {self.entry.name!r} in order={self.order!r} needs {need} B of staging on "
                                 f"device {self.device}, but the plan states {stated} B there (staging.peak_bytes; compiled with a "
                                 f"staging limit of {self.plan.staging.limit_bytes} B, --max-staging-mb), less than its largest "
                                 "operation; recompile the plan and check it with `xmesh-plan verify`")

    def _join(self) -> None:
        """Device order: this device's steps of every tensor as one program (`executor.joint`), and each tensor's
        program re-based into the one staging area they share (before their engines are set up)."""
        programs = [part.program for part in self.parts]
        self.joint = join_programs(programs, self.plan, self.order)
        for part, program in zip(self.parts, tensor_programs(self.joint, programs)):
            part.program = program

    def run(self, shards: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Reshard every tensor once: this rank's source shards by name in, its destination shards by name out."""
        self.start(shards)
        return self.wait()

    def start(self, shards: Mapping[str, Any] | None = None) -> None:
        """Start every tensor's reshard and return at once; do not modify the shards until `wait()` returns."""
        given = self._sources(shards)
        if self.joined:
            self._start_joint(given)
            return
        if not self.concurrent and self.current < len(self.parts):
            raise ExecutorError("start() called while a reshard is in flight; call wait() first")
        for part, name in zip(self.parts, self.names):  # every input first: a wrong one refused before any tensor moves
            part._startable()
            given[name] = part._adopt(given.get(name))
        if not self.concurrent:
            self.parts[0].start_adopted(given[self.names[0]])
            self.given, self.current, self.running = given, 0, True
            return
        started = []
        try:
            for part, name in zip(self.parts, self.names):
                part.start_adopted(given[name])
                started.append(part)
        except BaseException:
            for part in started:  # the peers cannot finish these without this rank's later tensors: give them up
                part.flight.abandon(ExecutorError("a later tensor failed to start"), "start()")
            raise

    def test(self) -> bool:
        """Drive every tensor's communication once without blocking; True when all have finished."""
        if self.joined:
            return self.flight.test()
        if not self.concurrent:
            return self._advance(block=False)
        return all([part.test() for part in self.parts])

    def wait(self) -> dict[str, Any]:
        """Finish every tensor's reshard; name -> destination shard (the engines' own buffers, reused next time)."""
        if self.joined:
            self.flight.wait()
            self.results = [part.engine.dst for part in self.parts]
        elif self.concurrent:
            self.results = [part.wait() for part in self.parts]
        elif not self.running:
            raise ExecutorError("wait() called without start()")
        else:
            self._advance(block=True)
            self.given, self.running = {}, False
        return {name: shard for name, shard in zip(self.names, self.results) if shard is not None}

    def _advance(self, block: bool) -> bool:
        """One after another: collect finished tensors and start the next; True when the last has finished."""
        while self.current < len(self.parts):
            part = self.parts[self.current]
            if not block and not part.test():
                return False
            self.results[self.current] = part.wait()
            self.current += 1
            if self.current < len(self.parts):
                self.parts[self.current].start_adopted(self.given[self.names[self.current]])
        return True

    def close(self) -> None:
        """Close every tensor's executor (see `ReshardingExecutor.close`), the communicator's owner last; in
        device order the joint engine first, after finishing a reshard in flight as `ReshardingExecutor.close` does."""
        interrupted = self.flight.close()
        for part in reversed(self.parts):
            part.close()
        if interrupted is not None:
            raise interrupted

    def _start_joint(self, given: dict[str, Any]) -> None:
        """Device order: check every tensor's shard and start the joint engine."""
        self.flight.usable("run() or start()")
        if self.flight.in_flight:
            raise ExecutorError("start() called while a reshard is in flight; call wait() first")
        self.flight.start([part._adopt(given.get(name)) for part, name in zip(self.parts, self.names)])

    def _sources(self, shards: Mapping[str, Any] | None) -> dict[str, Any]:
        """The shards by name, refusing unknown names and, on a source rank, missing ones."""
        if shards is not None and not isinstance(shards, Mapping):
            raise PlanMismatchError(f"run(): shards is a {type(shards).__name__}; pass a mapping of tensor name to this rank's "
                                    f"source shard, e.g. {{{self.names[0]!r}: shard}} (None or {{}} on a rank with no source shard)")
        shards = dict(shards or {})
        unknown = sorted(set(shards) - set(self.names))
        if unknown:
            raise PlanMismatchError(f"run(): {unknown[0]!r} is not a tensor of this plan; pass shards named as in the "
                                    f"problem ({', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''})")
        if self.parts[0].engine is not None and self.parts[0].program.src_block is not None:
            missing = [n for n, p in zip(self.names, self.parts) if n not in shards and p.program.src_block is not None]
            if missing:
                raise PlanMismatchError(f"run(): device {self.device} is in the source mesh; pass its shard of "
                                        f"{missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
        return shards
