"""The MPI engine receiving into the caller's arrays (`run(shards, into=...)`) on the in-process fake MPI
(tests/support/fake_mpi.py): the caller's arrays are what the steps write (their own memory, no buffer of the engine's
for them, bound once for the same arrays); the engine's own buffers are made by the first call passing none, once; and
arrays that cannot be written in place are refused in one line, leaving the executor usable. Strided views (MPI
derived datatypes, which the fake lacks) run under mpiexec: tests/test_receive_into_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest

from xmesh_plan.executor import PlanMismatchError
from xmesh_plan.executor.apart import overlaps_itself, refuse_shared
from xmesh_plan.planner.compile import compile_plan
from tests.support.transfer import assert_every_shard, fake_executors, full_tensors, many_bundles, run_everywhere, slice_box, three_tensors
from tests.test_convert_mpi import fake_ranks, run_fake, wrong_elements
from tests.workers.convert_worker import HOOKS


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def callers_arrays(ex) -> dict[str, np.ndarray]:
    """A fresh C-contiguous array per destination shard of this rank (scales included), of the engine's storage dtype."""
    return {name: np.empty(t.dst_shape, ex.engine.dtypes[k]) for k, (name, t) in enumerate(zip(ex.names, ex.program.tensors))
            if t.dst_shape is not None}


@pytest.mark.parametrize("order", ["device", "posted"])
def test_into_only_calls_write_the_callers_arrays_and_allocate_no_destination_buffer(order):
    """A converting plan (fp16, bf16, FP8 with block and per-tensor scales) run into the caller's arrays: bit for bit
    against torch's `.to()`, `run()` returns those very arrays, the steps are bound to their memory (the same requests
    again for the same arrays, new ones for new arrays) and the engine has no destination shard of its own; then calls
    passing none make the own shards once and reuse them."""
    plan, _, executors = fake_ranks(HOOKS, order)
    given = [callers_arrays(ex) for ex in executors]
    bound, kept = None, []
    for step in range(3):
        if step == 2:  # new arrays, the old ones kept alive so that none can come back at an old address
            kept.append(given)
            given = [callers_arrays(ex) for ex in executors]
        outs, fulls = run_fake(plan, executors, step, into=given)
        assert wrong_elements(plan, outs, fulls) == []
        for ex, out, arrays in zip(executors, outs, given):
            engine = ex.engine
            assert arrays and all(out[name] is array for name, array in arrays.items())
            assert all(own is None for own in engine.dsts) and engine.dst is None, "the engine made destination buffers"
            for name, array in arrays.items():
                assert address(engine.dst_typed[ex.names.index(name)]) == address(array)
        requests = [[ex.engine.requests[i] for uses in ex.engine.uses_dst for i in uses] for ex in executors]
        if step == 1:
            assert all(a is b for now, then in zip(requests, bound) for a, b in zip(now, then)), "rebound for the same arrays"
        if step == 2:
            assert not any(a is b for now, then in zip(requests, bound) for a, b in zip(now, then) if a is not None)
        bound = requests
    owns = None
    for step in (3, 4):
        outs, fulls = run_fake(plan, executors, step)
        assert wrong_elements(plan, outs, fulls) == []
        now = [list(ex.engine.dsts) for ex in executors]
        assert all(d is not None for ex, ds in zip(executors, now) for d, t in zip(ds, ex.program.tensors) if t.dst_shape is not None)
        if owns is not None:
            assert all(a is b for ds, before in zip(now, owns) for a, b in zip(ds, before)), "own shards made again"
        owns = now


def _refused(ex, into, match: str, shards=None) -> None:
    """`ex.start(shards, into)` refused in one line naming start(), before anything started: the executor stays usable;
    `ex.run` refused alike, naming run()."""
    for call in ("start", "run"):
        with pytest.raises(PlanMismatchError, match=match) as err:
            getattr(ex, call)(shards, into)
        assert str(err.value).startswith(f"{call}(): "), err.value
        assert "\n" not in str(err.value) and not ex.in_flight and not ex.engine.broken


