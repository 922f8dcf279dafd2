"""The CuPy NCCL engine converting at the sender and writing the caller's arrays in place, on the fake CuPy of
tests/support/fake_gpu.py (every rank's `TransferExecutor(backend='nccl')` in this process, torch's casts on CPU queued
on each engine's stream as the GPU would run them).

Conversion: the plans of tests/test_convert_torch.py and tests/test_convert_mpi.py (fp16, bf16, FP8 with block and
per-tensor scales; sends, broadcasts, bundles and local copies of converted tensors; per-tensor scales over replicated
and uneven senders, whose amaxes an all-reduce joins), every destination element and every delivered scale bit for
bit against torch's own cast of the whole tensor (`weight_sync_demo.cast_reference`), in device and posted order.
`into`: views of larger fake-GPU parents (rows, columns, every other element), converting plans included, every byte
as the engine's own buffers receive it, nothing outside the views written, no own buffer made, no reference kept;
host, wrong-GPU, wrong-shape and wrong-dtype arrays refused in one line naming the tensor.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from tests.support.fake_gpu import FakeArray, FakeGpu, drive, fake_nccl_transfer
from tests.support.real_gpu import GPU_REASON
from xmesh_plan.executor import PlanMismatchError
from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.nccl_engine import NcclEngine
from xmesh_plan.executor.nccl_plan import AmaxMax, nccl_program
from xmesh_plan.executor.lower import lower
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.transfer_io import build_transfer

torch = pytest.importorskip("torch")
from tests.workers.convert_worker import HOOKS, REPLICATED4, bits, box_of, cut, reference, whole  # noqa: E402
from tests.workers.into_mpi_worker import THREE  # noqa: E402
from tests.support.torch_views import parent_and_view as parent_and_view_torch  # noqa: E402

SENTINEL = 0x5A
LAYOUTS = ("rows", "columns", "every_other")


def host_bits(tensor) -> np.ndarray:
    """A CPU tensor as numpy, bfloat16 and FP8 as their bits (numpy has neither type), as a caller hands them in."""
    tensor = tensor.contiguous()
    if tensor.dtype in (torch.float16, torch.float32, torch.float64):
        return tensor.numpy()
    return tensor.view({2: torch.int16, 1: torch.uint8}[tensor.element_size()]).numpy()


def sync(executors, gpu, shards, into=None) -> list[dict]:
    """One reshard through every rank's executor: `shards(ex)` its sources, `into(ex)` its caller's arrays (or None)."""
    for ex in executors:
        gpu.process = ex.device
        ex.start(shards(ex), into=None if into is None else into(ex))
    drive(executors, gpu)
    out = []
    for ex in executors:
        gpu.process = ex.device
        out.append(ex.wait())
    return out


def converted_wrong(plan, executors, gpu, step: int) -> list[str]:
    """Run `plan` once with the values of `step`; every destination element and scale that differs from torch's own
    cast of the whole tensor, as 'device: name' lines."""
    problem = plan.problem
    fulls = {t.name: whole(t.name, t.shape, t.dtype, step) for t in problem.tensors if t.scale_of is None}

    def shards(ex):
        return {name: host_bits(cut(full, box_of(problem, name, "src", ex.device)))
                for name, full in fulls.items() if box_of(problem, name, "src", ex.device) is not None}

    outs = sync(executors, gpu, shards)
    wrong = []
    for ex, out in zip(executors, outs):
        for t in problem.tensors:
            if t.scale_of is not None:
                continue
            values, scales = reference(t, fulls[t.name])
            for name, want in ((t.name, values), (t.name + ".scale", scales)):
                box = box_of(problem, name, "dst", ex.device) if want is not None else None
                if box is None:
                    continue
                got = np.asarray(out[name])
                expected = bits(cut(want, box)).numpy().reshape(-1)
                if got.dtype != storage_dtype(str(want.dtype).removeprefix("torch.")) or \
                        not np.array_equal(np.ascontiguousarray(got).view(np.uint8).reshape(-1), expected):
                    wrong.append(f"device {ex.device}: {name}")
    return wrong


PLANS = {"hooks": HOOKS, "replicated": REPLICATED4}


@pytest.mark.parametrize("order", ["device", "posted"])
@pytest.mark.parametrize("which", list(PLANS))
def test_conversion_at_the_sender_is_bit_exact_against_torch_on_fake_nccl(which, order, monkeypatch):
    plan = compile_plan(build_transfer(PLANS[which]))
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch, order=order)
    for step in range(2):
        assert converted_wrong(plan, executors, gpu, step) == [], step
    if which == "replicated":  # the per-tensor scales' amaxes went through one all-reduce per set of senders
        reduces = [entry for entry in gpu.log if entry[0] == "allReduce"]
        assert reduces and {entry[1:] for entry in reduces} == {("int",) * 6}
    for ex in executors:
        gpu.process = ex.device
        ex.close()


def test_without_the_amax_all_reduce_per_tensor_scales_differ(monkeypatch):
    """The check above can fail: with the all-reduce left out, a sender scales by its own amax alone."""
    plan = compile_plan(build_transfer(REPLICATED4))
    gpu = FakeGpu(api=14).install(monkeypatch)
    monkeypatch.setattr(NcclEngine, "_reduce", lambda self, call: None)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    wrong = converted_wrong(plan, executors, gpu, 0)
    assert "device 2: u" in wrong and "device 2: u.scale" in wrong, wrong


TWO_SENDERS = {"src_mesh": {"shape": [2], "devices": [0, 1]}, "dst_mesh": {"shape": [1], "devices": [2]},
               "tensors": [{"name": "w", "shape": [4, 4], "src": "S0 R", "dst": "R R", "dst_dtype": "fp8", "scale": "tensor"}]}


def test_a_nan_in_one_senders_shard_gives_a_nan_scale_as_torchs_amax_does(monkeypatch):
    """NCCL's float max drops a NaN (fmaxf; the fake's does too): the engine all-reduces the amaxes' bits, so a NaN in
    one sender's shard reaches the per-tensor scale as it does torch's amax of the whole tensor (the torch and MPI
    engines' maximum)."""
    from xmesh_plan.executor import convert

    plan = compile_plan(build_transfer(TWO_SENDERS))
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    full = np.arange(16, dtype=np.float32).reshape(4, 4) + 1
    full[0, 0] = np.nan  # device 0's shard only
    blocks = plan.problem.tensor_problem(0).blocks("src")
    outs = sync(executors, gpu, lambda ex: {"w": np.ascontiguousarray(full[slice(*blocks[ex.device][0])])}
                if ex.device in blocks else None)
    want = convert.tensor_scale(convert.amax(torch.from_numpy(full)), "float8_e4m3fn")
    assert want.isnan().all() and np.isnan(np.asarray(outs[2]["w.scale"])).all(), outs[2]["w.scale"]


def test_an_amax_all_reduce_is_given_no_tensors_shards(monkeypatch):
    """The all-reduces of the amaxes belong to no tensor: each goes to `_reduce` alone, never through `_call` with some
    tensor's source, destination and dtype; every other call goes through `_call` with its own tensor's."""
    plan = compile_plan(build_transfer(REPLICATED4))
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    seen = []
    call = NcclEngine._call
    monkeypatch.setattr(NcclEngine, "_call", lambda self, i, c, *rest: seen.append(type(c).__name__) or call(self, i, c, *rest))
    assert converted_wrong(plan, executors, gpu, 0) == []
    reduces = sum(isinstance(c, AmaxMax) for ex in executors for c in ex.engine.calls.actions)
    assert reduces and "AmaxMax" not in seen and len(seen) == sum(len(ex.engine.calls.actions) for ex in executors) - reduces


def one_tensor_cast(monkeypatch, api: int):
    """A one-tensor float32 -> bf16 reshard on 4 devices, run by fake CuPy `api`: (plan's problem, its whole values,
    the fake GPU, every rank's executor)."""
    mesh = {"shape": [4], "devices": [0, 1, 2, 3]}
    plan = compile_plan(build_problem({"shape": [8, 6], "dtype": "float32", "dst_dtype": "bf16", "src": {"mesh": mesh, "spec": "S0 R"},
                                       "dst": {"mesh": mesh, "spec": "R S0"}}))
    gpu = FakeGpu(api=api).install(monkeypatch)
    return plan.problem, whole("single", plan.problem.shape, "float32", 0), gpu, fake_nccl_transfer(plan, gpu, monkeypatch)


def test_a_one_tensor_cast_is_bit_exact_on_fake_nccl(monkeypatch):
    problem, full, gpu, executors = one_tensor_cast(monkeypatch, 13)
    outs = sync(executors, gpu, lambda ex: {ex.names[0]: host_bits(cut(full, problem.blocks("src")[ex.device]))})
    want = full.to(torch.bfloat16)
    for ex, out in zip(executors, outs):
        got = np.asarray(out[ex.names[0]])
        assert got.dtype == np.uint16 and np.array_equal(got.view(np.uint8).reshape(-1),
                                                         bits(cut(want, problem.blocks("dst")[ex.device])).numpy().reshape(-1))


def late_sources_wrong(monkeypatch) -> list[int]:
    """A one-tensor bf16 cast whose source shards are written by a kernel still queued on the caller's stream when
    start() is called: the devices whose destination differs from torch's cast of the whole tensor."""
    problem, full, gpu, executors = one_tensor_cast(monkeypatch, 14)
    for ex in executors:
        gpu.process = ex.device
        box = problem.blocks("src")[ex.device]
        src = gpu.cupy.empty(tuple(b - a for a, b in box), np.float32)
        src[...] = 0
        producer = gpu.cupy.cuda.Stream(non_blocking=True)
        with producer:  # the caller's kernel writing the shard, still queued when start() is called
            producer.enqueue(("host", lambda src=src, values=cut(full, box).numpy(): src.__setitem__(..., values)))
            ex.start({ex.names[0]: src})
    drive(executors, gpu)
    want, wrong = full.to(torch.bfloat16), []
    for ex in executors:
        gpu.process = ex.device
        got = np.asarray(ex.wait()[ex.names[0]]).view(np.uint8).reshape(-1)
        if not np.array_equal(got, bits(cut(want, problem.blocks("dst")[ex.device])).numpy().reshape(-1)):
            wrong.append(ex.device)
    return wrong


def test_casts_wait_for_the_sources_written_on_the_callers_stream(monkeypatch):
    """Torch's casts queue behind the work on the caller's stream at start() (`input_ready`), as the calls do; the same
    with each cast run at once, off the stream, reads the stale shards and fails."""
    import tests.support.fake_gpu as fake_gpu

    assert late_sources_wrong(monkeypatch) == []
    monkeypatch.setattr(fake_gpu.FakeTorchOnStream, "run", lambda self, fn: fn())
    assert late_sources_wrong(monkeypatch) != []


def test_amax_all_reduces_come_first_alike_on_every_sender():
    """One all-reduce per set of senders, before every call of the plan, with the same op on each member (its
    communicator's unique id travels with that tag)."""
    plan = compile_plan(build_transfer(REPLICATED4))
    seen = {}
    for device in range(4):
        actions = nccl_program(lower(plan, device)).actions
        reduces = [a for a in actions if isinstance(a, AmaxMax)]
        assert actions[:len(reduces)] == tuple(reduces)
        for a in reduces:
            seen.setdefault((a.group, a.tensors, a.op), set()).add(device)
    assert seen and all(members == set(group) for (group, _, _), members in seen.items())


# ---------------------------------------------------------------------------------------------
# into: the caller's arrays written in place
# ---------------------------------------------------------------------------------------------

def parent_and_view(gpu, shape, dtype, layout: str):
    """(fake-GPU uint8 parent, the index of the view's bytes in it, the typed view of `shape`) for `layout`."""
    size = np.dtype(dtype).itemsize
    if 0 in shape:
        return gpu.wrap(np.empty(0, np.uint8)), (slice(0, 0),), gpu.wrap(np.empty(shape, dtype))
    if layout == "rows":  # two rows before, one after: contiguous at an offset
        if len(shape) == 1:
            raw = gpu.wrap(np.full(((shape[0] + 3) * size,), SENTINEL, np.uint8))
            return raw, (slice(2 * size, (2 + shape[0]) * size),), raw.view(dtype)[2:2 + shape[0]]
        raw = gpu.wrap(np.full((shape[0] + 3,) + tuple(shape[1:-1]) + (shape[-1] * size,), SENTINEL, np.uint8))
        return raw, (slice(2, 2 + shape[0]),), raw.view(dtype)[2:2 + shape[0]]
    if layout == "columns":  # each row one run of memory
        raw = gpu.wrap(np.full(tuple(shape[:-1]) + ((shape[-1] + 2) * size,), SENTINEL, np.uint8))
        return raw, (..., slice(size, (1 + shape[-1]) * size)), raw.view(dtype)[..., 1:1 + shape[-1]]
    raw = gpu.wrap(np.full(tuple(shape) + (2 * size,), SENTINEL, np.uint8))  # every other element
    return raw, (..., slice(size, 2 * size)), raw.view(dtype)[..., 1]


def random_sources(ex, seed: int) -> dict:
    rng = np.random.default_rng(seed + ex.device)
    out = {}
    for name, t in zip(ex.names, ex.program.tensors):
        if t.given_shape is not None:
            values = rng.standard_normal(t.given_shape) * 100
            if t.dtype == "float32":
                out[name] = values.astype(np.float32)
            elif t.dtype == "bfloat16":  # the top half of float32's bits
                out[name] = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            else:
                out[name] = rng.integers(0, 2**15, t.given_shape).astype(storage_dtype(t.dtype))
    return out


INTO_PLANS = {
    "three broadcast": lambda: compile_plan(build_transfer(THREE), strategy="broadcast", solver="greedy", split_hosts=False, coalesce=False),
    "three local_allgather": lambda: compile_plan(build_transfer(THREE), strategy="local_allgather", solver="greedy",
                                                  split_hosts=False, coalesce=False),
    "three bundles": lambda: compile_plan(build_transfer(THREE), strategy="auto", solver="greedy"),
    "converting": lambda: compile_plan(build_transfer(HOOKS)),
    "one tensor": lambda: compile_plan(build_problem({"shape": [8, 6], "dtype": "float32", "dst_dtype": "bf16",
                                                      "src": {"mesh": {"shape": [2], "devices": [0, 1]}, "spec": "S0 R"},
                                                      "dst": {"mesh": {"shape": [3], "devices": [1, 2, 3]}, "spec": "R S0"}})),
}


@pytest.mark.parametrize("order", ["device", "posted"])
@pytest.mark.parametrize("label", list(INTO_PLANS))
def test_views_of_the_callers_arrays_receive_in_place_on_fake_nccl(label, order, monkeypatch):
    """Each layout's views are written in place, twice into the same parents and once into new ones, before any call
    into the engine's own buffers: none is made meanwhile; then a call into its own buffers gives the same bytes."""
    plan = INTO_PLANS[label]()
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch, order=order)
    sources = {ex.device: random_sources(ex, 11) for ex in executors}
    seen, wrong = {}, []
    for layout in LAYOUTS:
        parents = {}
        for attempt in range(3):
            if attempt != 1:
                parents = {}
                for ex in executors:
                    gpu.process = ex.device
                    parents[ex.device] = {name: parent_and_view(gpu, t.dst_shape, ex.engine.dtypes[k], layout)
                                          for k, (name, t) in enumerate(zip(ex.names, ex.program.tensors)) if t.dst_shape is not None}
            outs = sync(executors, gpu, lambda ex: sources[ex.device],
                        lambda ex: {name: view for name, (_, _, view) in parents[ex.device].items()} or None)
            for ex, out in zip(executors, outs):
                for name, (raw, index, view) in parents[ex.device].items():
                    if out[name] is not view:
                        wrong.append(f"{layout} device {ex.device} {name}: run() returned another array")
                    got = np.ascontiguousarray(np.asarray(raw)[index]).reshape(-1)
                    seen.setdefault((ex.device, name), []).append((layout, got))
                    rest = np.array(raw)
                    rest[index] = SENTINEL
                    if not (rest == SENTINEL).all():
                        wrong.append(f"{layout} device {ex.device} {name}: bytes outside the view written")
                    if ex.engine.dsts[ex.names.index(name)] is not None:
                        wrong.append(f"{layout} device {ex.device} {name}: the engine made its own buffer")
            if attempt == 2:
                refs = [weakref.ref(raw) for mine in parents.values() for raw, _, _ in mine.values()]
                parents = outs = out = raw = index = view = None
                gc.collect()
                if any(ref() is not None for ref in refs):
                    wrong.append(f"{layout}: the engine keeps the caller's array alive")
    own = sync(executors, gpu, lambda ex: sources[ex.device])
    for ex, out in zip(executors, own):
        for name, t in zip(ex.names, ex.program.tensors):
            if t.dst_shape is None:
                continue
            want = np.ascontiguousarray(np.asarray(out[name])).view(np.uint8).reshape(-1)
            assert want.size == 0 or not (want == SENTINEL).all()
            for layout, got in seen[(ex.device, name)]:
                if not np.array_equal(got, want):
                    wrong.append(f"{layout} device {ex.device} {name}: {int((got != want).sum())} bytes differ from the own run")
    assert wrong == []
    for ex in executors:
        gpu.process = ex.device
        ex.close()


