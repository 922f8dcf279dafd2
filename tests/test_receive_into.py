"""The torch engine writes the caller's destination tensors in place (`run(shards, into=...)`), on real gloo ranks.

Ranks are threads of this process, each with its own gloo group (tests/support/gloo_threads.py). Every destination
shard is handed in as a view into a larger parent tensor, as an inference engine's parameter or a slice of a fused
one: rows of a parent with rows before and after (contiguous, at an offset), columns of a wider parent (each row one
run), or every other element (no two elements adjacent). The bytes are read back from the parent, so they must have
been written through the view; the parent's other bytes must be untouched; the engine must not have made its own
buffer for a tensor it wrote in place, nor a shadow buffer where the view is contiguous; and once the call has
returned, the engine holds no reference to the parent.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from tests.support.cases import all_fixed_plans, compiled, fixed_problems, random_problem
from tests.support.gloo_threads import run_threads
from tests.support.transfer import fake_executors, random_transfer, three_tensors
from xmesh_plan.executor import PlanMismatchError, TransferExecutor
from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.pattern import fill
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas.plan_tensors import tensor_plans

torch = pytest.importorskip("torch")
from tests.support.torch_views import SENTINEL, parent_and_view  # noqa: E402
pytestmark = pytest.mark.timeout(600)
LAYOUTS = ("rows", "columns", "every_other")


def expected(plan, salt: int) -> list[tuple[str, np.ndarray]]:
    """Each tensor's name and whole pattern (raw storage dtype) for `salt`."""
    return [(single.problem.name, fill(tuple((0, n) for n in single.problem.shape), tuple(single.problem.shape),
                                        storage_dtype(single.problem.dtype), salt + k))
            for k, single in enumerate(tensor_plans(plan))]


