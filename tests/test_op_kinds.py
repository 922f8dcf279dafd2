"""The table of operation kinds (`schemas.op_kinds`) against the consumers that read it.

For random plans from the property generator, independent consumers must agree with the table: the
per-rank programs the executor lowers send and receive exactly the route's bytes per pair of devices
with the route's tags, the NCCL calls run on the table's groups, the simulator puts the route's bytes
on each link, `bytes_moved` and `inspect` count the same bytes, and the plan checker and verifier
accept an operation exactly when the table's facts allow it. A kind the consumers cannot handle
fails in one place, naming the consumer.
"""

from __future__ import annotations

import typing
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.support.cases import STRATEGIES, all_fixed_plans
from tests.support.builders import FAST_SOLVER
from tests.support.strategies import SETTINGS, problems
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.executor.run import bytes_moved
from xmesh_plan.planner.compile import _sender_per_host, compile_plan
from xmesh_plan.planner.inspect_plan import plan_loads
from xmesh_plan.planner.simulate import _Lowering, nic_assignment, pooled_nics
from xmesh_plan.planner.strategies import STRATEGIES as STRATEGY_FUNCTIONS, TaskContext, hop_resources
from xmesh_plan.planner.unit_tasks import decompose
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas import op_kinds, staging
from xmesh_plan.schemas.geometry import region_size
from xmesh_plan.schemas.op_kinds import (OP_KINDS, OpKindRule, chunk_bounds, members, nccl_group, pair_bytes, route, rule_of,
                                         tags_used, wire_pairs)
from xmesh_plan.schemas.plan import Operation, OpKind, Plan
from xmesh_plan.schemas.plan_check import PlanError, check_plan


def _plans(problem, strategy: str, chunks: int) -> Plan:
    """A compiled plan with every broadcast cut into up to `chunks` pieces (the planner picks 1 for tiny boxes)."""
    plan = compile_plan(problem, strategy=strategy, solver=FAST_SOLVER, seed=0)
    ops = tuple(op.model_copy(update={"chunks": min(chunks, region_size(op.region))}) if rule_of(op).chunked else op
                for op in plan.operations)
    return plan.model_copy(update={"operations": ops})


def _tag_bases(plan: Plan) -> dict[int, int]:
    bases, base = {}, 0
    for op in plan.operations:
        bases[op.id] = base
        base += tags_used(op)
    return bases


def test_the_op_kind_literal_is_the_table():
    assert typing.get_args(OpKind) == tuple(OP_KINDS)
    with pytest.raises(ValidationError):
        Operation(id=0, task=0, kind="scatter", src=0, dsts=(1,), region=((0, 1),))


def test_every_consumer_handles_every_row():
    op_kinds.check_support()  # the consumers imported above registered their handlers
    assert any(name == "executor.lower" for name, _, _ in op_kinds._CONSUMERS)


def test_a_kind_with_a_new_wire_pattern_fails_in_one_place_naming_the_consumer(monkeypatch):
    monkeypatch.setitem(OP_KINDS, "reduce", OpKindRule("tree", has_src=True, min_dsts=1, max_dsts=None, chunked=False, has_parts=False))
    with pytest.raises(NotImplementedError, match=r"schemas.op_kinds routes has no handler for operation pattern 'tree'"):
        op_kinds.check_support()
    monkeypatch.setitem(op_kinds._PATTERNS, "tree", op_kinds._PATTERNS["chain"])  # the table knows its route now
    with pytest.raises(NotImplementedError, match=r"schemas.staging has no handler for operation pattern 'tree'.*add one"):
        op_kinds.check_support()  # the staging table, imported by the lowering, registered first
    monkeypatch.setitem(staging._PATTERNS, "tree", staging._PATTERNS["chain"])
    with pytest.raises(NotImplementedError, match=r"executor.lower has no handler for operation pattern 'tree'.*add one"):
        op_kinds.check_support()