def test_a_strided_destination_goes_through_one_shadow_kept_across_calls(monkeypatch):
    """Every other element: no broadcast is one run of it, so each lands in the shadow (made once, the size of the
    largest such box) and is unpacked on the stream."""
    plan = INTO_PLANS["three broadcast"]()
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    sources = {ex.device: random_sources(ex, 3) for ex in executors}
    made = []
    for _ in range(2):
        views = {}
        for ex in executors:
            gpu.process = ex.device
            views[ex.device] = {name: parent_and_view(gpu, t.dst_shape, ex.engine.dtypes[k], "every_other")[2]
                                for k, (name, t) in enumerate(zip(ex.names, ex.program.tensors)) if t.dst_shape is not None}
        sync(executors, gpu, lambda ex: sources[ex.device], lambda ex: views[ex.device] or None)
        made.append({ex.device: ex.engine.shadow.data.ptr for ex in executors if ex.engine.shadow.nbytes})
    assert made[0] and made[0] == made[1]


def test_into_is_refused_in_one_line_naming_the_tensor_and_the_fix(monkeypatch):
    plan = INTO_PLANS["three broadcast"]()
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    ex = next(e for e in executors if e.program.tensors[0].dst_shape is not None)
    gpu.process = ex.device
    shape, dtype = ex.program.tensors[0].dst_shape, ex.engine.dtypes[0]
    gpu.cupy.cuda.Device(3).use()
    elsewhere = gpu.cupy.empty(shape, dtype)
    gpu.cupy.cuda.Device(ex.engine.gpu).use()
    cases = {"in host memory, which the nccl backend cannot write in place; pass a CuPy array or a CUDA tensor on GPU":
             np.zeros(shape, dtype),
             "is on GPU 3 but this rank runs on GPU": elsewhere,
             "has shape": gpu.cupy.empty(tuple(n + 1 for n in shape), dtype),
             "is float64 but the plan delivers float32": gpu.cupy.empty(shape, np.float64)}
    for expected, array in cases.items():
        with pytest.raises(PlanMismatchError) as refused:
            ex.start(random_sources(ex, 0) or None, into={"w": array})
        text = str(refused.value)
        assert "\n" not in text and "into['w']" in text and expected in text, text
        assert not ex.in_flight
    assert isinstance(elsewhere, FakeArray)


