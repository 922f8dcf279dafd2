"""Baselines at frontier scale, from their bytes over the links they use, where simulating every message is too costly.

A weight sync of 700-1150 tensors over 64-384 GPUs gives the broadcast baselines (`planner/baselines.py`) millions of
chunk messages, so their rows in the frontier benchmark are not simulated. `baseline_estimate` gives instead the
least time the simulator's model (`planner/simulate.py`) allows a baseline's operation list, from two facts of that
model that hold in every order:
- links: each link carries its bytes at most at its bandwidth: a host's NIC send and receive sides (all NICs
  together) for a message between hosts, a device's outgoing and incoming ports (intra-host bandwidth) for one
  inside a host, a device's copy engine for a local copy;
- devices: in device order (the order the RL frameworks' loops and the executor's default single-tensor order run),
  a device takes part in one operation at a time, and each operation holds it at least as long as its own
  messages take alone (a message between hosts striped over every NIC, one inside a host at the intra-host rate;
  a chain's relay receives and forwards at once, so the longer of the two); a sender is held only by messages of
  at least `SYNC_SEND_BYTES` (a smaller one is buffered and ends once posted), a receiver by every message.
The estimate is the larger of the busiest link's and the busiest device's total, so it leaves out latencies,
per-message overheads, pipeline fill and waiting for a peer: it is at most the simulated time (tested), i.e. it
favours the baseline. Tensors of one kind (`compile._kinds`: shape, dtypes, both layouts) put the same bytes on the
same links and devices, so each kind's operations are made once and its loads counted once per tensor.

`per_tensor_plans_seconds` is the third frontier baseline: our own plan of each tensor alone, one after another (a
loop calling `redistribute` per parameter). Tensors of one kind have the same plan, so one per kind is compiled and
simulated in device order (the executor's order for a single-tensor plan), and its time counted once per tensor.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xmesh_plan.schemas import Operation, ReshardingProblem
from xmesh_plan.schemas.geometry import region_size
from xmesh_plan.schemas.op_kinds import wire_pairs
from xmesh_plan.schemas.staging import SYNC_SEND_BYTES
from xmesh_plan.schemas.transfer import tensor_problems

from .baselines import BASELINES
from .bounds import LowerBound, joint_lower_bound


@dataclass(frozen=True)
class Loads:
    """Seconds of work per link (`h2.send`, `h2.recv`, `d8.out`, `d8.in`, `d8.copy`) and per device."""

    links: dict[str, float]
    devices: dict[int, float]

    def seconds(self) -> float:
        return max([0.0, *self.links.values(), *self.devices.values()])

    def busiest(self) -> str:
        """The link or device that sets `seconds`, e.g. `d64.in`, `device 0`."""
        named = [(s, k) for k, s in self.links.items()] + [(s, f"device {d}") for d, s in self.devices.items()]
        return max(named, default=(0.0, "nothing moves"))[1]


def operation_loads(ops: list[Operation], problem: ReshardingProblem, times: int = 1) -> Loads:
    """`times` x the link and device loads of one tensor's operations (sends, chain broadcasts, local copies: every
    pair an operation crosses carries its whole box)."""
    cluster, host = problem.cluster, problem.cluster.host_of
    links: Counter = Counter()
    devices: Counter = Counter()
    for op in ops:
        nbytes = region_size(op.region) * problem.itemsize * times
        held = region_size(op.region) * problem.itemsize / (op.chunks or 1) >= SYNC_SEND_BYTES  # else a send is buffered
        if op.kind == "copy":
            links[f"d{op.src}.copy"] += nbytes / cluster.intra_bytes_per_s
            devices[op.src] += nbytes / cluster.intra_bytes_per_s
            continue
        into: Counter = Counter()
        out: Counter = Counter()
        for a, b in wire_pairs(op):
            if host(a) != host(b):
                links[f"h{host(a)}.send"] += nbytes / cluster.send_bytes_per_s
                links[f"h{host(b)}.recv"] += nbytes / cluster.recv_bytes_per_s
                alone = nbytes / cluster.message_bytes_per_s
            else:
                links[f"d{a}.out"] += nbytes / cluster.intra_bytes_per_s
                links[f"d{b}.in"] += nbytes / cluster.intra_bytes_per_s
                alone = nbytes / cluster.intra_bytes_per_s
            out[a] += alone if held else 0.0
            into[b] += alone
        for d in into.keys() | out.keys():
            devices[d] += max(into[d], out[d])
    return Loads(dict(links), dict(devices))


def _by_kind(problem) -> list[tuple[int, ReshardingProblem, int]]:
    """(position of the first tensor of each kind, that tensor's problem, how many tensors have its kind)."""
    from .compile import _kinds

    singles = tensor_problems(problem)
    keys = _kinds(singles)
    counts = Counter(keys)
    first: dict[tuple, int] = {}
    for i, kind in enumerate(keys):
        first.setdefault(kind, i)
    return [(i, singles[i], counts[kind]) for kind, i in first.items()]


@dataclass(frozen=True)
class Estimate:
    """A baseline's least time in the model and what sets it (module docstring)."""

    name: str
    seconds: float
    busiest: str


def baseline_estimate(problem, name: str) -> Estimate:
    """Baseline `name`'s least time on a problem of one or many tensors, from its bytes over links and devices."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of: {', '.join(BASELINES)}")
    links: Counter = Counter()
    devices: Counter = Counter()
    for _, single, count in _by_kind(problem):
        loads = operation_loads(BASELINES[name](single), single, count)
        links.update(loads.links)
        devices.update(loads.devices)
    total = Loads(dict(links), dict(devices))
    return Estimate(name, total.seconds(), total.busiest())


def problem_bound(problem) -> LowerBound:
    """The byte bound of the whole problem (`bounds.joint_lower_bound`, what a compile states), from each kind's cells
    counted once per tensor of the kind: no plan is compiled, so it holds for a problem too large to compile here."""
    from .unit_tasks import decompose

    return joint_lower_bound([(cells, single.itemsize) for _, single, count in _by_kind(problem)
                              for cells in [decompose(single, max_tasks=None)] * count], problem.cluster)


@dataclass(frozen=True)
class PerTensorPlans:
    """Our plan per tensor, back to back: the total, and per kind (a tensor's name, how many, one plan's seconds)."""

    seconds: float
    kinds: tuple[tuple[str, int, float], ...]


def per_tensor_plans_seconds(problem, **compile_settings) -> PerTensorPlans:
    """Our plan of each tensor alone, one after another: one plan per kind compiled (default flags, or
    `compile_settings`) and simulated in device order, times the tensors of its kind; each kind named by its first tensor."""
    from .compile import compile_plan
    from .simulate import simulate

    names = getattr(problem, "names", None)
    kinds = []
    for i, single, count in _by_kind(problem):
        plan = compile_plan(single, **compile_settings)
        kinds.append((names[i] if names else f"tensor {i}", count, simulate(plan.operations, single, "device-order").makespan_s))
    return PerTensorPlans(sum(count * seconds for _, count, seconds in kinds), tuple(kinds))
