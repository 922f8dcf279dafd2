"""A multi-tensor plan timed in the order the executor runs it by default, for the plan to state.

A plan's operations carry host-order times (each NIC side in the plan's order: the planner's own
claim, what `check` re-derives), but `TransferExecutor` runs a multi-tensor plan posted on MPI (every
message at once, links shared; `executor.transfer_executor.default_order`), and a plan can be much
slower so (the chained Llama-3-8B weight-sync plan: 1.08x its bound in host order, 1.45x posted). So `compile`
also times the plan posted and records it (`Plan.executor_prediction`); `check` recomputes it.
Single-tensor plans run in device order, which their host order is scheduled for: nothing is added.

Posted simulation can cost far more than host order's (every message in flight at once, each re-rated
as others start and finish), so it is run only where cheap: within
POSTED_WORK_FACTOR times the host-order simulation's work, or MIN_POSTED_WORK (`SimResult.work`, counted in groups and flows, not
seconds, so whether a plan states the time does not change with machine load). A listing too long to simulate in host order
(`compile.MAX_SIMULATED_MESSAGES`) keeps the schedule's times for its operations, and is simulated once in the executor's order
alone, up to MAX_EXECUTOR_MESSAGES messages and EXECUTOR_WORK units of work (`unsimulated_budget`): the time a plan states for the
executor always comes from the simulator.
"""

from __future__ import annotations

from xmesh_plan.schemas import HostOrder, Operation, ReshardingProblem
from xmesh_plan.schemas.plan_tensors import mpi_transfer_order
from xmesh_plan.schemas.transfer import TransferProblem

from .simulate import TooCostly, nic_assignment, simulate

SIMULATED_AS = {"posted": "posted", "device": "device-order"}  # executor order -> the simulator's discipline (posted within a
# plan's staging limit: "window")
POSTED_WORK_FACTOR = 2.0  # posted is timed when it costs at most this many times the host-order simulation (a DeepSeek-V3-like
# 2-layer cut: 1.64 M posted against 0.99 M in host order, 20 against 13 CPU s; a 4-layer one in proportion)
MIN_POSTED_WORK = 2_000_000  # ... or this much work (`simulate.run_flows`: groups shared out and flows re-rated; a few seconds),
# whichever is more
MAX_EXECUTOR_MESSAGES = 400_000  # a listing too long to simulate in host order (`compile.too_many_messages`) is still simulated
# once, in the executor's order, up to this many messages (`compile.simulated_messages`), so the time a plan states for the executor
# comes from the simulator: the full DeepSeek-V3-like plan (390,400 messages) and the Kimi-K2-like one (315,632) fit. One posted
# simulation in their compiles here (bench_frontier --one, 4eb1f01 and 4fd4f6e): 25.9 CPU s and +80 MiB over the 995 MiB the compile
# held before it (DeepSeek-V3-like), 29.7 CPU s and +80 MiB over 1,111 MiB (Kimi-K2-like): 66-94 us a message, where host order's
# listing settle would take at least two simulations more
EXECUTOR_WORK = 6_000_000  # ... taking at most this much work (`SimResult.work`); past it the plan states no executor-order time.
# Posted, the full DeepSeek-V3-like plan takes 2.05 M (5.3 a message), the Kimi-K2-like one 4.69 M (14.9 a message)


def posted_budget(host_order_work: int) -> int:
    """The most work (`SimResult.work`) the posted simulation may take, given the host-order simulation's."""
    return max(int(POSTED_WORK_FACTOR * host_order_work), MIN_POSTED_WORK)


def unsimulated_budget(messages: int) -> int | None:
    """The most work the simulation in the executor's order may take for a listing of `messages` messages
    (`compile.simulated_messages`) too long to simulate in host order (`compile.too_many_messages`): EXECUTOR_WORK up to
    MAX_EXECUTOR_MESSAGES, else None (not simulated: decided before any flow is made). `compile` and `check` decide by it alike."""
    return EXECUTOR_WORK if messages <= MAX_EXECUTOR_MESSAGES else None


executor_order = mpi_transfer_order  # the order `TransferExecutor` runs a multi-tensor plan in on MPI by default


def order_name(plan, order: str) -> str:
    """`order` as messages name it: posted is `posted within the staging limit` where the plan states one (`executor.window`)."""
    return f"{order} within the staging limit" if order == "posted" and plan.staging is not None else order


def executor_order_seconds(operations: tuple[Operation, ...], problem: ReshardingProblem | TransferProblem,
                           host_order: tuple[HostOrder, ...], max_work: int | None = None,
                           limit_bytes: int | None = None) -> float | None:
    """The simulator's time for `operations`, in their listed order, run in `executor_order()`, within a staging
    window of `limit_bytes` per device where the plan states that limit (the `window` discipline, as
    `executor.window` runs it); None for a single-tensor problem (nothing to state) or when the simulation would
    take more than `max_work` (see `posted_budget`)."""
    if not isinstance(problem, TransferProblem):
        return None
    try:
        if limit_bytes is not None:
            return simulate(operations, problem, "window", nic_assignment(host_order), max_work=max_work,
                            window_bytes=limit_bytes).makespan_s
        return simulate(operations, problem, SIMULATED_AS[executor_order()], nic_assignment(host_order),
                        max_work=max_work).makespan_s
    except TooCostly:
        return None
