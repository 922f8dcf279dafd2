"""The event-driven flow engine (`simulate.run_flows`: rates re-shared only over the links an event touches, finish
times in a heap) against the reference engine that steps every moving flow at every event
(`tests.support.reference_flows`): on random flow graphs and on compiled plans, in every discipline, with the
shared-CPU model, a send buffer and the emulated cluster's first-come rule, the two agree on every time to
rounding, and count the same work (`SimResult.work`, which decides whether a plan's executor order is timed).
(On plans of 10^4 operations and more, device order can differ by 1e-6 or more: two messages ready at one instant
take a connection in the order rounding puts them, in either engine; bench/bench_simulate.py shows it.)"""

from __future__ import annotations

import random

import pytest

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import DISCIPLINES, Flow, max_min_rates, nic_assignment, run_flows, simulate, staging_runs
from xmesh_plan.schemas import Cpu

from tests.support import reference_flows
from tests.support.cases import random_problem
from tests.support.reference_flows import reference_simulate
from tests.support.transfer import random_transfer

REL = 1e-11  # the engines add each flow's progress in different steps: times agree to rounding, not bit for bit
WINDOW = 256  # bytes of staging per device in the `window` discipline: small enough that operations wait on these plans


def random_flows(seed: int) -> tuple[list[Flow], dict[str, float]]:
    """Flows over a few links with random sizes, latencies, dependencies (arrival and left), connections and buffers."""
    rng = random.Random(seed)
    links = [f"l{k}" for k in range(rng.randint(1, 6))]
    capacity = {link: rng.choice([1.0, 2.0, 0.5, 3.0]) for link in links}
    flows = []
    for i in range(rng.randint(1, 60)):
        earlier = list(range(i))
        nbytes = rng.choice([0.0, 1.0, 2.0, 0.25, rng.uniform(0.01, 5.0)])
        on = tuple(sorted(rng.sample(links, rng.randint(0, min(3, len(links))))))
        after = tuple(sorted(rng.sample(earlier, min(len(earlier), rng.choice([0, 0, 1, 2])))))
        after_sent = tuple(sorted(rng.sample(earlier, min(len(earlier), rng.choice([0, 0, 1])))))
        flows.append(Flow(i, i // 3, nbytes, rng.choice([0.0, 0.0, 0.5, 1e-3]), on, after, after_sent,
                          overhead=rng.choice([0.0, 0.1]), queue=rng.choice(["", "", "a", "b"]),
                          sent_below=rng.choice([0.0, 0.0, 0.5, nbytes])))
    return flows, capacity


def same_times(new: dict, old: dict) -> None:
    assert new.keys() == old.keys()
    for key in old:
        assert new[key] == pytest.approx(old[key], rel=REL, abs=1e-15), key


@pytest.mark.parametrize("seed", range(200))
def test_random_flow_graphs_time_as_the_reference_engine(seed):
    flows, capacity = random_flows(seed)
    new_cost, old_cost = [], []
    new = run_flows(flows, capacity, cost=new_cost)
    old = reference_flows.run_flows(flows, capacity, cost=old_cost)
    same_times({i: s for i, (s, _) in new.items()}, {i: s for i, (s, _) in old.items()})
    same_times({i: e for i, (_, e) in new.items()}, {i: e for i, (_, e) in old.items()})
    assert new_cost == old_cost


def same_result(new, old) -> None:
    same_times(new.op_start_s, old.op_start_s)
    same_times(new.op_end_s, old.op_end_s)
    assert new.makespan_s == pytest.approx(old.makespan_s, rel=REL, abs=1e-15)
    assert (new.flows, new.work) == (old.flows, old.work)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("discipline", DISCIPLINES)
def test_compiled_plans_time_as_the_reference_engine(seed, discipline):
    """Random single- and multi-tensor plans (broadcasts, all-gathers, shared messages, striped NICs)."""
    for problem in (random_problem(seed, max_devices=12, exact=False), random_transfer(seed, 12)):
        plan = compile_plan(problem, solver="greedy")
        args = (plan.operations, plan.problem, discipline, nic_assignment(plan.host_order))
        runs = staging_runs(plan) if discipline == "device-order" else None
        window = WINDOW if discipline == "window" else None
        same_result(simulate(*args, run_numbers=runs, window_bytes=window),
                    reference_simulate(*args, run_numbers=runs, window_bytes=window))


@pytest.mark.parametrize("seed", range(6))
def test_the_cpu_model_and_a_send_buffer_time_as_the_reference_engine(seed):
    problem = random_problem(seed, max_devices=12, exact=False)
    problem = problem.model_copy(update={"cluster": problem.cluster.model_copy(update={"cpu": Cpu(cores=2, copy_gbps=8)})})
    plan = compile_plan(problem, solver="greedy")
    for discipline in DISCIPLINES:
        window = WINDOW if discipline == "window" else None
        same_result(simulate(plan.operations, problem, discipline, window_bytes=window),
                    reference_simulate(plan.operations, problem, discipline, window_bytes=window))
    buffer = problem.nbytes / 7
    same_result(simulate(plan.operations, problem, "device-order", send_buffer_bytes=buffer),
                reference_simulate(plan.operations, problem, "device-order", send_buffer_bytes=buffer))