def test_arrays_that_cannot_be_written_in_place_are_refused_in_one_line_and_the_executor_runs_after():
    """Wrong dtype, wrong shape, read-only, elements sharing memory, two destinations sharing memory, a destination
    sharing memory with a source shard of the same call: each refused before anything starts; every rank then runs."""
    plan = compile_plan(many_bundles(), solver="greedy")
    executors = fake_executors(plan)
    ex = next(e for e in executors if e.device == 4)
    shape = ex.program.tensors[0].dst_shape
    _refused(ex, {"t0": np.empty(shape, np.float64)}, r"into\['t0'\] on device 4 is float64 but the plan delivers float32")
    _refused(ex, {"t0": np.empty((shape[0] + 1, shape[1]), np.float32)}, r"into\['t0'\] on device 4 has shape")
    frozen = np.empty(shape, np.float32)
    frozen.flags.writeable = False
    _refused(ex, {"t0": frozen}, r"into\['t0'\] on device 4 is read-only")
    tight = np.lib.stride_tricks.as_strided(np.empty(shape[0] + shape[1], np.float32), shape, (4, 4))
    _refused(ex, {"t0": tight}, r"into\['t0'\] on device 4 has elements sharing memory")
    wide = np.empty((shape[0], shape[1] + 2), np.float32)
    _refused(ex, {"t0": wide[:, :shape[1]], "t1": wide[:, 2:]}, r"into\['t\d'\] on device 4 shares memory with into\['t\d'\]")
    full = full_tensors(plan, 0)
    out = run_everywhere(plan, executors, full)
    assert_every_shard(plan, out, full)

    plan = compile_plan(three_tensors(dst_devices=(2, 3, 4)), solver="greedy")
    executors = fake_executors(plan, order="posted")
    ex = next(e for e in executors if e.device == 3)
    full = full_tensors(plan, 1)
    shards = {name: slice_box(full[name], t.src_block).copy() for name, t in zip(ex.names, ex.program.tensors) if t.src_block is not None}
    w = ex.program.tensors[ex.names.index("w")]
    assert shards["w"].size >= int(np.prod(w.dst_shape))
    inside = shards["w"].reshape(-1)[:int(np.prod(w.dst_shape))].reshape(w.dst_shape)
    _refused(ex, {"w": inside}, r"into\['w'\] on device 3 shares memory with the source shard of 'w'", shards)
    out = run_everywhere(plan, executors, full)
    assert_every_shard(plan, out, full)


@pytest.mark.parametrize("order", ["device", "posted"])
def test_the_engines_own_destination_shard_passed_back_is_refused_and_runs_after(order):
    """What a run returned (the engine's own destination shard) passed back as a source shard of the next call, or as
    its `into` for another tensor whose own shard the call writes: refused in one line on every rank, naming both
    tensors, before anything starts (unchecked, S0 R -> S1 R wrote a wrong result); passing `into` for the tensor the
    own shard belongs to (so the call does not write it) runs, bit for bit, and so does every rank after."""
    from xmesh_plan.planner.transfer_io import build_transfer

    mesh = {"shape": [2, 2], "devices": [0, 1, 2, 3]}
    plan = compile_plan(build_transfer({"src_mesh": mesh, "dst_mesh": mesh, "tensors": [
        {"name": "w", "shape": [8, 8], "src": "S0 R", "dst": "S1 R"}, {"name": "b", "shape": [8, 8], "src": "S0 R", "dst": "S1 R"}]}),
        solver="greedy")
    executors = fake_executors(plan, order=order)
    full = full_tensors(plan, 2)
    run_everywhere(plan, executors, full)  # makes the own shards
    for ex in executors:
        copies = {name: slice_box(full[name], t.src_block).copy() for name, t in zip(ex.names, ex.program.tensors)}
        own = dict(zip(ex.names, ex.engine.dsts))
        d = ex.device
        _refused(ex, None, rf"the source shard of 'w' on device {d} shares memory with the engine's own destination shard of "
                 r"'w' \(what an earlier run returned for it; this call writes it\): pass a copy, or pass into=\{'w': \.\.\.\}",
                 {**copies, "w": own["w"]})
        _refused(ex, {"w": own["b"]}, rf"into\['w'\] on device {d} shares memory with the engine's own destination shard of 'b'",
                 copies)
        _refused(ex, {"w": np.empty_like(own["w"])}, rf"the source shard of 'b' on device {d} shares memory with the engine's "
                 r"own destination shard of 'b'", {**copies, "b": own["b"]})
    targets, sources = [], []
    for ex in executors:  # a call passing into for w does not write w's own shard: passed as its source, it runs
        own = dict(zip(ex.names, ex.engine.dsts))
        np.copyto(own["w"], slice_box(full["w"], ex.program.tensors[ex.names.index("w")].src_block))
        sources.append({"w": own["w"], "b": slice_box(full["b"], ex.program.tensors[ex.names.index("b")].src_block).copy()})
        targets.append({"w": np.empty_like(own["w"])})
    for ex, shards, into in zip(executors, sources, targets):
        ex.start(shards, into)
    for _ in range(10_000):
        if all([ex.test() for ex in executors]):
            break
    out = {ex.device: {k: v.copy() for k, v in ex.wait().items()} for ex in executors}
    assert all(out[ex.device]["w"] is not None for ex in executors)
    assert_every_shard(plan, out, full)
    assert_every_shard(plan, run_everywhere(plan, executors, full), full)


