"""Bundles and shared messages proved from a compact plan's columns (`planner.verify_bundles`): a bundle plan is
proved with no record read, its message tags are `tags_used`'s, and a plan with a bundle dropped, moved, duplicated
or one of its devices out of place is refused by the column proof (the record path then names the fault)."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest

from xmesh_plan.planner import verify_columns
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.verify import PlanError, verify_plan, verify_plan_file
from xmesh_plan.planner.verify_bundles import BundleColumns, bundle_facts, same_sides, task_sides
from xmesh_plan.planner.verify_columns import verify_compact
from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.op_kinds import tags_used
from xmesh_plan.schemas.plan_compact import COLUMN_KINDS, _device_index, compact_arrays, compact_bytes, read_compact_columns
from tests.support.mutations import as_lists
from tests.support.transfer import many_bundles, random_transfer


def _quiet(*_) -> None:
    return None


@functools.cache
def _plans() -> tuple[Plan, ...]:
    """Bundle plans: twelve tensors between two hosts of four devices (bundles gather from three holders and scatter
    to three needers), and random multi-tensor plans with a small bucket, so bundles share messages."""
    plans = [compile_plan(many_bundles(), bucket_bytes=4096)]
    plans += [compile_plan(random_transfer(seed, 8), solver="greedy", bucket_bytes=512) for seed in range(6)]
    plans = [p for p in plans if any(op.kind == "bundle" for op in p.operations)]
    assert any(op.carrier is not None for p in plans for op in p.operations)
    return tuple(plans)


def _file(plan: Plan, folder: Path, name: str = "x") -> Path:
    path = folder / f"{name}.plan.npz"
    path.write_bytes(compact_bytes(plan))
    return path


def _facts(path: Path, plan: Plan):
    columns = read_compact_columns(path, {"operations": set(COLUMN_KINDS["operations"])})
    ops = columns.tables["operations"]
    problems = plan.problem.tensor_problems()
    return bundle_facts(verify_columns._op_columns(ops), BundleColumns.of(ops, columns.box_table()), problems, plan.problem.cluster)


def test_bundle_plans_are_proved_with_no_record(tmp_path, monkeypatch):
    read: list[int] = []
    real = verify_columns._records
    monkeypatch.setattr(verify_columns, "_records", lambda columns, rows: read.extend(rows.tolist()) or real(columns, rows))
    for k, plan in enumerate(_plans()):
        proved = verify_compact(_file(plan, tmp_path, f"p{k}"), _quiet, _quiet)
        assert proved is not None and read == []
        assert str(verify_plan_file(tmp_path / f"p{k}.plan.npz")) == str(verify_plan(plan))


def _shuffled_bundles(rng: random.Random, plan: Plan) -> Plan:
    """Every bundle's holders and needers redrawn on their relays' hosts (whether they hold or need the parts or not):
    runs of one holder or one needer of every length and gap, for the tag count."""
    raw = as_lists(plan.model_dump())
    per_host = plan.problem.cluster.devices_per_host
    for op in raw["operations"]:
        if op["kind"] != "bundle":
            continue
        send_host, recv_host = op["src"] // per_host * per_host, op["dsts"][0] // per_host * per_host
        op["holders"] = [rng.choice([op["src"], send_host + rng.randrange(per_host)]) for _ in op["holders"]]
        op["needers"] = [rng.sample(range(recv_host, recv_host + per_host), rng.randint(1, per_host)) for _ in op["needers"]]
    return Plan.model_validate(raw)


def test_bundle_tags_are_tags_used(tmp_path):
    rng = random.Random(6)
    counted = 0
    for plan in _plans():
        for _ in range(4):
            shuffled = _shuffled_bundles(rng, plan)
            facts = _facts(_file(shuffled, tmp_path), shuffled)
            for row, op in enumerate(shuffled.operations):
                if op.kind == "bundle":
                    assert facts.tags[row] == tags_used(op), op
                    counted += tags_used(op) > 3
    assert counted > 40  # bundles with several gathers and scatters were counted


def test_shared_sides_are_the_sets_of_nic_sides():
    rng = np.random.default_rng(3)
    for _ in range(200):
        entries = [tuple(rng.integers(0, 12, rng.integers(0, 8)).tolist()) for _ in range(rng.integers(0, 6))]
        a, b = rng.integers(-1, 13, 20), rng.integers(-1, 13, 20)
        sides = {t: {e for e, tasks in enumerate(entries) if t in tasks} for t in range(-1, 13)}
        want = all(sides[x] == sides[y] for x, y in zip(a.tolist(), b.tolist()))
        assert same_sides(task_sides(entries), a, b) == want


def test_the_device_index_is_each_distinct_device_and_row():
    for plan in _plans():
        arrays = compact_arrays(plan)
        index = _device_index(arrays, len(plan.operations))
        rows = {}
        for row, op in enumerate(plan.operations):
            for d in {op.src, *op.dsts, *op.holders, *(d for n in op.needers for d in n)} - {None}:
                rows.setdefault(d, []).append(row)
        assert index["index.devices"].tolist() == sorted(rows)
        firsts = [sorted(r)[0] for _, r in sorted(rows.items())]
        assert index["index.first"].tolist() == firsts
    far = {"operations.src": np.array([5, -3, 10**15]), "operations.dsts.lengths": np.array([1, 0, 2]),
           "operations.dsts.values": np.array([1, 2, 2]), **{f"operations.{f}.{p}": np.zeros(s, np.int64) for f, parts in
           (("holders", (("lengths", 3), ("values", 0))), ("needers", (("lengths", 3), ("inner", 0), ("values", 0)))) for p, s in parts}}
    assert _device_index(far, 3)["index.devices"].tolist() == [-3, 1, 2, 5, 10**15]  # ids too far apart for one key


def _bundle_rows(plan: Plan, rng: random.Random, own_message: bool = True) -> list[int]:
    """Rows of bundles (sending their own message, none riding in theirs, where `own_message`), shuffled."""
    ops = plan.operations
    carriers = {op.carrier for op in ops}
    rows = [k for k, op in enumerate(ops) if op.kind == "bundle" and (not own_message or (op.carrier is None and op.id not in carriers))]
    rng.shuffle(rows)
    return rows


def _dropped(plan: Plan, rng: random.Random) -> Plan:
    row = _bundle_rows(plan, rng)[0]
    return plan.model_copy(update={"operations": plan.operations[:row] + plan.operations[row + 1:]})


def _duplicated(plan: Plan, rng: random.Random) -> Plan:
    """A bundle delivered a second time, by a copy listed last (its own id)."""
    op, last = plan.operations[_bundle_rows(plan, rng)[0]], plan.operations[-1]
    twin = op.model_copy(update={"id": max(o.id for o in plan.operations) + 1, "start_s": last.start_s, "end_s": last.end_s})
    return plan.model_copy(update={"operations": plan.operations + (twin,)})


def _moved(plan: Plan, rng: random.Random) -> Plan:
    """One part of a bundle one element further along a dim (the region grown to hold it)."""
    row = _bundle_rows(plan, rng)[0]
    op = plan.operations[row]
    k = rng.randrange(len(op.parts))
    part = [list(p) for p in op.parts[k]]
    d = rng.randrange(len(part))
    part[d] = [part[d][0] + 1, part[d][1] + 1]
    region = tuple((min(a, p[0]), max(b, p[1])) for (a, b), p in zip(op.region, part))
    parts = op.parts[:k] + (tuple(map(tuple, part)),) + op.parts[k + 1:]
    return _with(plan, row, op.model_copy(update={"parts": parts, "region": region}))


def _needer_swapped(plan: Plan, rng: random.Random) -> Plan:
    """One needer of a part replaced by another device of its host."""
    row = _bundle_rows(plan, rng, own_message=False)[0]
    op = plan.operations[row]
    k = rng.randrange(len(op.needers))
    per_host = plan.problem.cluster.devices_per_host
    needers = list(op.needers[k])
    j = rng.randrange(len(needers))
    others = [d for d in range(needers[j] // per_host * per_host, (needers[j] // per_host + 1) * per_host) if d != needers[j]]
    needers[j] = rng.choice(others)
    return _with(plan, row, op.model_copy(update={"needers": op.needers[:k] + (tuple(needers),) + op.needers[k + 1:]}))


def _holder_swapped(plan: Plan, rng: random.Random) -> Plan:
    """The holder of a part replaced by another device of the sending relay's host."""
    row = _bundle_rows(plan, rng, own_message=False)[0]
    op = plan.operations[row]
    k = rng.randrange(len(op.holders))
    per_host = plan.problem.cluster.devices_per_host
    host = op.src // per_host * per_host
    holder = rng.choice([d for d in range(host, host + per_host) if d != op.holders[k]])
    return _with(plan, row, op.model_copy(update={"holders": op.holders[:k] + (holder,) + op.holders[k + 1:]}))