@pytest.mark.parametrize("seed", range(6))
def test_a_share_rule_is_asked_as_the_reference_engine_asks_it(seed):
    """`FirstCome` remembers when it first saw each flow: the engines must call it as often, with the same flows in the same order."""
    from bench.netlab.first_come import FirstCome

    plan = compile_plan(random_transfer(seed, 12), solver="greedy")
    asked = {}
    for name, engine in (("new", simulate), ("old", reference_simulate)):
        rule, calls = FirstCome(("send",), small=2**12), []

        def share(active, capacity, rule=rule, calls=calls):
            calls.append([f.id for f in active])
            return rule(active, capacity)

        asked[name] = (engine(plan.operations, plan.problem, "device-order", share=share), calls)
    same_result(asked["new"][0], asked["old"][0])
    assert asked["new"][1] == asked["old"][1]


def test_work_counts_the_flows_an_event_re_rates_not_every_moving_one():
    """A long flow on its own link moves through ten short ones that follow each other on another: their events
    share out only their own link's rates, so the long one adds its own start (its group and its rate) and nothing more."""
    short = [Flow(i, i, 1.0, 0.0, ("b",), (i - 1,) if i > 1 else ()) for i in range(1, 11)]
    long = Flow(0, 0, 1000.0, 0.0, ("a",))
    capacity = {"a": 1.0, "b": 1.0}
    for engine in (run_flows, reference_flows.run_flows):
        alone, together = [], []
        engine(short, capacity, cost=alone)
        engine([long, *short], capacity, cost=together)
        assert together[0] == alone[0] + 2 == 22


def test_flows_on_the_same_links_cost_as_one_group_while_their_rate_holds():
    """A hundred flows between the same two NIC sides (as a posted weight sync has) held by side a, while ten short
    ones follow each other on side b: each short one's events share rates out over two groups and re-rate one flow,
    not the hundred (1,111 flows re-shared counted flow by flow)."""
    many = [Flow(i, 0, 1000.0, 0.0, ("a", "b")) for i in range(100)]
    short = [Flow(100 + i, 1 + i, 1.0, 0.0, ("b",), (99 + i,) if i else ()) for i in range(10)]
    capacity = {"a": 1.0, "b": 100.0}
    for engine in (run_flows, reference_flows.run_flows):
        cost = []
        spans = engine([*many, *short], capacity, cost=cost)
        assert spans[0][1] == pytest.approx(100_000.0)  # the hundred share side a throughout
        # start: 2 groups + 101 new rates; 9 short ones: 2 groups + 1 rate each; the last one's end: 1 group, no new rate
        assert cost == [103 + 9 * 3 + 1]


@pytest.mark.parametrize("seed", range(100))
def test_rates_shared_out_by_groups_are_max_min_fair_flow_by_flow(seed):
    """`max_min_rates` fills groups of flows on the same links (`group_rates`); plain water-filling flow by flow gives
    every flow the same rate, on random flows where many share their links."""
    rng = random.Random(seed)
    links = [f"l{k}" for k in range(rng.randint(1, 6))]
    capacity = {link: rng.choice([1.0, 2.0, 0.5, 3.0, rng.uniform(0.1, 9.0)]) for link in links}
    flows = [Flow(i, i, 1.0, 0.0, tuple(sorted(rng.sample(links, rng.randint(1, min(3, len(links)))))))
             for i in range(rng.randint(1, 80))]
    fair = max_min_rates(flows, capacity)
    plain = reference_flows.water_filling(flows, capacity)
    assert fair.keys() == plain.keys() == {f.id for f in flows}
    for fid, rate in plain.items():
        assert fair[fid] == rate, fid  # the same subtractions in the same order: equal, not close


def test_rates_of_takes_the_last_rates_again_only_for_the_same_groups_with_the_same_flows():
    """`_Moving.rates_of`: where the groups linked to an event are those last shared out together, with as many flows
    each (a flow left a group as another joined it), it answers the rates then, which are `group_rates`' answer; a
    group with another number of flows, or another set of groups, is shared out again."""
    from xmesh_plan.planner.simulate import _Moving, group_rates

    capacity = {"a": 3.0, "b": 5.0, "c": 7.0}
    flows = [Flow(i, 0, 1.0, 0.0, links) for i, links in enumerate([("a", "b"), ("a", "b"), ("b", "c"), ("a", "b"), ("b", "c")])]
    moving = _Moving(flows, set(), set())
    for i in (0, 1, 2):
        moving.start(i, 0.0)
    groups = [("a", "b"), ("b", "c")]
    first = moving.rates_of(groups, capacity)
    assert first == group_rates(groups, moving.members, capacity)
    moving.stop(0)
    moving.start(3, 0.0)  # one flow out of ("a", "b"), one in: the same counts
    assert moving.rates_of(list(reversed(groups)), capacity) is first
    moving.start(4, 0.0)  # ("b", "c") has two flows now
    again = moving.rates_of(groups, capacity)
    assert again is not first and again == group_rates(groups, moving.members, capacity) != first
    assert moving.rates_of([("a", "b")], capacity) == group_rates([("a", "b")], moving.members, capacity)
