"""What the model predicts for a plan on the testbed: the plan's cluster with every NIC at the link rate.

Three ways to queue the same operations (the simulator's flows, fluid max-min sharing, except where `TESTBED_SHARING` says):
- `host-order`: each NIC side works through its operations one at a time in plan order (the plan's claim);
- `device-order`: each device does its operations in turn (how Alpa's baselines are priced);
- `posted`: every operation starts as soon as its data is there and all running transfers share
  the links, which is what the executor does (it posts every send and receive at once and TCP
  shares the links).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from xmesh_plan.planner.bounds import joint_lower_bound
from xmesh_plan.planner.simulate import ShareRule, SimResult, nic_assignment, simulate, staging_runs
from xmesh_plan.planner.unit_tasks import decompose
from xmesh_plan.schemas import Cluster, Cpu, Nic, Plan, ReshardingProblem
from xmesh_plan.schemas.transfer import tensor_problems

from .first_come import FirstCome


# The shared CPU of the 2-core testbed machine (docs/netlab.md, "What one message costs"): copy_gbps fitted on its
# device-order runs at 200 and 500 Mbit/s (3 GB/s of shared-memory traffic per core and end: the executor's
# pack or unpack plus MPI's copy, with idle ranks polling); no per-message CPU inside a host (the runs cannot tell).
TESTBED_CPU = Cpu(cores=2, copy_gbps=24, message_us=0)

# How the testbed's links share bandwidth, per queueing (a fresh rule per simulation; absent: max-min). In device order a
# host's ranks start their messages a few ms apart and TCP serves the short ones first come (`first_come.py`); a message
# of more than TESTBED_SHORT_MS at its link's rate shares max-min. In posted order every message starts at once and the
# links share max-min (docs/netlab.md, "How TCP shares a link": the threshold is fitted on one set of runs and checked on
# runs made after it was set).
TESTBED_SHORT_MS = 25.0
TESTBED_SHARING: Mapping[str, Callable[[], ShareRule]] = MappingProxyType({
    "device-order": lambda: FirstCome(("send",), short_s=TESTBED_SHORT_MS / 1e3),
})
QUEUEINGS = ("host-order", "device-order", "posted")


def at_rate(problem: ReshardingProblem, rate_mbit: float, latency_us: float | None = None,
            overhead_us: float | None = None, cpu: Cpu | None = None) -> ReshardingProblem:
    """The same problem on a cluster whose every NIC sends and receives at `rate_mbit` (and whose messages each
    take `latency_us` and `overhead_us`, when given: on the testbed a message costs what a rank's Python and the kernel add;
    and whose ranks share `cpu`, when given: `Cluster.cpu`)."""
    gbps = rate_mbit / 1e3
    update = {"nics": tuple(Nic(send_gbps=gbps, recv_gbps=gbps) for _ in problem.cluster.nics)}
    if latency_us is not None:
        update["latency_us"] = latency_us
    if overhead_us is not None:
        update["overhead_us"] = overhead_us
    if cpu is not None:
        update["cpu"] = cpu
    cluster = Cluster.model_validate({**problem.cluster.model_dump(), **update})  # the range checks apply
    return problem.model_copy(update={"cluster": cluster})


def testbed_problem(plan: Plan, rate_mbit: float, cpu: Cpu | None = None) -> ReshardingProblem:
    """The plan's problem on the testbed's links, priced with `cpu` when given and on links alone otherwise (a plan made
    with the CPU model, `experiments --plan-cpu`, carries one)."""
    problem = at_rate(plan.problem, rate_mbit, cpu=cpu)
    if cpu is None and problem.cluster.cpu is not None:
        problem = problem.model_copy(update={"cluster": problem.cluster.model_copy(update={"cpu": None})})
    return problem


def simulated(plan: Plan, problem: ReshardingProblem, queueing: str,
              sharing: Mapping[str, Callable[[], ShareRule]] = TESTBED_SHARING, send_buffer_bytes: float | None = None) -> SimResult:
    """The plan's operations on `problem` (`testbed_problem`) under one queueing: host-order, device-order or posted,
    the links shared as `sharing` says for that queueing (max-min where it says nothing); `send_buffer_bytes`: when a
    send ends for its device (`planner.simulate.simulate`; None: as the MPI engine)."""
    extra = {"host-order": {"nic_of_task": nic_assignment(plan.host_order)}, "device-order": {"run_numbers": staging_runs(plan)},
             "posted": {}}[queueing]
    unknown = set(sharing) - set(QUEUEINGS)
    if unknown:
        raise ValueError(f"sharing names unknown queueings {sorted(unknown)}; use {', '.join(QUEUEINGS)}")
    rule = sharing.get(queueing)
    return simulate(plan.operations, problem, queueing, share=rule() if rule else None, send_buffer_bytes=send_buffer_bytes, **extra)


def predictions(plan: Plan, rate_mbit: float, cpu: Cpu | None = None,
                sharing: Mapping[str, Callable[[], ShareRule]] = TESTBED_SHARING, send_buffer_bytes: float | None = None
                ) -> dict[str, float]:
    """Seconds per reshard under each queueing, and the byte lower bound, on the testbed's links (and CPU, when given),
    shared as `sharing` says, sends ending as `send_buffer_bytes` says (`simulated`)."""
    problem = testbed_problem(plan, rate_mbit, cpu)
    return {
        **{queueing: simulated(plan, problem, queueing, sharing, send_buffer_bytes).makespan_s for queueing in QUEUEINGS},
        "lower-bound": joint_lower_bound([(decompose(t), t.itemsize) for t in tensor_problems(problem)], problem.cluster).seconds,
    }