def test_a_kind_on_an_existing_pattern_lands_in_one_place(monkeypatch):
    """A `multicast` row (a chain like broadcast, never chunked) is all the consumers need."""
    monkeypatch.setitem(OP_KINDS, "multicast", OpKindRule("chain", has_src=True, min_dsts=1, max_dsts=None, chunked=False, has_parts=False))
    op_kinds.check_support()
    op = Operation.model_construct(id=0, task=0, kind="multicast", src=0, dsts=(1, 2), region=((0, 4),), parts=(), chunks=1,
                                   start_s=0.0, end_s=0.0)
    assert [(h.src, h.dst) for h in route(op)] == [(0, 1), (1, 2)] and tags_used(op) == 1
    assert pair_bytes(op, 2) == {(0, 1): 8, (1, 2): 8} and str(op).split()[5:8] == ["d0", "->", "d1,d2"]


def test_every_rule_is_consistent():
    for kind, rule in OP_KINDS.items():
        assert rule.pattern in op_kinds._PATTERNS, kind
        assert rule.max_dsts is None or rule.max_dsts >= rule.min_dsts >= 1, kind
        assert not (rule.pattern == "local" and not rule.has_src), kind
        assert not (rule.pattern == "ring" and rule.has_src), kind


def _lowered(plan: Plan):
    """Per op: bytes sent per (from, to), the (from, to, tag) of each message, each side's view, and the NCCL groups."""
    sent, recvd = defaultdict(lambda: defaultdict(int)), defaultdict(lambda: defaultdict(int))
    tags, groups = defaultdict(set), defaultdict(set)
    for device in plan_devices(plan):
        program = lower(plan, device)
        for s in program.steps:
            if s.action == "send":
                sent[s.op][(device, s.peer)] += s.data.nbytes
                tags[s.op].add((device, s.peer, s.tag, s.data.nbytes))
            elif s.action == "recv":
                recvd[s.op][(s.peer, device)] += s.data.nbytes
        for call in program.collectives:
            if call.group:  # a bundle's packs and unpacks have none
                groups[call.op].add((device, call.group))
    return sent, recvd, tags, groups


def _expected_messages(op: Operation, base: int, itemsize: int) -> set:
    """(from, to, tag, bytes) of each message on the wire: a chunk's bytes are its `chunk_bounds`, not the model's even share."""
    chunks = chunk_bounds(region_size(op.region), op.chunks)
    def wire_bytes(h):
        return (chunks[h.piece][1] - chunks[h.piece][0]) * itemsize if h.divisor > 1 else h.elements * itemsize
    return {(h.src, h.dst, base + h.tag, wire_bytes(h)) for h in route(op) if h.src != h.dst and h.elements}


def _check_lowering_follows_the_route(plan: Plan) -> None:
    sent, recvd, tags, groups = _lowered(plan)
    bases = _tag_bases(plan)
    for op in plan.operations:
        expected = pair_bytes(op, plan.problem.itemsize)
        assert dict(sent[op.id]) == expected, str(op)
        assert dict(recvd[op.id]) == expected, str(op)
        assert tags[op.id] == _expected_messages(op, bases[op.id], plan.problem.itemsize), str(op)
        if rule_of(op).pattern == "bundle":  # on NCCL each message of the route is a broadcast in a group of two
            pairs = {tuple(sorted((h.src, h.dst))) for h in route(op) if h.src != h.dst and h.elements}
            assert groups[op.id] == {(d, pair) for pair in pairs for d in pair}, str(op)
            continue
        group = nccl_group(op)
        assert {g for _, g in groups[op.id]} <= {group}, str(op)
        assert {d for d, _ in groups[op.id]} == set(members(op)), str(op)
    assert bytes_moved(plan) == sum(n for per_op in sent.values() for n in per_op.values())


