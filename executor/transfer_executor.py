"""`TransferExecutor`: replay a multi-tensor plan, a name -> shard mapping in and out on every rank.

    ex = TransferExecutor(plan, MPI.COMM_WORLD).prepare()        # once, on every rank
    new = ex.run({"embed.weight": e, "layers.0.q.weight": q})  # this rank's source shards by name
    new["layers.0.q.weight"]                                      # its destination shards by name

This is the multi-tensor face of the one executor (`executor.Executor`): the plan is lowered once per
device, every tensor together (`passes.rank_program`), and one engine replays that program with a
buffer per (tensor, side). A rank outside the source mesh passes None (or {}); outside the destination
mesh it gets {}. A single-tensor plan works too, its one tensor named by the problem's name. How the
tensors run:

- `order=None` (the default): `default_order`: `posted` for a multi-tensor plan on an engine that posts
  concurrently (`mpi`; measured faster), within the staging limit where the plan states one
  (`compile --max-staging-mb`), `device` otherwise.
- `order="device"`: each device takes part in one operation at a time in the plan's order, across
  tensors (`lower.in_device_order`), with one staging area shared by every tensor, re-used run after
  run (`stage_bytes`; what `schemas.staging.staging_peaks` computes and a limited plan states). The
  `nccl` engine reads its calls off the same program (`nccl_plan.nccl_program`): one stream in the
  plan's order, one communicator per group for every tensor, staging the largest operation's (a shared
  message's bundles together, sent as one message), `stage_bytes` what its engine allocated.
- `order="posted"`: on `mpi` every message of every tensor is posted at once; staging is every staged
  box at once (the sum over tensors). A plan compiled with `--max-staging-mb` runs posted within a
  window of the limit's bytes per device (`window.in_window`): an operation goes once its staging there is
  free, so staging stays within the limit. The torch and NCCL engines do not run several
  reshards in flight (`engines.EngineEntry.concurrent`), so their program runs the tensors one after
  another in tensor order (`passes.one_tensor_at_a_time`), in one area the size of the largest need.

Tags are unique across the plan's tensors (`plan_index`), and the bundles of several tensors that share
one cross-host message send it once (`passes.share_messages`) in device order and posted on `mpi`.
Every engine takes and returns the same name -> shard mappings.
"""

from __future__ import annotations

from typing import Any, Mapping

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.plan_tensors import is_multi, mpi_transfer_order, tensor_plans
from xmesh_plan.schemas.staging import staging_peaks

from .errors import PlanMismatchError
from .engines import ENGINES, TransportOptions
from .executor import DEFAULT_POLL_S, Executor, check_stage_need, named_call
from .plan_file import PlanFile
from .plan_index import plan_index


def default_order(plan: Plan, engine: str) -> str:
    """The order a plan runs in when none is given, by the engine that runs it (`engines.engine_entry`:
    `gloo`, or `nccl` over a torch process group, is the torch engine): `device`, except a multi-tensor
    plan on `mpi`, which posts every tensor's messages at once and measured faster so (the small weight
    sync on 8 MPI ranks: 2.76x; BENCHMARKS.md, "Weight sync on the executor"). The torch and NCCL engines'
    posted order runs the tensors one after another (on NCCL with a communicator per group per tensor,
    and no shared messages), so they keep device order. A plan that states a staging limit (`--max-staging-mb`)
    runs posted on `mpi` within it (`executor.window`: each operation goes once its staging fits in the limit)."""
    if not is_multi(plan) or not ENGINES[engine].concurrent:
        return "device"
    return mpi_transfer_order()


def check_transfer_staging(plan: Plan, order: str, engine: str) -> None:
    """Refuse (on every rank alike: it reads only the plan) to run a multi-tensor plan that states a staging
    limit in a way that would allocate more than the peak it states on some device. NCCL's need (its largest
    operation, or shared message in device order, on each device) is known once every tensor is lowered:
    `TransferExecutor.prepare()` checks it on every rank before anything is allocated."""
    entry = ENGINES[engine]
    if not is_multi(plan) or plan.staging is None or entry.own_staging:
        return
    if order == "posted" and not entry.concurrent:  # one tensor after another, in one shared area
        need: dict[int, int] = {}
        for single in tensor_plans(plan):
            for device, nbytes in staging_peaks(single, "posted").items():
                need[device] = max(need.get(device, 0), nbytes)
        how = "the largest tensor's staged boxes at once"
    else:
        need = staging_peaks(plan, order)
        how = "posted within a window of its limit" if order == "posted" else "one area shared by every tensor"
    for device, nbytes in need.items():
        check_stage_need(plan, order, device, nbytes, how, same_on_every_rank=True)