def storage_uses(tensor) -> int:
    """How many tensors (views included) use `tensor`'s memory, as torch counts them: a view the engine kept of the
    caller's tensor keeps its storage, not the Python object passed in, alive."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def sources(ex, plan, salt: int) -> dict:
    """This rank's source shards of `plan` for `salt`, as torch tensors of the plan's dtypes."""
    out = {}
    for (name, whole), mine, dtype in zip(expected(plan, salt), ex.program.tensors, ex.engine.dtypes):
        if mine.src_block is not None:
            out[name] = torch.from_numpy(np.ascontiguousarray(whole[tuple(slice(a, b) for a, b in mine.src_block)])).view(dtype)
    return out


def receive_into(plan, order: str, layouts=LAYOUTS):
    """Every rank of `plan` runs it once per layout into views of parents, then once into its own buffers; what each
    rank saw, as (layout, name, wrong bytes, parent untouched elsewhere, own buffer made, shadow bytes, still referenced)."""
    def work(rank: int, group):
        ex = TransferExecutor(plan, group, backend="torch", timeout_s=30.0, order=order).prepare()
        out = []
        for salt, layout in enumerate(layouts + ("own",)):
            wholes, shards = expected(plan, salt), sources(ex, plan, salt)
            parents, refs = {}, {}
            for (name, whole), mine in zip(wholes, ex.program.tensors):
                if mine.dst_block is not None and layout != "own":
                    raw, index, view = parent_and_view(mine.dst_shape, ex.engine.dtypes[ex.names.index(name)], layout)
                    parents[name], refs[name] = (raw, index, view), (weakref.ref(view), raw)
            got = ex.run(shards, into={name: view for name, (_, _, view) in parents.items()} if layout != "own" else None)
            for (name, whole), mine, t in zip(wholes, ex.program.tensors, range(len(wholes))):
                if mine.dst_block is None:
                    assert name not in got
                    continue
                want = whole[tuple(slice(a, b) for a, b in mine.dst_block)].view(np.uint8).reshape(-1)
                if layout == "own":
                    assert got[name] is ex.engine.dsts[t]
                    bytes_ = ex.engine.host_copy(got[name]).view(np.uint8).reshape(-1)
                    out.append((layout, name, int((bytes_ != want).sum()), True, True, 0, False))
                    continue
                raw, index, view = parents.pop(name)
                assert got.pop(name) is view
                seen = raw[index].clone().numpy().reshape(-1)  # a copy: a numpy view would hold the storage
                rest = raw.clone()
                rest[index] = SENTINEL
                out.append((layout, name, int((seen != want).sum()), bool((rest == SENTINEL).all()),
                            ex.engine.dsts[t] is not None, sum(b.numel() for k, b in ex.engine.into.shadows.items() if k[0] == t),
                            None))
                del raw, index, view, rest
            got = None
            for name, (ref, raw) in refs.items():  # the engine dropped the tensors and every view of them when run() returned
                k = next(i for i, row in enumerate(out) if row[0] == layout and row[1] == name)
                out[k] = out[k][:-1] + (ref() is not None or storage_uses(raw) != storage_uses(torch.empty(1)),)
            refs = raw = None
        ex.close()
        return out
    return run_threads(len(plan_devices(plan)), work)


def check(rows_by_rank) -> None:
    seen = set()
    for rank, rows in enumerate(rows_by_rank):
        for layout, name, wrong, untouched, own, shadow, alive in rows:
            seen.add(layout)
            assert wrong == 0, (rank, layout, name, wrong)
            assert untouched, f"rank {rank}: {layout} {name}: bytes of the parent outside the view were written"
            if layout != "own":
                assert not own, f"rank {rank}: {layout} {name}: the engine made its own buffer for a tensor written in place"
                assert not alive, f"rank {rank}: {layout} {name}: the engine still references the caller's tensor"
            if layout == "rows":
                assert shadow == 0, f"rank {rank}: {name}: {shadow} B of shadow for a contiguous destination"
    assert seen == set(LAYOUTS) | {"own"}


@pytest.mark.parametrize("order", ["device", "posted"])
def test_every_strategy_and_dtype_lands_in_views_of_the_callers_tensors(order):
    for plan in all_fixed_plans() + [compiled(random_problem(seed), "auto") for seed in range(4)]:  # chunked broadcasts too
        check(receive_into(plan, order))


def test_multi_tensor_plans_land_in_views_of_the_callers_tensors():
    chained = {"split_hosts": False, "coalesce": False}
    plans = [compile_plan(three_tensors(), strategy=s, solver="greedy", **chained) for s in ("broadcast", "local_allgather")]
    plans += [compile_plan(three_tensors(), strategy="auto", solver="greedy")]  # bundles: staged, gathered and scattered
    plans += [compile_plan(random_transfer(seed, 6, exact=True), strategy="auto", solver="greedy") for seed in range(4)]
    assert {"copy", "send", "broadcast", "allgather"} <= {op.kind for p in plans for op in p.operations}
    for plan in plans:
        for order in ("device", "posted"):
            check(receive_into(plan, order))


def test_a_strided_destination_receives_through_shadows_kept_across_calls():
    """Messages into every other element land in shadows (the engine's only allocation for them), made once."""
    plan = compiled(fixed_problems()[0], "send_recv")  # 8 x 6 x 4 from S0 S1 R to R S0 S1: boxes of several elements

    def work(rank: int, group):
        ex = TransferExecutor(plan, group, backend="torch", timeout_s=30.0).prepare()
        mine, shards = ex.program.tensors[0], sources(ex, plan, 0)
        made = []
        for _ in range(2):
            into = {ex.names[0]: parent_and_view(mine.dst_shape, ex.engine.dtypes[0], "every_other")[2]} if mine.dst_block else None
            ex.run(shards, into=into)
            made.append({k: b.data_ptr() for k, b in ex.engine.into.shadows.items()})
        ex.close()
        return made, mine.dst_block is not None and any(s.action == "recv" for s in ex.program.steps)

    results = run_threads(len(plan_devices(plan)), work)
    receivers = [made for made, receives in results if receives]
    assert receivers and all(first == second and first for first, second in receivers)


def test_into_is_refused_in_one_line_where_it_does_not_fit():
    plan = compile_plan(three_tensors(), strategy="broadcast", solver="greedy")

    def work(rank: int, group):
        ex = TransferExecutor(plan, group, backend="torch", timeout_s=30.0).prepare()
        mine = dict(zip(ex.names, ex.program.tensors))
        holder = next((n for n, m in mine.items() if m.dst_block is not None), None)
        outsider = next((n for n, m in mine.items() if m.dst_block is None), None)
        errors = []
        cases = {"unknown": {"nope": torch.zeros(1)}}
        if holder is not None:
            shape, dtype = mine[holder].dst_shape, ex.engine.dtypes[ex.names.index(holder)]
            cases["shape"] = {holder: torch.zeros(tuple(n + 1 for n in shape), dtype=dtype)}
            cases["dtype"] = {holder: torch.zeros(shape, dtype=torch.float64)}
            cases["overlap"] = {holder: torch.zeros(1, dtype=dtype).expand(shape)}  # every element the same memory
        if outsider is not None:
            cases["outside"] = {outsider: torch.zeros(1)}
        for case, into in cases.items():
            try:
                ex.start(sources(ex, plan, 0), into=into)
                errors.append((case, "accepted"))
            except PlanMismatchError as err:
                errors.append((case, str(err)))
        ex.close()
        return errors

    results = run_threads(len(plan_devices(plan)), work)
    assert {case for errors in results for case, _ in errors} == {"unknown", "shape", "dtype", "overlap", "outside"}  # every case ran somewhere
    for rank, errors in enumerate(results):
        for case, text in errors:
            assert text != "accepted" and "\n" not in text, (rank, case, text)
            assert {"unknown": "not a tensor of this plan", "shape": "has shape", "dtype": "is torch.float64",
                    "overlap": "has elements sharing memory", "outside": "holds no destination shard"}[case] in text, (rank, case, text)


def test_an_engine_that_does_not_receive_into_refuses_into_saying_why():
    """An engine whose entry has `receives_into` False: `into` is refused before anything starts (here on a fake MPI
    executor given the nccl entry with it cleared; every registered engine receives into the caller's arrays)."""
    from dataclasses import replace

    from xmesh_plan.executor.engines import ENGINES

    plan = compile_plan(three_tensors(), strategy="broadcast", solver="greedy")
    ex = next(e for e in fake_executors(plan) if all(t.src_block is None for t in e.program.tensors))
    ex.entry = replace(ENGINES["nccl"], receives_into=False)
    name, shards = next((n, t) for n, t in zip(ex.names, ex.program.tensors) if t.dst_block is not None)
    with pytest.raises(PlanMismatchError, match="backend 'nccl' binds its requests to its own destination shards once"):
        ex.start(None, into={name: np.zeros(shards.dst_shape)})
    assert not ex.in_flight