SWAP = {"shape": [8], "dtype": "float32", "src": {"mesh": {"shape": [2], "devices": [0, 1]}, "spec": "S0"},
        "dst": {"mesh": {"shape": [2], "devices": [1, 0]}, "spec": "S0"}}


def test_into_sharing_memory_is_refused_as_on_mpi(monkeypatch):
    """Each device sends its source and receives the other's: an into that is its own source (a broadcast would land
    in it before the other broadcast reads it), one sharing a row with another tensor's into, and one whose elements
    share memory (a zero stride) are refused naming the tensor, as the MPI engine refuses them (`executor.apart`)."""
    plan = compile_plan(build_problem(SWAP))
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    ex = executors[1]
    gpu.process = ex.device
    name = ex.names[0]
    source = gpu.cupy.asarray(np.arange(4, dtype=np.float32))
    row = gpu.cupy.empty((1, 4), np.float32)
    for expected, into in {"shares memory with the source shard of": source[::-1],
                           "has elements sharing memory": np.lib.stride_tricks.as_strided(row, (4,), (0,), subok=True)}.items():
        with pytest.raises(PlanMismatchError, match=expected) as refused:
            ex.start({name: source}, into={name: into})
        assert f"into[{name!r}] on device 1" in str(refused.value) and not ex.in_flight
    two = compile_plan(build_transfer({"src_mesh": SWAP["src"]["mesh"], "dst_mesh": SWAP["dst"]["mesh"], "dtype": "float32",
                                       "tensors": [{"name": n, "shape": [8], "src": "S0", "dst": "S0"} for n in "ab"]}))
    gpu = FakeGpu(api=14).install(monkeypatch)
    ex = fake_nccl_transfer(two, gpu, monkeypatch)[0]
    gpu.process = ex.device
    both = gpu.cupy.empty(6, np.float32)
    with pytest.raises(PlanMismatchError, match=r"into\['b'\] on device 0 shares memory with into\['a'\]"):
        ex.start({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}, into={"a": both[:4], "b": both[2:]})