class TransferExecutor(Executor):
    """The multi-tensor face of `Executor`: replays every tensor of a plan on this rank, a name -> shard mapping in
    and out; see the module docstring for the calling pattern."""

    def __init__(self, plan: Plan | PlanFile, comm=None, backend: str | None = None, timeout_s: float = 60.0,
                 poll_s: tuple[float, float] = DEFAULT_POLL_S, gpu: int | None = None, order: str | None = None,
                 transport: TransportOptions | None = None):
        if not isinstance(plan, (Plan, PlanFile)):
            raise TypeError(f"plan is a {type(plan).__name__}; pass a schemas.Plan, e.g. schemas.read_plan_file('x.plan.json'), "
                            "or use TransferExecutor.from_file(path, comm)")
        super().__init__(plan, comm, backend, timeout_s, poll_s, gpu, order, transport)
        self.one = len(self.names) == 1  # the engine takes and gives one shard, not a list of them
        self.targets: dict[str, Any] = {}  # the caller's destination tensors of the reshard in flight (start()'s `into`)

    def _order(self, plan: Plan | PlanFile, order: str | None) -> str:
        """`order`, else the engine's `default_order` for this plan."""
        return order or default_order(plan, self.entry.name)

    def _check_plan(self, plan: Plan | PlanFile, order: str) -> None:
        """A plan object's check (once per object, `plan_index`) and its staging limit in `order`
        (`check_transfer_staging`); a plan file's part is checked when each rank reads it, in prepare() (`plan_file`)."""
        if not isinstance(plan, Plan):
            return
        try:
            plan_index(plan)  # tensor indices in range before anything reads them
        except PlanMismatchError as err:
            raise PlanMismatchError(str(err), same_on_every_rank=True) from None  # every rank reads the same plan
        check_transfer_staging(plan, order, self.entry.name)

    def _check_staging(self, program) -> None:
        """Refuse where this rank would allocate more staging than the plan states for its device (a plan compiled
        with `--max-staging-mb`). On MPI and torch `check_transfer_staging` refuses that from the plan alone in the
        constructor; an engine that lays staging out its own way (NCCL) is checked here, once lowered."""
        if self.plan.staging is None:
            return
        if not is_multi(self.plan) and not self.entry.own_staging:  # one tensor: the one-tensor face's check and advice
            return super()._check_staging(program)
        check_stage_need(self.plan, self.order, program.device, self.entry.stage_need(program), backend=self.entry.name)

    def run(self, shards: Mapping[str, Any] | None = None, into: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Reshard every tensor once: this rank's source shards by name in, its destination shards by name out
        (`into`: the tensors to write them in, `start`)."""
        self._start(shards, into, "run()")
        return self.wait()

    def start(self, shards: Mapping[str, Any] | None = None, into: Mapping[str, Any] | None = None) -> None:
        """Start every tensor's reshard and return at once; do not modify the shards until `wait()` returns. Every
        input is checked first, so a wrong one is refused before any tensor moves. `into`: name -> a tensor of this
        rank's destination shard's shape and dtype (a view into a larger tensor is fine, a slice of a fused parameter)
        that the reshard writes in place (`executor.destinations`), kept only until `wait()` returns; the tensors not
        named land in the engine's own buffers."""
        self._start(shards, into, "start()")

    def _start(self, shards, into, call: str) -> None:
        """start() for `call`, the call that was made (its name in a refusal)."""
        try:
            given = self._sources(shards)
            self._startable()
            targets = self._targets(into, call)
            if self.one:
                source = self._adopt(0, given.get(self.names[0]), call)
            else:
                source = [self._adopt(t, given.get(name), call) for t, name in enumerate(self.names)]
            self._apart(targets, [source] if self.one else source)
        except PlanMismatchError as err:
            raise named_call(err, call) from None
        if not targets:
            self.flight.start(source)
            return
        dsts = [targets.get(name) for name in self.names]
        self.flight.start(source, dsts[0] if self.one else dsts)
        self.targets = targets

    def wait(self) -> dict[str, Any]:
        """Finish every tensor's reshard; name -> destination shard: the tensor passed in `into`, else the engine's own
        buffer, reused next time."""
        targets, self.targets = self.targets, {}
        self.flight.wait()
        engine = self.flight.engine
        if self.one:
            out = {} if engine.dst is None else {self.names[0]: engine.dst}
        else:
            out = {name: shard for name, shard in zip(self.names, engine.dsts) if shard is not None}
        out.update(targets)
        return out

    def _targets(self, into: Mapping[str, Any] | None, call: str) -> dict[str, Any]:
        """The caller's destination tensors by name, each checked (`Executor._into`); unknown names refused."""
        if into is None:
            return {}
        if not isinstance(into, Mapping):
            raise PlanMismatchError(f"run(): into is a {type(into).__name__}; pass a mapping of tensor name to the tensor its "
                                    f"destination shard is written in, e.g. {{{self.names[0]!r}: tensor}}")
        unknown = sorted(into.keys() - self.index.keys())
        if unknown:
            raise PlanMismatchError(f"run(): into names {unknown[0]!r}, not a tensor of this plan; name tensors as in the "
                                    f"problem ({', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''})")
        return {name: self._into(self.index[name], array, call) for name, array in into.items() if array is not None}

    def _sources(self, shards: Mapping[str, Any] | None) -> dict[str, Any]:
        """The shards by name, refusing unknown names and, on a source rank, missing ones."""
        if shards is not None and not isinstance(shards, Mapping):
            raise PlanMismatchError(f"run(): shards is a {type(shards).__name__}; pass a mapping of tensor name to this rank's "
                                    f"source shard, e.g. {{{self.names[0]!r}: shard}} (None or {{}} on a rank with no source shard)")
        shards = shards or {}
        unknown = sorted(shards.keys() - self.index.keys())
        if unknown:
            raise PlanMismatchError(f"run(): {unknown[0]!r} is not a tensor of this plan; pass shards named as in the "
                                    f"problem ({', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''})")
        if self.flight.engine is not None:  # src_shapes: the shards the caller passes (none of a plan's FP8 scales)
            missing = [n for n, shape in zip(self.names, self.src_shapes) if n not in shards and shape is not None]
            if missing:
                raise PlanMismatchError(f"run(): device {self.device} is in the source mesh; pass its shard of "
                                        f"{missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
        return shards
