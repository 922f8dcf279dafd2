"""A host that sends and receives does both at once (issue 11, section 4).

NICs are full duplex and links inside a host are per-device ports, so where meshes share a host, a
task into that host and a task out of it may overlap. The property compares every compiled plan
over random problems with shared hosts against a duplex list schedule computed here, from the
operations' own hops (cross-host: the two NIC sides; inside a host: the two device ports): the plan
must not be slower than what that schedule shows a duplex network allows.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xmesh_plan.planner.compile import TaskOptions, compile_plan, task_options
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.strategies import PlannedOp
from xmesh_plan.planner.unit_tasks import decompose
from xmesh_plan.schemas import Cluster, ReshardingProblem
from tests.support.strategies import SETTINGS, spec_for

REL_TOLERANCE = 0.01  # the simulator may differ from the cost model by a hair (seen: 0.06% on a ring); the old model lost up to 2x
ABS_TOLERANCE_S = 1e-11  # plans round times to picoseconds
# global_allgather (and auto, which picks it) is left out: its cost model and the simulator disagree
# on a ring across hosts even for a single task, which is no matter of duplex
DUPLEX_STRATEGIES = ("broadcast", "send_recv", "local_allgather")


def op_hops(op: PlannedOp) -> list[tuple[int, int]]:
    """The (from, to) device pairs an operation's messages cross."""
    if op.kind == "allgather":
        return [(a, op.dsts[(i + 1) % len(op.dsts)]) for i, a in enumerate(op.dsts)]
    if op.kind == "broadcast":
        chain = (op.src, *op.dsts)
        return list(zip(chain, chain[1:]))
    return [(op.src, d) for d in op.dsts]


def duplex_links(ops: tuple[PlannedOp, ...], cluster: Cluster) -> set[str]:
    """Links in the simulator's names: `h1.send`, `h2.recv` across hosts, `d5.out`, `d6.in` inside one."""
    host = cluster.host_of
    links: set[str] = set()
    for op in ops:
        for a, b in op_hops(op):
            links |= {f"h{host(a)}.send", f"h{host(b)}.recv"} if host(a) != host(b) else {f"d{a}.out", f"d{b}.in"}
    return links


def earliest_gap(busy: dict[str, list[tuple[float, float]]], links: set[str], duration: float) -> float:
    """The earliest time from which every link is free for `duration` (0, or when some busy spell ends)."""
    candidates = sorted({0.0} | {e for link in links for _, e in busy.get(link, [])})
    return next(t for t in candidates
                if all(e <= t or t + duration <= s for link in links for s, e in busy.get(link, [])))


def duplex_list_schedule(problem: ReshardingProblem, items: list[TaskOptions]) -> float:
    """Makespan of longest-first list scheduling with backfilling: each task from the sender that
    finishes first, in the earliest gap where all its links are free; each link carries one task at a
    time. Local copies run from time 0 on their own copy engines."""
    busy: dict[str, list[tuple[float, float]]] = {}
    ends = [0.0]
    for item in sorted(items, key=lambda i: (-max(o.duration_s for o in i.scheduling.options), i.scheduling.id)):
        best = None
        for (_, result), option in zip(item.results, item.scheduling.options):
            links = duplex_links(result.ops, problem.cluster)
            begin = earliest_gap(busy, links, option.duration_s)
            if best is None or begin + option.duration_s < best[0]:
                best = (begin + option.duration_s, begin, links)
        end, begin, links = best
        for link in links:
            busy.setdefault(link, []).append((begin, end))
        ends.append(end)
    copies = [c.nbytes(problem.itemsize) / problem.cluster.intra_bytes_per_s for c in decompose(problem) if c.local_copies]
    return max(ends + copies)


@st.composite
def shared_host_problems(draw) -> ReshardingProblem:
    """Two host-by-device meshes whose host ranges overlap (the destination starts inside the
    source's range and may run past it), one NIC per host, tensors large enough that bytes, not latency,
    set the times."""
    per_host = draw(st.integers(1, 4))
    src = [draw(st.integers(2, 3)), draw(st.integers(1, per_host))]
    dst = [draw(st.integers(1, 3)), draw(st.integers(1, per_host))]
    rank = draw(st.integers(1, 2))
    shape = [draw(st.sampled_from([12, 60, 240, 960])) for _ in range(rank)]
    nic = {"send_gbps": draw(st.sampled_from([1.0, 10.0])), "recv_gbps": draw(st.sampled_from([1.0, 10.0]))}
    cluster = {"devices_per_host": per_host, "nics": [nic], "latency_us": draw(st.sampled_from([0.0, 5.0])),
               "intra_host_gbps": draw(st.sampled_from([80.0, 800.0]))}
    return build_problem({
        "shape": shape, "dtype": draw(st.sampled_from(["float32", "complex128"])), "cluster": cluster,
        "src": {"mesh": src, "spec": draw(spec_for(rank, 2))},
        "dst": {"mesh": {"shape": dst, "first_host": draw(st.integers(1, src[0] - 1))}, "spec": draw(spec_for(rank, 2))}})


@settings(max_examples=150, **SETTINGS)
@given(shared_host_problems(), st.sampled_from(DUPLEX_STRATEGIES))
def test_plans_on_shared_hosts_are_no_slower_than_a_duplex_list_schedule(problem, strategy):
    """One NIC per host: with several, the simulator stripes a message over NICs the planner's cost
    model treats as one, a difference that has nothing to do with duplex (see the report)."""
    plan = compile_plan(problem, strategy=strategy)
    duplex = duplex_list_schedule(problem, task_options(problem, decompose(problem), strategy))
    assert plan.predicted_seconds <= duplex * (1 + REL_TOLERANCE) + ABS_TOLERANCE_S, (plan.predicted_seconds, duplex)


def test_a_shared_host_receives_while_it_sends(problem):
    """2x4 on hosts 0-1 -> 2x4 on hosts 1-2: host 0 sends to hosts 1 and 2, host 1 sends to host 2;
    host 1's receive and send overlap, and the plan meets its schedule's lower bound."""
    cluster = {"devices_per_host": 4, "nics": [{"send_gbps": 100, "recv_gbps": 100}], "intra_host_gbps": 800, "latency_us": 20}
    shared = problem((4096, 4096), "2x4", "S0 R", {"shape": [2, 4], "first_host": 1}, "R S0", cluster=cluster)
    plan = compile_plan(shared, strategy="broadcast")
    into = [t for t in plan.tasks if 1 in t.receiver_hosts]
    out_of = [t for t in plan.tasks if t.sender_host == 1]
    assert into and out_of
    assert any(a.start_s < b.end_s and b.start_s < a.end_s for a in into for b in out_of)
    assert float(plan.solver.details["gap_to_proven_bound"]) == 0.0
    assert plan.predicted_seconds < 1.2 * plan.lower_bound_seconds
