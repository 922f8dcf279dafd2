"""Executor pieces without MPI: lowering checks, rank rule, arrays, pattern, scaling, NCCL call lists."""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import math
import re
from pathlib import Path

import numpy as np
import pytest

from xmesh_plan.executor import BackendUnavailableError, PlanMismatchError, ReshardingExecutor
from xmesh_plan.executor.arrays import as_host_array, check_into, check_shard, storage_dtype
from xmesh_plan.executor.lower import chunk_ranges, contiguous_span, flat_pieces, lower, tags_used
from xmesh_plan.executor.nccl_plan import Bcast, Copy, communicator_groups, nccl_program
from xmesh_plan.executor.pattern import fill, mismatches
from xmesh_plan.executor.ranks import device_of_rank, plan_devices
from xmesh_plan.executor.scale import factors_for, scale_plan
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import load_plan
from xmesh_plan.schemas.geometry import intersect, region_shape
from tests.support.cases import STRATEGIES, all_fixed_plans, compiled, fixed_problems, random_problem

MODULES = ["xmesh_plan.executor.lower", "xmesh_plan.executor.ranks", "xmesh_plan.executor.pattern", "xmesh_plan.executor.scale", "xmesh_plan.executor.engines"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


def _imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports (relative imports resolve inside executor/, so they are skipped)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from xmesh_plan import planner`
    return names


def test_no_module_under_executor_imports_the_planner():
    root = Path(__file__).resolve().parents[1] / "executor"
    files = sorted(root.rglob("*.py"))
    assert root / "examples" / "pipeline_mlp.py" in files
    offenders = {str(f.relative_to(root.parent)): sorted(m for m in _imported_modules(f)
                                                                  if m.split(".")[0] == "planner" or m.startswith("xmesh_plan.planner"))
                 for f in files}
    assert {f: m for f, m in offenders.items() if m} == {}, "executor/ may import schemas/, never planner/"


def _plan(strategy="send_recv"):
    return compiled(fixed_problems()[0], strategy)


def test_contiguous_span_matches_numpy_layout():
    block = ((2, 5), (0, 4), (1, 3))
    buffer = np.arange(24, dtype=np.int32).reshape(3, 4, 2)
    for region in [((3, 4), (1, 3), (1, 3)), ((2, 5), (0, 4), (1, 3)), ((3, 4), (2, 3), (2, 3)), ((2, 4), (1, 2), (1, 3))]:
        span = contiguous_span(region, block, 4)
        view = buffer[tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(region, block))]
        assert (span is not None) == view.flags.c_contiguous
        if span is not None:
            assert np.array_equal(buffer.reshape(-1).view(np.uint8)[span[0]:span[1]].view(np.int32), view.reshape(-1))


def test_chunk_ranges_cover_the_bytes_on_element_boundaries():
    ranges = chunk_ranges(40, 3, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 40 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo % 4 == 0 for lo, _ in ranges)
    assert len(chunk_ranges(8, 5, 4)) == 2  # more chunks than elements: empty ones dropped


def test_every_message_has_a_matching_end_with_the_same_tag_and_size():
    for plan in all_fixed_plans():
        sends, recvs = [], []
        for device in plan_devices(plan):
            for s in lower(plan, device).steps:
                if s.action == "send":
                    sends.append((device, s.peer, s.tag, s.data.nbytes))
                elif s.action == "recv":
                    recvs.append((s.peer, device, s.tag, s.data.nbytes))
        assert sorted(sends) == sorted(recvs), plan.problem.name
        assert len(set(sends)) == len(sends), "two messages between one pair share a tag"


def test_steps_only_wait_for_earlier_steps():
    for plan in all_fixed_plans():
        for device in plan_devices(plan):
            assert all(d < s.index for s in lower(plan, device).steps for d in s.deps)


def test_a_box_outside_the_sender_shard_is_refused_naming_the_op():
    plan = _plan()
    op = plan.operations[0]
    bad = op.model_copy(update={"region": tuple((0, n) for n in plan.problem.shape)})
    plan = plan.model_copy(update={"operations": (bad,) + plan.operations[1:]})
    with pytest.raises(PlanMismatchError, match=rf"operation {op.id} .*device {op.src} sends .* which it does not hold .*xmesh-plan verify"):
        lower(plan, op.src)


def test_a_plan_that_misses_part_of_a_shard_is_refused():
    plan = _plan()
    dropped = plan.operations[-1]
    plan = plan.model_copy(update={"operations": plan.operations[:-1]})
    with pytest.raises(PlanMismatchError, match=rf"destination device {dropped.dsts[0]} never receives .* of its shard"):
        lower(plan, dropped.dsts[0])


def test_a_send_with_two_receivers_is_refused():
    plan = _plan()
    op = plan.operations[0]
    plan = plan.model_copy(update={"operations": (op.model_copy(update={"dsts": (op.dsts[0], 7 if op.dsts[0] != 7 else 6)}),)})
    with pytest.raises(PlanMismatchError, match="a send has exactly one receiver"):
        lower(plan, op.src)


def test_an_allgather_part_sent_before_it_arrived_is_refused():
    """Moving an all-gather ahead of the operation that delivers a member's part must not send stale bytes."""
    plan = compiled(fixed_problems()[3], "local_allgather")  # to_fully_replicated: sends, then all-gathers
    ops = list(plan.operations)
    k = next(i for i, op in enumerate(ops) if op.kind == "allgather")
    gather = ops[k]
    member, part = next((d, p) for d, p in zip(gather.dsts, gather.parts) if all(a < b for a, b in p))
    j = next(i for i, op in enumerate(ops[:k]) if member in op.dsts and intersect(op.region, part) is not None)
    reordered = plan.model_copy(update={"operations": tuple(ops[:j] + [gather] + ops[j:k] + ops[k + 1:])})
    lower(plan, member)  # the plan as compiled is fine
    with pytest.raises(PlanMismatchError, match=rf"operation {gather.id} .*list operations in execution order"):
        lower(reordered, member)
    # listed (and timed) right after the delivering operation starts, before it ends: refused by the times
    early = gather.model_copy(update={"start_s": ops[j].start_s, "end_s": max(gather.end_s, ops[j].start_s)})
    listed = ops[:j + 1] + [early] + ops[j + 1:k] + ops[k + 1:]
    renumbered = tuple(op.model_copy(update={"id": i}) for i, op in enumerate(listed))
    retimed = plan.model_copy(update={"operations": renumbered})
    with pytest.raises(PlanMismatchError, match=rf"operation {j + 1} .*device {member} sends .* which it does not hold at"):
        lower(retimed, member)
    with pytest.raises(PlanError, match=rf"operation {j + 1} .*device {member} sends .* which it does not hold at"):
        verify_plan(retimed)


def test_a_plan_needing_more_tags_than_mpi_allows_is_refused():
    plan = all_fixed_plans()[0]
    needed = sum(tags_used(op) for op in plan.operations)
    device = plan.operations[-1].dsts[0]
    lower(plan, device, tag_limit=needed - 1)  # tags 0 .. needed-1 fit exactly
    with pytest.raises(PlanMismatchError, match=rf"needs {needed} message tags but this MPI allows tags up to {needed - 2}"):
        lower(plan, device, tag_limit=needed - 2)


def test_rank_rule_and_the_world_size_error():
    plan = compiled(fixed_problems()[2], "broadcast")  # devices 0..7 used
    assert device_of_rank(plan, 3, len(plan_devices(plan))) == plan_devices(plan)[3]
    gappy = load_plan("plans/case8.plan.json")
    assert plan_devices(gappy) == (0, 1, 2, 4, 5, 6, 8, 9, 12, 13, 16, 17)
    with pytest.raises(PlanMismatchError, match=r"uses 12 devices .* this MPI world has 8 ranks; run with mpiexec -n 12") as err:
        device_of_rank(gappy, 0, 8)
    assert err.value.same_on_every_rank


class _Comm:
    """Enough of a communicator for the constructor's checks."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Idup(self):
        raise AssertionError("the constructor must not talk to MPI")


@pytest.mark.parametrize("kwargs,error,expect", [
    ({"backend": "mxi"}, ValueError, "backend 'mxi' is unknown; use one of: mpi, nccl, torch, gloo"),
    ({"backend": "torch"}, ValueError, "backend 'torch' runs over a torch process group; pass a torch.distributed process group"),
    ({"timeout_s": 0}, ValueError, "timeout_s=0 must be a finite number of seconds"),
    ({"timeout_s": float("inf")}, ValueError, "timeout_s=inf must be a finite number of seconds"),
    ({"timeout_s": 1e300}, ValueError, "timeout_s=1e[+]300 must be a finite number of seconds"),
    ({"timeout_s": float("nan")}, ValueError, "timeout_s=nan must be"),
    ({"timeout_s": "5"}, ValueError, "timeout_s='5' must be a finite number of seconds"),
    ({"timeout_s": None}, ValueError, "timeout_s=None must be"),
    ({"poll_s": 5}, ValueError, r"poll_s=5 must be \(shortest, longest\)"),
    ({"poll_s": (1e-5,)}, ValueError, "poll_s=.* must be"),
    ({"poll_s": (1e-3, 1e-5)}, ValueError, "0 < shortest <= longest"),
    ({"comm": None}, TypeError, "comm is a NoneType; pass an mpi4py communicator"),
    ({"comm": object(), "backend": "torch"}, TypeError, "comm is a object; pass an mpi4py communicator, e.g. MPI.COMM_WORLD, or a torch"),
    ({"plan": None}, TypeError, "plan is a NoneType; pass a schemas.Plan"),
    ({"order": "host"}, ValueError, "order 'host' is unknown; use one of: posted, device"),
])
def test_executor_arguments_are_checked_with_the_fix(kwargs, error, expect):
    args = {"plan": _plan(), "comm": _Comm(), **kwargs}
    with pytest.raises(error, match=expect):
        ReshardingExecutor(**args)


def test_a_shard_handed_to_a_rank_outside_the_source_mesh_is_refused():
    plan = _plan()  # even_disjoint: source devices 0-3, destination devices 4-7
    ex = ReshardingExecutor(plan, _Comm())
    ex.program = lower(plan, 5)
    with pytest.raises(PlanMismatchError, match=r"device 5 \(rank 0\) is not in the source mesh, so it has no source shard; pass None"):
        ex._adopt(0, np.zeros((2, 3, 4), np.int32))
    assert ex._adopt(0, None) is None


def test_executor_with_good_arguments_is_made_without_mpi_calls():
    ex = ReshardingExecutor(_plan(), _Comm(), timeout_s=5, poll_s=[1e-5, 1e-3])
    assert ex.timeout_s == 5.0 and ex.poll_s == (1e-5, 1e-3) and not ex.in_flight


@pytest.mark.parametrize("flags,expect", [
    (["--timeout", "0"], "--timeout 0: give a positive number of seconds"),
    (["--timeout", "-5"], "--timeout -5: give a positive"),
    (["--timeout", "nan"], "--timeout nan: give a positive"),
    (["--max-mb", "0"], "--max-mb 0: give a positive size"),
    (["--max-mb", "-3"], "--max-mb -3: give a positive size"),
    (["--max-mb", "inf"], "--max-mb inf: give a positive size"),
    (["--iters", "0"], "--iters 0: give 1 to 1,000,000 timed iterations"),
    (["--iters", "100000000000"], "--iters 100000000000: give 1 to 1,000,000"),
    (["--warmup", "-1"], "--warmup -1: give 0 to 1,000,000 untimed"),
    (["--max-mb", "1e308"], "--max-mb 1e+308: give a positive size in MiB up to"),
    (["--gpu", "-1"], "--gpu -1: give a GPU index from 0 to 2147483647"),
    (["--gpu", "99999999999999999999"], "--gpu 99999999999999999999: give a GPU index from 0 to"),
    (["--timeout", "1e300"], "--timeout 1e+300: give a positive number of seconds up to 1e+07"),
    (["--scale", "0,1,1"], "--scale '0,1,1': give one positive integer factor"),
    (["--scale", "4,x"], "--scale '4,x': give one positive integer factor"),
    (["--iters", "x"], "Invalid value for '--iters': 'x' is not a valid integer"),
    (["--backend", "tcp"], "Invalid value for '--backend': 'tcp' is not one of"),
])
def test_demo_refuses_every_bad_numeric_flag_in_one_line(flags, expect):
    from xmesh_plan.executor.run import UsageError, _arguments

    with pytest.raises(UsageError) as err:
        _arguments(["plans/case1.plan.json", *flags])
    message = str(err.value)
    assert expect in message and ("e.g." in message or "--help" in message) and "\n" not in message


def test_demo_accepts_the_documented_flags():
    from xmesh_plan.executor.run import _arguments

    args = _arguments(["plans/case1.plan.json", "--max-mb", "0.5", "--timeout", "2", "--scale", "4x4x2", "--iters", "1", "--warmup", "0"])
    assert args.scale == (4, 4, 2) and args.max_mb == 0.5 and args.timeout == 2.0


def test_shard_checks_name_the_expected_shape_and_dtype():
    with pytest.raises(PlanMismatchError, match=r"shape \(4, 3\) but the source spec 'S0 R' gives it \(4, 4\)"):
        check_shard(np.zeros((4, 3), np.float32), (4, 4), "float32", 2, "S0 R")
    with pytest.raises(PlanMismatchError, match="is int32 but the plan moves float32; pass a float32 array"):
        check_shard(np.zeros((4, 4), np.int32), (4, 4), "float32", 2, "S0 R")
    check_shard(np.zeros((4, 4), np.int16), (4, 4), "bfloat16", 2, "S0 R")  # raw 2-byte items are fine for bfloat16
    with pytest.raises(PlanMismatchError, match="moves bfloat16"):
        check_shard(np.zeros((4, 4), np.float32), (4, 4), "bfloat16", 2, "S0 R")
    assert storage_dtype("float8_e4m3fn") == np.uint8
    with pytest.raises(PlanMismatchError, match=r"non-native byte order; pass a native-order array"):
        check_shard(np.zeros((4, 4), ">f4"), (4, 4), "float32", 2, "S0 R")


@pytest.mark.parametrize("plan_dtype, other", [("bfloat16", np.float16), ("float8_e4m3fn", np.bool_),
                                               ("float8_e4m3fn", "float8_e5m2"), ("bfloat16", "float8_e5m2")])
def test_raw_kinds_take_their_own_type_or_a_same_size_integer_only(plan_dtype, other):
    """A float16 array for a bfloat16 shard (or another FP8 kind, or bool) has the item size but other bits: refused,
    as the torch engine refuses it, for sources and for into= destinations alike."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    other = np.dtype(getattr(ml_dtypes, other) if isinstance(other, str) else other)
    size = np.dtype(getattr(ml_dtypes, plan_dtype)).itemsize
    for ok in (getattr(ml_dtypes, plan_dtype), f"u{size}", f"i{size}"):
        check_shard(np.zeros((2, 2), ok), (2, 2), plan_dtype, 1, "S0 R")
        check_into(np.zeros((2, 2), ok), (2, 2), plan_dtype, 1, "w")
    with pytest.raises(PlanMismatchError, match=rf"source shard is {other} but the plan moves {plan_dtype}; pass a {plan_dtype}"):
        check_shard(np.zeros((2, 2), other), (2, 2), plan_dtype, 1, "S0 R")
    with pytest.raises(PlanMismatchError, match=rf"into\['w'\] on device 1 is {other} but the plan delivers {plan_dtype}; pass a {plan_dtype}"):
        check_into(np.zeros((2, 2), other), (2, 2), plan_dtype, 1, "w")


class _Tensor:
    """Something with DLPack only; `device` picks the DLPack device type (1 = CPU, 2 = CUDA)."""

    def __init__(self, array, device=1):
        self.array, self.device = array, device

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (self.device, 0)


def test_dlpack_input_is_used_without_a_copy_and_gpu_input_is_refused():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = as_host_array(_Tensor(base), 0)
    assert np.shares_memory(view, base) and view.shape == (3, 4)
    with pytest.raises(PlanMismatchError, match="got a GPU array .* use backend='nccl'"):
        as_host_array(_Tensor(base, device=2), 0)
    with pytest.raises(PlanMismatchError, match="pass a numpy array or an object with __dlpack__"):
        as_host_array([1, 2, 3], 0)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (pip install torch==2.13.0 to run it)")
def test_torch_tensors_are_taken_without_a_copy_bfloat16_and_float8_as_raw_bits():
    import torch

    for dtype, raw in ((torch.float32, np.float32), (torch.bfloat16, np.int16), (torch.float8_e4m3fn, np.uint8)):
        tensor = torch.zeros((3, 4), dtype=dtype)
        view = as_host_array(tensor, 0)
        assert view.dtype.itemsize == tensor.element_size() and view.shape == (3, 4)
        view[...] = 1  # writes through: the same memory, no copy
        assert (tensor.view(torch.uint8) != 0).any(), dtype
        assert view.dtype == raw or dtype == torch.float8_e4m3fn
    with pytest.raises(PlanMismatchError, match=r"device 5: numpy cannot import this Tensor through DLPack \(.*detach"):
        as_host_array(torch.zeros(3, requires_grad=True), 5)


def test_pattern_catches_a_single_flipped_bit():
    region, shape = ((1, 3), (0, 5)), (4, 5)
    for dtype in ("int8", "float16", "float32", "int64", "complex128"):
        shard = fill(region, shape, np.dtype(dtype)).copy()
        assert mismatches(shard, region, shape) == (0, None)
        shard.view(np.uint8).reshape(-1)[7] ^= 1
        bad, first = mismatches(shard, region, shape)
        assert bad == 1 and first[0] in (1, 2)


def test_scaling_keeps_the_plan_consistent_and_refuses_bad_factors():
    plan = load_plan("plans/case6.plan.json")
    factors = factors_for(plan, 16 << 20)
    scaled = scale_plan(plan, factors)
    assert scaled.problem.nbytes <= 16 << 20
    for device in plan_devices(scaled):
        lower(scaled, device)  # every box still inside its shards, every shard covered
    with pytest.raises(PlanMismatchError, match="scale factor 4 does not divide every box boundary of dim 0; use a divisor of 2"):
        scale_plan(plan, (4, 1, 1))


def _interpret_nccl(plan) -> dict[int, np.ndarray]:
    """Replay every device's NCCL call list with numpy: members of a group must issue matching calls."""
    problem, dtype = plan.problem, storage_dtype(plan.problem.dtype)
    programs = {d: nccl_program(lower(plan, d, tag_limit=2**20)) for d in plan_devices(plan)}
    src = {d: fill(b, problem.shape, dtype) for d, b in problem.blocks("src").items()}
    dst = {d: np.full(region_shape(b), 0xA5, np.uint8).view(dtype) if False else np.zeros(region_shape(b), dtype)
           for d, b in problem.blocks("dst").items()}
    for op in plan.operations:
        calls = {d: [c for c in p.actions if c.op == op.id] for d, p in programs.items()}
        for d, mine in calls.items():
            for c in mine:
                if isinstance(c, Copy):
                    dst[d][c.target.index] = src[d][c.source.index]
        bcasts = {d: [c for c in mine if isinstance(c, Bcast)] for d, mine in calls.items()}
        members = {d: b for d, b in bcasts.items() if b}
        if not members:
            continue
        count = {len(b) for b in members.values()}
        assert len(count) == 1, f"op {op.id}: members issue different numbers of calls"
        for k in range(count.pop()):
            group = {c.group for b in members.values() for c in [b[k]]}
            roots = {b[k].root for b in members.values()}
            sizes = {(b[k].box.nbytes, b[k].chunks) for b in members.values()}
            assert len(group) == 1 and len(roots) == 1 and len(sizes) == 1, f"op {op.id} call {k} disagrees"
            assert set(members) == set(group.pop())
            root = roots.pop()
            root_call = members[root][k]
            shard = src[root] if root_call.box.side == "src" else dst[root]
            payload = np.ascontiguousarray(shard[root_call.box.index])
            for d, b in members.items():
                if d != root:
                    dst[d][b[k].box.index] = payload
    return dst


@pytest.mark.parametrize("plan", all_fixed_plans() + [compiled(random_problem(s, exact=False), STRATEGIES[s % 4]) for s in range(12)],
                         ids=lambda p: f"{p.problem.name}-{p.strategy}")
def test_nccl_call_lists_deliver_every_shard(plan):
    for device, shard in _interpret_nccl(plan).items():
        bad, first = mismatches(shard, plan.problem.blocks("dst")[device], plan.problem.shape)
        assert bad == 0, f"device {device}: {bad} elements differ, first at {first}"


def test_communicator_groups_are_ordered_by_first_use_the_same_on_every_member():
    plan = compiled(fixed_problems()[3], "global_allgather")
    everyone = [tuple(sorted(op.dsts if op.kind == "allgather" else (op.src, *op.dsts))) for op in plan.operations]
    for device in plan_devices(plan):
        groups = communicator_groups(lower(plan, device, tag_limit=2**20).collectives)
        assert len(groups) == len(set(groups)) and all(list(g) == sorted(g) and device in g for g in groups)
        assert set(groups) == {g for g in everyone if device in g and len(g) > 1}
        first_use = [everyone.index(g) for g in groups]
        assert first_use == sorted(first_use)


def test_nccl_backend_without_cupy_says_what_to_install():
    from xmesh_plan.executor.nccl_engine import NcclEngine

    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is installed here; this test covers machines without it")
    except ImportError:
        pass
    plan = _plan()
    engine = NcclEngine(lower(plan, 0), None, {}, 1.0, (1e-5, 1e-4))
    with pytest.raises(BackendUnavailableError, match="pip install cupy-cuda12x"):
        engine.setup()


def test_written_box_index_finds_exactly_the_overlapping_boxes():
    """The vectorised overlap search in lowering agrees with a plain loop of `intersect`, empty boxes included."""
    from xmesh_plan.executor.lower import _Writes

    rng = np.random.default_rng(0)
    for ndim in (1, 2, 3):
        writes = _Writes(ndim)
        boxes = []
        for step in range(40):  # past the initial capacity of 16, so the arrays grow
            box = tuple(tuple(sorted(int(x) for x in rng.integers(0, 9, size=2))) for _ in range(ndim))
            writes.add(box, step, step / 2)
            boxes.append(box)
            query = tuple(tuple(sorted(int(x) for x in rng.integers(0, 9, size=2))) for _ in range(ndim))
            expect = [(intersect(b, query), k, k / 2) for k, b in enumerate(boxes) if intersect(b, query) is not None]
            assert writes.overlapping(query) == expect, (boxes, query)


@pytest.mark.parametrize("seed", range(20))
def test_flat_pieces_are_the_c_order_elements_of_a_range(seed):
    """Each piece of a chunk, read from the box, gives the chunk's elements in numpy's C order."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 5, size=rng.integers(1, 5)))
    box = np.arange(math.prod(shape)).reshape(shape)
    lo, hi = sorted(int(v) for v in rng.integers(0, box.size + 1, size=2))
    pieces = flat_pieces(shape, lo, hi)
    got = [box[tuple(slice(a, b) for a, b in piece)].reshape(-1) for piece in pieces]
    assert np.array_equal(np.concatenate(got) if got else np.empty(0, int), box.reshape(-1)[lo:hi])
    assert len(pieces) <= 2 * len(shape) - 1


def test_a_staged_box_sent_in_chunks_is_packed_and_unpacked_chunk_by_chunk():
    """A broadcast of a box that is not contiguous in either shard (case 9's `R S0 R -> R R S0`): the first
    chunk leaves after its own pack, and every receiver unpacks each chunk once it has arrived."""
    problem = build_problem({"name": "c9", "shape": [8, 8, 8], "dtype": "int32",
                             "src": {"mesh": "2x4", "spec": "R S0 R"}, "dst": {"mesh": "2x4", "spec": "R R S0"}})
    plan = compile_plan(problem, strategy="broadcast", solver="naive")
    plan = plan.model_copy(update={"operations": tuple(op.model_copy(update={"chunks": 3}) for op in plan.operations)})
    op = plan.operations[0]
    sender = lower(plan, op.src)
    packs = [s for s in sender.steps if s.op == op.id and s.action == "pack"]
    sends = [s for s in sender.steps if s.op == op.id and s.action == "send"]
    assert len(sends) == 3 and len(packs) > 3
    for send in sends:
        waited = [sender.steps[d] for d in send.deps]
        assert waited and all(w.action == "pack" for w in waited)
        assert sum(w.data.nbytes for w in waited) == send.data.nbytes  # its own chunk's bytes, no more
        assert min(w.data.start for w in waited) == send.data.start
    for device in op.dsts:
        steps = lower(plan, device).steps
        recvs = [s for s in steps if s.op == op.id and s.action == "recv"]
        unpacks = [s for s in steps if s.op == op.id and s.action == "unpack"]
        assert len(recvs) == 3 and all(len(u.deps) == 1 and steps[u.deps[0]].action == "recv" for u in unpacks)
        for recv in recvs:
            assert sum(u.data.nbytes for u in unpacks if u.deps == (recv.index,)) == recv.data.nbytes


def test_caller_views_need_no_numpy_2_module(monkeypatch):
    """into= arrays are remade over their raw bytes from their own shape and strides (any view: negative strides,
    transposed, sliced), also on NumPy 1.26, which has no numpy.lib.array_utils."""
    import sys

    from xmesh_plan.executor.mpi_engine import _caller_view

    monkeypatch.setitem(sys.modules, "numpy.lib.array_utils", None)  # importing it now fails, as on NumPy < 2
    whole = np.arange(7 * 9 * 4, dtype=np.int32).reshape(7, 9, 4)
    for view in (whole, whole[::-2, 1:8:3, ::-1], whole.transpose(2, 0, 1)[1:3], whole[2:2], whole[3, 4, 1:2]):
        remade = _caller_view(view, np.dtype(np.uint32))
        assert remade.shape == view.shape and remade.base is not view and np.array_equal(remade, view.view(np.uint32))
        remade[...] = 7
        assert (view == 7).all()
        whole[...] = np.arange(whole.size, dtype=np.int32).reshape(whole.shape)


def test_a_bad_order_or_plan_is_named_before_a_bad_comm():
    """The constructor refuses what every rank refuses alike (an unknown order, a plan naming a tensor it lacks)
    before it looks at `comm`, so the message names the first thing to fix rather than the communicator."""
    from xmesh_plan.executor import TransferExecutor
    from xmesh_plan.schemas import read_plan_file

    one = read_plan_file("plans/case1.plan.json")
    many = read_plan_file("plans/weight_sync_small.plan.json")
    for make in (lambda: ReshardingExecutor(one, object(), order="bogus"),
                 lambda: TransferExecutor(many, object(), order="bogus")):
        with pytest.raises(ValueError, match="order 'bogus' is unknown"):
            make()
    ops = list(many.operations)
    ops[0] = ops[0].model_copy(update={"tensor": len(many.problem.tensors) + 6})
    bad = many.model_copy(update={"operations": tuple(ops)})
    with pytest.raises(PlanMismatchError, match=f"names tensor {len(many.problem.tensors) + 6}"):
        TransferExecutor(bad, object())
    with pytest.raises(TypeError, match="comm is a object"):
        TransferExecutor(many, object())


def test_a_moved_step_keeps_every_field_but_its_index_deps_and_data():
    """`Step.at` lists `Step`'s fields by hand (`dataclasses.replace` costs ten times more): every field, one added
    later included, keeps its value; only `index`, `deps` and `data` change (`moved`: `index` and `deps`)."""
    import dataclasses

    from xmesh_plan.executor.lower import Step

    names = [f.name for f in dataclasses.fields(Step)]
    step = Step(**{name: ("value of", name) for name in names})  # a distinct value each, none a default
    moved, at = step.moved(7, (1, 2)), step.at(8, (3,), "bytes")
    assert (moved.index, moved.deps, moved.data) == (7, (1, 2), ("value of", "data"))
    assert (at.index, at.deps, at.data) == (8, (3,), "bytes")
    for made in (moved, at):
        assert type(made) is Step
        assert {name: getattr(made, name) for name in names if name not in ("index", "deps", "data")} \
            == {name: ("value of", name) for name in names if name not in ("index", "deps", "data")}


@pytest.mark.parametrize("name", ["Step", "Bytes", "Box"])
def test_a_made_record_is_the_frozen_record_its_class_makes(name):
    """`lower.maker`: what it makes is the same frozen record the class makes from the same values (equal, same hash,
    of that class, still refusing assignment), every field set."""
    import dataclasses

    from xmesh_plan.executor import lower as lowering

    cls = getattr(lowering, name)
    values = [("value of", f.name) for f in dataclasses.fields(cls)]
    made = lowering.maker(cls)(*values)
    assert type(made) is cls and made == cls(*values) and hash(made) == hash(cls(*values))
    assert [getattr(made, f.name) for f in dataclasses.fields(cls)] == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, dataclasses.fields(cls)[0].name, 0)


def test_maker_refuses_a_class_whose_slots_are_not_its_fields():
    import dataclasses

    from xmesh_plan.executor.lower import maker

    @dataclasses.dataclass(frozen=True)
    class Loose:
        a: int

    with pytest.raises(TypeError, match="slots=True"):
        maker(Loose)


def test_what_a_paused_collector_block_made_is_in_the_oldest_generation_after_it():
    """`plan_file.collector_paused`: the collector is off in the block and back on after it, and the objects the block
    made are moved to the oldest generation, so the next young collection does not walk a rank's 10^6 steps."""
    import gc

    from xmesh_plan.executor.plan_file import collector_paused

    assert gc.isenabled()
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # no collection of its own moves what the block made while the test looks
    try:
        with collector_paused():
            assert not gc.isenabled()
            made = [[k] for k in range(1000)]  # lists: tracked by the collector
        assert gc.isenabled()
        young = {id(o) for o in gc.get_objects(generation=0)} | {id(o) for o in gc.get_objects(generation=1)}
        oldest = {id(o) for o in gc.get_objects(generation=2)}
    finally:
        gc.set_threshold(*thresholds)
    assert not any(id(o) in young for o in made)
    assert {id(o) for o in made} <= oldest


def test_maker_refuses_a_class_with_post_init():
    """`lower.maker` sets the fields and skips `__post_init__`: a class that checks its values there is refused."""
    import dataclasses

    from xmesh_plan.executor.lower import maker

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        start: int
        stop: int

        def __post_init__(self):
            if self.stop < self.start:
                raise ValueError("stop < start")

    with pytest.raises(TypeError, match="Checked.*__post_init__"):
        maker(Checked)


def test_a_paused_collector_block_keeps_what_the_caller_froze():
    """`plan_file.collector_paused` leaves `gc.freeze`'s permanent generation as the caller left it (the pre-fork
    copy-on-write idiom freezes everything before forking workers). The caller's frozen objects must stay out of the
    collector's generations (`gc.get_objects()` lists those, not the permanent one); the frozen count alone would also
    move when another thread (pytest-xdist's) frees a frozen object."""
    import gc

    from xmesh_plan.executor.plan_file import collector_paused

    kept = [[k] for k in range(100)]
    gc.freeze()
    try:
        assert gc.get_freeze_count() >= len(kept)
        with collector_paused():
            made = [[k] for k in range(100)]
        collected = {id(o) for o in gc.get_objects()}
        assert not ({id(kept)} | {id(k) for k in kept}) & collected
    finally:
        gc.unfreeze()
    assert made and kept


def test_garbage_made_before_a_paused_collector_block_goes_in_a_young_collection_after_it():
    """`plan_file.collector_paused` does not promote the caller's young cyclic garbage to the oldest generation, where
    only a full collection (which may not come for a long time) would free it."""
    import gc
    import weakref

    from xmesh_plan.executor.plan_file import collector_paused

    class Node:
        def __init__(self):
            self.me = self

    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # no automatic collection moves the cycle while the test looks
    try:
        node = Node()
        alive = weakref.ref(node)
        del node
        with collector_paused():
            pass
        gc.collect(1)
    finally:
        gc.set_threshold(*thresholds)
    assert alive() is None


def test_a_shared_message_s_parts_received_twice_are_refused_naming_the_operation_and_the_box():
    """The lowering's own replay (`_Builder.check_received_once`) of a part whose shared messages bring a device its
    pieces again (their bundles listed a second time, under new ids) names the first operation that repeats a box."""
    from dataclasses import replace

    from xmesh_plan.executor.lower import _lower
    from xmesh_plan.executor.plan_index import device_ops
    from tests.support.transfer import random_transfer

    plan = compile_plan(random_transfer(0, max_devices=8), strategy="auto", seed=0)
    ops = device_ops(plan, 7)
    shared = [k for k, op in enumerate(ops.operations) if op.id in ops.shared]
    assert shared  # device 7 needs pieces of a shared message
    top = max(op.id for op in plan.operations) + 1
    again = tuple(ops.operations[k].model_copy(update={"id": top + j}) for j, k in enumerate(shared))
    twice = replace(ops, operations=ops.operations + again, rows=ops.rows + tuple(range(len(again))),
                    first_tags=ops.first_tags + tuple(ops.first_tags[k] for k in shared), shared=ops.shared | {op.id for op in again})
    blocks = [(p.blocks("src").get(7), p.blocks("dst").get(7)) for p in plan.problem.tensor_problems()]
    _lower(ops, 7, None, blocks, False, True)  # once: every box once
    with pytest.raises(PlanMismatchError, match=re.escape(f"operation {again[1].id} (tensor 0, task 0, bundle): device 7 receives [3:6, 0:9] a second time")):
        _lower(twice, 7, None, blocks, False, True)


def test_a_box_received_twice_is_named_wherever_it_lies_in_an_operations_list():
    """`_Builder.check_received_once` walks every box each operation received, not only its first: a repeat in the
    second box of a later operation, or inside one operation's list, is refused and named; distinct boxes pass."""
    from types import SimpleNamespace

    from xmesh_plan.executor.lower import _Builder

    class Refused(Exception):
        pass

    def fail(op, message):
        raise Refused(f"{op}: {message}")

    builder = SimpleNamespace(device=7, fail=fail)

    def check(received):
        tensor = SimpleNamespace(shards=SimpleNamespace(dst_block=((0, 4), (0, 4))), ndim=2, received=received,
                                 received_elements=999)
        _Builder.check_received_once(builder, tensor)

    with pytest.raises(Refused, match=r"op2: device 7 receives .* a second time"):
        check([("op1", (((0, 2), (0, 4)),)), ("op2", [((2, 4), (0, 4)), ((0, 1), (0, 4))])])
    with pytest.raises(Refused, match=r"op1: device 7 receives .* a second time"):
        check([("op1", [((0, 2), (0, 4)), ((1, 3), (0, 4))])])
    check([("op1", [((0, 2), (0, 4))]), ("op2", (((2, 4), (0, 4)),))])