def test_overlap_checks_agree_with_every_elements_offset():
    """`overlaps_itself` against a brute-force count of distinct element offsets, on random shapes and strides
    (interleaved, negative, zero); `refuse_shared` passes interleaved columns that share no element and refuses
    columns that do."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(1, 5, ndim))
        itemsize = int(rng.choice([1, 2, 4]))
        strides = tuple(int(s) * int(rng.choice([-1, 1])) for s in rng.integers(0, 13, ndim))
        span = sum(abs(s) * (n - 1) for s, n in zip(strides, shape)) + itemsize
        base = np.zeros(2 * span + 16, np.uint8)
        start = span  # room for negative strides
        view = np.ndarray(shape, f"u{itemsize}", buffer=base, offset=start, strides=strides)
        offsets = {sum(i * s for i, s in zip(index, strides)) for index in np.ndindex(*shape)}
        byte_sets = [set(range(o, o + itemsize)) for o in offsets]
        distinct = len(offsets) == view.size and all(not (a & b) for k, a in enumerate(byte_sets) for b in byte_sets[k + 1:])
        assert overlaps_itself(view) == (not distinct), (shape, strides, itemsize)
    wide = np.zeros((8, 8), np.float32)
    refuse_shared({"a": wide[:, :4], "b": wide[:, 4:]}, {}, 0)
    refuse_shared({"a": wide[::2]}, {"b": wide[1::2]}, 0)
    with pytest.raises(PlanMismatchError, match=r"into\['a'\] on device 0 shares memory with the source shard of 'b'"):
        refuse_shared({"a": wide[:, :5]}, {"b": wide[:, 4:]}, 0)
    with pytest.raises(PlanMismatchError, match=r"into\['b'\] on device 0 shares memory with the source shard of 'a'"):
        refuse_shared({"b": wide[4:]}, {"a": wide}, 0)


def test_a_huge_zero_stride_destination_is_refused_in_one_line_without_listing_its_offsets():
    """A 4e7-element destination whose elements are one float (a zero stride, as `numpy.broadcast_to` makes): refused
    in one line while allocating under 1 MiB (listing every element's offset first took 305 MiB); interleaved strides
    over more elements than `apart.OFFSETS_CHECKED` count as overlapping without listing them either."""
    import tracemalloc

    from xmesh_plan.executor.apart import refuse_overlapping_into

    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (40_000_000,), (0,))
    tracemalloc.start()
    try:
        with pytest.raises(PlanMismatchError, match=r"^run\(\): into\['w'\] on device 3 has elements sharing memory") as err:
            refuse_overlapping_into(huge, 3, "w")
        interleaved = np.lib.stride_tricks.as_strided(np.zeros(16_000, np.float32), (4096, 2048), (8, 12))  # past OFFSETS_CHECKED
        assert overlaps_itself(interleaved)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value) and peak < 1 << 20, peak
    assert overlaps_itself(np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), (4, 1 << 20, 3), (4, 0, 4)))


def test_the_one_tensor_face_refuses_a_destination_inside_its_source_shard_and_runs_after():
    """`ReshardingExecutor.run(shard, into=...)` with `into` over the source shard's own memory: refused in one line,
    naming the tensor; the same executor then runs into a separate array, which it returns, bit for bit."""
    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor.mpi_engine import MpiEngine
    from xmesh_plan.executor.passes import rank_program
    from xmesh_plan.executor.ranks import rank_of_devices
    from xmesh_plan.planner.problem_io import build_problem
    from tests.support.fake_mpi import FakeComm, FakeMPI, FakeWorld, WorldComm

    mesh = {"shape": [2], "devices": [0, 1]}
    plan = compile_plan(build_problem({"shape": [8, 6], "dtype": "float32", "src": {"mesh": mesh, "spec": "S0 R"},
                                       "dst": {"mesh": mesh, "spec": "R S0"}}), solver="greedy")
    world, executors = FakeWorld(), []
    for rank in (0, 1):
        ex = ReshardingExecutor(plan, WorldComm(world, rank, 2))
        ex.program = rank_program(plan, rank, "device", True, tag_limit=2**20)
        ex.engine = MpiEngine(ex.program, FakeComm(world, rank), rank_of_devices(plan), 5.0, (1e-5, 1e-4))
        ex.engine.setup(mpi=FakeMPI)
        executors.append(ex)
    full = np.arange(48, dtype=np.float32).reshape(8, 6)
    shards = [slice_box(full, ex.program.src_block).copy() for ex in executors]
    name = executors[0].names[0]
    _refused(executors[0], shards[0].reshape(-1).reshape(8, 3), rf"into\[{name!r}\] on device 0 shares memory with the source "
             rf"shard of {name!r}", shards[0])
    targets = [np.empty(ex.program.dst_shape, np.float32) for ex in executors]
    for ex, shard, target in zip(executors, shards, targets):
        ex.start(shard, into=target)
    for _ in range(1000):
        if all([ex.test() for ex in executors]):
            break
    assert all(ex.wait() is target for ex, target in zip(executors, targets))
    for ex, target in zip(executors, targets):
        assert np.array_equal(target, slice_box(full, ex.program.dst_block)) and ex.engine.dst is None



def test_the_overlap_modules_examples_hold():
    import doctest

    from xmesh_plan.executor import apart

    result = doctest.testmod(apart, report=False)
    assert result.attempted > 0 and result.failed == 0