def test_torch_tensors_sharing_memory_are_refused_as_numpy_arrays_are():
    """`executor.apart` reads a torch tensor's layout (data_ptr, strides in elements), as the torch engine's
    `check_into` and `check_apart` hand it: interleaved halves share nothing, overlapping ones are refused."""
    from xmesh_plan.executor.apart import overlaps_itself, refuse_shared
    from xmesh_plan.executor.torch_engine import TorchEngine

    wide = torch.zeros(8, 9, dtype=torch.bfloat16)
    TorchEngine.check_apart({"a": wide[:, :4], "b": wide[:, 4:]}, {"c": None}, 0)
    TorchEngine.check_apart({"a": wide[::2]}, {"b": wide[1::2]}, 0)
    with pytest.raises(PlanMismatchError, match=r"into\['a'\] on device 0 shares memory with the source shard of 'b'"):
        refuse_shared({"a": wide[:, :5]}, {"b": wide[:, 4:]}, 0)
    assert not overlaps_itself(wide.t()[::3]) and overlaps_itself(torch.zeros(3).expand(2, 3))


# ---------------------------------------------------------------------------------------------
# bench/gpu/convert_check.py, the check run on a real GPU, on the fake
# ---------------------------------------------------------------------------------------------

def gpu_check_module():
    import importlib.util

    from tests.support.launch import ROOT

    spec = importlib.util.spec_from_file_location("convert_check", ROOT / "bench" / "gpu" / "convert_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_convert_check_passes_on_fake_nccl_and_sees_a_wrong_byte(monkeypatch):
    """What bench/gpu/convert_check.sh runs on each of its 4 ranks (their runs joined here by `sync`, CUDA tensors
    replaced by the fake's memory): every check ok, 13 per rank (the count the script expects); a byte changed in a
    destination, or values of another step, are reported."""
    cc = gpu_check_module()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cc, "to_gpu", host_bits)
    ok, caught = 0, set()
    for label, order, into in cc.CHECKS:
        with monkeypatch.context() as m:
            gpu = FakeGpu(api=14).install(m)

            def fake_view(t, layout, gpu=gpu):
                raw, index, view = parent_and_view(gpu, t.dst_shape, storage_dtype(t.dst_dtype), layout)
                return torch.from_numpy(np.asarray(raw)), index, view

            m.setattr(cc, "cuda_view", fake_view)
            executors = fake_nccl_transfer(cc.PLANS[label](), gpu, m, order=order)
            for step in range(2):
                made = {}
                for ex in executors:
                    gpu.process = ex.device
                    made[ex.device] = cc.given(ex, step)
                outs = sync(executors, gpu, lambda ex: made[ex.device][1])
                for ex, out in zip(executors, outs):
                    ok += cc.wrong_values(ex, gpu.cupy, out, made[ex.device][2]) == []
                    if step == 1 and any(t.dst_shape and 0 not in t.dst_shape for t in ex.program.tensors):  # not step 0's values
                        caught.add(("values", label, bool(cc.wrong_values(ex, gpu.cupy, out, cc.given(ex, 0)[2]))))
            if not into:
                continue
            shards = {}
            for ex in executors:
                gpu.process = ex.device
                shards[ex.device] = cc.given(ex, 7)[1]
            own = sync(executors, gpu, lambda ex: shards[ex.device])
            want = {ex.device: {name: cc.host_bytes(gpu.cupy, got) for name, got in out.items()} for ex, out in zip(executors, own)}
            wrong = {ex.device: [] for ex in executors}
            for layout in cc.LAYOUTS:
                held = {}
                for ex in executors:
                    gpu.process = ex.device
                    held[ex.device] = cc.parents(ex, layout)
                sync(executors, gpu, lambda ex: shards[ex.device],
                     lambda ex: {name: view for name, (_, _, view) in held[ex.device].items()} or None)
                for ex in executors:
                    wrong[ex.device] += cc.wrong_into(gpu.cupy, layout, held[ex.device], want[ex.device])
                    flipped = {name: b.copy() for name, b in want[ex.device].items() if b.size}
                    for b in flipped.values():
                        b[:1] ^= 1
                    if flipped:
                        caught.add(("into", label, bool(cc.wrong_into(gpu.cupy, layout, {n: held[ex.device][n] for n in flipped}, flipped))))
            ok += sum(not w for w in wrong.values())
    assert ok == 4 * 13 and {hit for _, _, hit in caught} == {True}, sorted(caught)
    import subprocess
    import sys

    from tests.support.launch import ROOT

    told = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "convert_check.py"), "--expected", "4"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert told.stdout.strip() == str(ok) == str(cc.expected_oks(4)), told.stderr[-2000:]  # what convert_check.sh expects