def _parts_swapped(plan: Plan, rng: random.Random) -> Plan:
    """Two parts of a bundle trade places (each keeps its holder and needers): a member out of place."""
    rows = [r for r in _bundle_rows(plan, rng, own_message=False) if len(set(plan.operations[r].needers)) > 1]
    op = plan.operations[rows[0]]
    i, j = rng.sample([k for k in range(len(op.parts))], 2)
    while op.needers[i] == op.needers[j]:
        i, j = rng.sample([k for k in range(len(op.parts))], 2)
    parts = list(op.parts)
    parts[i], parts[j] = parts[j], parts[i]
    return _with(plan, rows[0], op.model_copy(update={"parts": tuple(parts)}))


def _with(plan: Plan, row: int, op) -> Plan:
    return plan.model_copy(update={"operations": plan.operations[:row] + (op,) + plan.operations[row + 1:]})


def _verdict(call) -> str:
    try:
        return str(call())
    except PlanError as err:
        return f"PlanError: {err}"


@pytest.mark.parametrize("mutation", [_dropped, _duplicated, _moved, _needer_swapped, _holder_swapped, _parts_swapped])
def test_a_broken_bundle_is_refused_by_the_columns(tmp_path, mutation):
    """Where the record path refuses the mutant, the column proof declines it and verify says what the record path
    says; where it passes (a holder swapped for another that holds the part too), both give the same report."""
    rng = random.Random(mutation.__name__)
    refused = 0
    for plan in _plans():
        for _ in range(3):
            try:
                mutant = Plan.model_validate(mutation(plan, rng).model_dump())
            except IndexError:  # no bundle of that kind in this plan
                continue
            path = _file(mutant, tmp_path)
            records = _verdict(lambda: verify_plan(mutant))
            proved = verify_compact(path, _quiet, _quiet)
            assert (proved is None) == records.startswith("PlanError"), records
            assert _verdict(lambda: verify_plan_file(path)) == records
            refused += records.startswith("PlanError")
    assert refused >= 6