@settings(max_examples=40, **SETTINGS)
@given(problems(), st.sampled_from(STRATEGIES), st.sampled_from([1, 3]))
def test_lowered_programs_send_the_tables_route(problem, strategy, chunks):
    _check_lowering_follows_the_route(_plans(problem, strategy, chunks))


def test_fixed_plans_lower_to_the_tables_route_all_gathers_round_a_ring():
    """The fixed plans have all-gathers of 3 and more members, where a ring and direct sends differ."""
    plans = all_fixed_plans()
    assert any(rule_of(op).pattern == "ring" and len(op.dsts) >= 3 for plan in plans for op in plan.operations)
    for plan in plans:
        _check_lowering_follows_the_route(plan)


def _link_bytes_from_table(plan: Plan, op: Operation) -> dict[str, float]:
    """What the stated link model puts on each link for the table's pairs (`planner.simulate` docstring)."""
    cluster, itemsize, host = plan.problem.cluster, plan.problem.itemsize, plan.problem.cluster.host_of
    out: dict[str, float] = defaultdict(float)
    if rule_of(op).pattern == "local":
        out[f"d{op.src}.copy"] += region_size(op.region) * itemsize
    nics = {t: n for t, n in nic_assignment(plan.host_order).items()}
    for (a, b), nbytes in pair_bytes(op, itemsize).items():
        if host(a) == host(b):
            out[f"d{a}.out"] += nbytes
            out[f"d{b}.in"] += nbytes
            continue
        if not nics and pooled_nics(cluster):  # alike NICs, none pinned: one pooled side per host
            out[f"h{host(a)}.send"] += nbytes
            out[f"h{host(b)}.recv"] += nbytes
            continue
        lanes = [nics[op.task]] if op.task in nics else range(len(cluster.nics))
        total = sum(min(cluster.nics[n].send_gbps, cluster.nics[n].recv_gbps) for n in lanes)
        for n in lanes:
            share = nbytes * min(cluster.nics[n].send_gbps, cluster.nics[n].recv_gbps) / total
            out[f"h{host(a)}.send:{n}"] += share
            out[f"h{host(b)}.recv:{n}"] += share
    return out


@settings(max_examples=40, **SETTINGS)
@given(problems(), st.sampled_from([64, 512, 4096]))
def test_coalesced_plans_lower_to_the_tables_route_and_the_simulator_puts_its_bytes_on_each_link(problem, bucket):
    plan = compile_plan(problem, solver=FAST_SOLVER, seed=0, coalesce=True, bucket_bytes=bucket)
    _check_lowering_follows_the_route(plan)
    _check_simulated_link_bytes(plan)


@settings(max_examples=30, **SETTINGS)
@given(problems(), st.sampled_from(STRATEGIES), st.sampled_from([1, 3]))
def test_the_simulator_puts_the_routes_bytes_on_each_link(problem, strategy, chunks):
    _check_simulated_link_bytes(_plans(problem, strategy, chunks))


def _check_simulated_link_bytes(plan: Plan) -> None:
    model = _Lowering(plan.problem, "host-order", nic_assignment(plan.host_order))
    for op in plan.operations:
        model.add(op)
    by_op: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for flow in model.flows:
        for link in flow.links:
            by_op[flow.op][link] += flow.nbytes
    for op in plan.operations:
        expected = {k: v for k, v in _link_bytes_from_table(plan, op).items() if v}
        got = {k: v for k, v in by_op[op.id].items() if v}
        assert got.keys() == expected.keys(), str(op)
        assert all(got[k] == pytest.approx(expected[k], rel=1e-12) for k in got), str(op)
        assert sum(f.op == op.id for f in model.flows) >= len(route(op)), str(op)