def test_conversion_without_torch_names_what_to_install(monkeypatch):
    import sys
    import types

    from xmesh_plan.executor.errors import BackendUnavailableError
    from xmesh_plan.executor.nccl_convert import TorchOnStream

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"torch's own casts .* pip install torch, or compile the plan without dst_dtype"):
        TorchOnStream(types.SimpleNamespace(ptr=1), 0)


def test_a_device_that_casts_nothing_needs_no_torch_and_one_that_casts_learns_before_any_communicator(monkeypatch):
    """Device 3 of REPLICATED4 only receives converted bytes: it makes no casts (torch is imported only for them) and
    `prepare()` needs no torch there; on a sender, torch missing is refused in prepare() before the ranks agree, so no
    communicator is made (its peers learn of it from the agreement, instead of waiting for its unique ids)."""
    import sys

    from xmesh_plan.executor.errors import BackendUnavailableError
    from xmesh_plan.executor.nccl_convert import requires

    plan = compile_plan(build_transfer(REPLICATED4))
    gpu = FakeGpu(api=14).install(monkeypatch)
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    assert [ex.engine.casts is None for ex in executors] == [False, False, False, True]
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    requires(lower(plan, 3))
    with pytest.raises(BackendUnavailableError, match="pip install torch"):
        requires(lower(plan, 0))
    gpu = FakeGpu(api=14).install(monkeypatch)
    with pytest.raises(BackendUnavailableError, match="pip install torch"):
        fake_nccl_transfer(plan, gpu, monkeypatch)
    assert not any(entry[0] == "NcclCommunicator" for entry in gpu.log) and not gpu.streams