@settings(max_examples=30, **SETTINGS)
@given(problems())
def test_the_strategies_private_links_are_the_tables_wire_pairs(problem):
    """planner/strategies.py lists its operations' links itself (a fast path); they must be the table's."""
    for cell in decompose(problem):
        if not (cell.receivers and cell.senders):
            continue
        for _, device in sorted(_sender_per_host(cell, problem).items()):
            ctx = TaskContext(cell.region, cell.nbytes(problem.itemsize), device, cell.receivers, problem.cluster, problem.itemsize)
            for name, strategy in STRATEGY_FUNCTIONS.items():
                result = strategy(ctx)
                assert result.resources == hop_resources([p for op in result.ops for p in wire_pairs(op)], ctx.host), name


@settings(max_examples=20, **SETTINGS)
@given(problems(), st.sampled_from(STRATEGIES))
def test_inspect_counts_the_routes_cross_host_bytes(problem, strategy):
    plan = _plans(problem, strategy, 1)
    host = plan.problem.cluster.host_of
    cross = sum(n for op in plan.operations for (a, b), n in pair_bytes(op, plan.problem.itemsize).items() if host(a) != host(b))
    assert plan_loads(plan).cross_host_bytes == cross


def _table_allows(op: Operation, task_ids: set[int]) -> bool:
    """Whether the table's facts allow `op` (the rest of the plan and the boxes being fine)."""
    rule = OP_KINDS[op.kind]
    count_ok = len(op.dsts) >= rule.min_dsts and (rule.max_dsts is None or len(op.dsts) <= rule.max_dsts)
    where_ok = op.dsts == (op.src,) if rule.pattern == "local" else op.src not in op.dsts
    bundle_ok = (rule.pattern == "bundle") == bool(op.holders)  # a bundle needs holders and needers, which no other kind has
    return (rule.has_src == (op.src is not None) and count_ok and where_ok and (op.chunks == 1 or rule.chunked) and bundle_ok
            and bool(op.parts) == rule.has_parts and (op.task in task_ids or (op.task == -1 and rule.taskless)))


def _accepted(plan: Plan) -> bool:
    try:
        verify_plan(plan)
    except PlanError:
        return False
    return True


@settings(max_examples=30, **SETTINGS)
@given(problems(), st.sampled_from(STRATEGIES), st.data())
def test_checker_and_verifier_accept_exactly_what_the_table_allows(problem, strategy, data):
    """Each operation turned into every kind, and cut into chunks: accepted iff the table allows it.

    A kind change keeps the devices and boxes, so where the table allows it the plan still delivers
    the same bytes (a send and a one-hop broadcast are the same transfer)."""
    plan = compile_plan(problem, strategy=strategy, solver=FAST_SOLVER, seed=0)
    if not plan.operations:
        return
    task_ids = {t.id for t in plan.tasks}
    index = data.draw(st.integers(0, len(plan.operations) - 1))
    op = plan.operations[index]
    for kind in OP_KINDS:
        for chunks in (1, 2):
            if chunks > region_size(op.region):
                continue
            mutant = op.model_copy(update={"kind": kind, "chunks": chunks})
            changed = plan.model_copy(update={"operations": plan.operations[:index] + (mutant,) + plan.operations[index + 1:]})
            allowed = _table_allows(mutant, task_ids)
            assert _accepted(changed) == allowed, (str(op), kind, chunks)
            if not allowed:
                with pytest.raises(PlanError):
                    check_plan(changed)  # refused by the structural rules, not only by the replay


@settings(max_examples=30, **SETTINGS)
@given(problems(), st.sampled_from([64, 512, 4096]))
def test_an_operation_owns_a_tag_per_message_of_its_route(problem, bucket):
    """`tags_used` counts a bundle's messages from its runs, without building the route: one per message, as for
    every kind that sends (a copy sends none)."""
    plan = compile_plan(problem, solver=FAST_SOLVER, seed=0, coalesce=True, bucket_bytes=bucket)
    for op in plan.operations:
        sent = [hop for hop in route(op) if hop.src != hop.dst] if rule_of(op).pattern == "local" else route(op)
        want = len(sent) if rule_of(op).pattern in ("bundle", "local") else len({hop.tag for hop in route(op)})
        assert tags_used(op) == want