def test_torch_tensors_in_and_out_go_through_dlpack_as_their_bits(monkeypatch):
    """Sources and `into` views handed in as torch tensors (bfloat16 among them, which CuPy may not import) reach the
    engine as CuPy views of their bits without a copy (here: torch CPU tensors taken for CUDA ones, imported by the
    fake's `from_dlpack`): the views receive the bytes a run from numpy sources into the own buffers gives."""
    import xmesh_plan.executor.nccl_engine as nccl_engine

    plan = INTO_PLANS["three broadcast"]()
    gpu = FakeGpu(api=14).install(monkeypatch)
    monkeypatch.setattr(nccl_engine, "is_device_array", lambda array: isinstance(array, torch.Tensor))
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    sources = {ex.device: random_sources(ex, 5) for ex in executors}
    own = sync(executors, gpu, lambda ex: sources[ex.device])
    want = [{name: np.ascontiguousarray(np.asarray(got)).view(np.uint8).reshape(-1) for name, got in out.items()} for out in own]

    def as_torch(ex):
        return {name: torch.from_numpy(shard).view(getattr(torch, ex.problems[ex.names.index(name)].dtype))
                for name, shard in sources[ex.device].items()}

    for layout in ("rows", "every_other"):
        parents = {}
        for ex in executors:
            parents[ex.device] = {}
            for name, t in zip(ex.names, ex.program.tensors):
                if t.dst_shape is not None:
                    raw, index, view = parent_and_view_torch(t.dst_shape, getattr(torch, t.dst_dtype), layout)
                    parents[ex.device][name] = (raw, index, view)
        assert any(view.dtype == torch.bfloat16 for mine in parents.values() for _, _, view in mine.values())
        sync(executors, gpu, as_torch, lambda ex: {name: view for name, (_, _, view) in parents[ex.device].items()} or None)
        for ex, wanted in zip(executors, want):
            for name, (raw, index, _) in parents[ex.device].items():
                assert np.array_equal(raw[index].contiguous().numpy().reshape(-1), wanted[name]), (layout, ex.device, name)


def test_a_tensor_requiring_grad_is_read_as_a_source_and_refused_as_into_naming_detach(monkeypatch):
    """A Parameter (requires grad) of any float kind: as a source shard the engine reads its memory (a view, no copy);
    as `into` it is refused naming the tensor and the fix, float32 (which DLPack refuses to export) and bfloat16
    (which goes through an integer view) alike."""
    import xmesh_plan.executor.nccl_engine as nccl_engine

    plan = INTO_PLANS["three broadcast"]()
    gpu = FakeGpu(api=14).install(monkeypatch)
    monkeypatch.setattr(nccl_engine, "is_device_array", lambda array: isinstance(array, torch.Tensor))
    executors = fake_nccl_transfer(plan, gpu, monkeypatch)
    ex = next(e for e in executors if e.program.tensors[0].dst_shape is not None)
    gpu.process = ex.device
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        assert ex.engine.adopt(param).data.ptr == param.data_ptr()
        with pytest.raises(PlanMismatchError) as refused:
            ex.start(random_sources(ex, 0) or None, into={"w": param})
        text = str(refused.value)
        assert "into['w'] on device" in text and "requires grad" in text and "detach()" in text and "\n" not in text, text
        assert not ex.in_flight


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
def test_the_nccl_engine_converts_and_receives_into_bit_exact_on_one_gpu(tmp_path):
    """bench/gpu/convert_check.py itself on a real GPU, 4 ranks on GPU 0 (each its own NCCL host): every check ok."""
    from tests.support.launch import mpiexec

    expected = gpu_check_module().expected_oks(4)
    result = mpiexec(4, "-m", "bench.gpu.convert_check", str(tmp_path), timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert result.returncode == 0 and len(lines) == expected and all(line.endswith(": ok") for line in lines), \
        "\n".join(lines) + result.stderr[-3000:]
