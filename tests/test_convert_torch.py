"""Conversion at the sender run by the torch engine on gloo (`executor.conversions`, `executor.convert`): every hook a
sender has (a send straight from its shard, a broadcast's first hop and a staged box, a bundle's gather, a local copy)
casts before it packs, FP8 scales are computed by the senders and delivered as the plan's `.scale` tensors, and every
element lands bit for bit as torch's own `.to()` makes it from the whole tensor (tests/workers/convert_worker.py);
an engine that does not convert refuses the plan in one line naming one that does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xmesh_plan.executor.engines import ENGINES, EngineContext
from xmesh_plan.executor.errors import PlanMismatchError
from xmesh_plan.executor.lower import Action, lower
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.transfer_io import build_transfer
from tests.support.launch import ROOT, TORCH_LAUNCH_TIMEOUT_S, launch
from tests.workers.convert_worker import HOOKS

WORKER = ROOT / "tests" / "workers" / "convert_worker.py"


def test_the_hooks_plan_has_every_kind_of_sender_step_on_converted_tensors():
    """What the 4-rank run below covers: of converting tensors, sends straight from the shard, packs of staged boxes
    (broadcasts), packs of a bundle's parts (its gathers) and local copies; a per-tensor scale swapped between senders."""
    plan = compile_plan(build_transfer(HOOKS))
    converting = {k for k, t in enumerate(plan.problem.tensors) if t.dst_dtype is not None}
    seen = set()
    for device in range(4):
        program = lower(plan, device)
        for s in program.steps:
            if s.reads_src and s.tensor in converting:
                seen.add((s.action, s.kind))
        assert all(t.convert is None or t.dst_dtype == t.convert.dst_dtype for t in program.tensors)
    assert {(Action.SEND, "broadcast"), (Action.PACK, "broadcast"), (Action.PACK, "bundle"), (Action.COPY, "copy")} <= seen, seen
    assert lower(plan, 0).tensors[plan.problem.index_of("e")].convert.peers == (1,)


@pytest.mark.slow
@pytest.mark.timeout(2 * TORCH_LAUNCH_TIMEOUT_S)
def test_every_sender_hook_converts_bit_exact_on_4_gloo_ranks():
    lines = launch(4, "hooks", worker=WORKER)
    runs = ["device order", "device order, tag 0", "posted"]
    for rank in range(4):
        mine = [line.split(": ", 1)[1] for line in lines if line.startswith(f"rank {rank}:")]
        assert mine == [f"{run} step {k}: ok" for run in runs for k in (0, 1)] + ["one tensor: ok"], lines


@pytest.mark.slow
@pytest.mark.timeout(2 * TORCH_LAUNCH_TIMEOUT_S)
def test_per_tensor_scales_agree_over_replicated_and_uneven_sources_on_3_gloo_ranks():
    """Sources `R R` on three ranks and `S0 R` of 5 rows over three (2, 2, 1): each sender's amax differs, the scale is
    the max over all of them (a run without the swap delivers rank 2 wrong `u` values and scale)."""
    lines = launch(3, "replicated", worker=WORKER)
    assert sorted(lines) == sorted(f"rank {r}: replicated step {k}: ok" for r in range(3) for k in (0, 1)), lines


def test_an_engine_that_does_not_convert_refuses_the_plan_naming_one_that_does():
    """Every registered engine converts; an entry without `converts` (here the nccl one with it cleared) refuses."""
    from dataclasses import replace

    plan = compile_plan(build_problem({"shape": [8, 4], "dtype": "float32", "dst_dtype": "fp16", "src": {"mesh": "1x2", "spec": "S0 R"},
                                       "dst": {"mesh": "1x2", "spec": "R S0"}}), solver="greedy")
    program = lower(plan, 0)
    assert program.tensors[0].dst_dtype == "float16" and program.tensors[0].itemsize == 2
    assert all(entry.converts for entry in ENGINES.values())
    with pytest.raises(PlanMismatchError) as info:
        replace(ENGINES["nccl"], converts=False).make(program, EngineContext(None, {}, 1.0, (1e-3, 1e-2)))
    assert str(info.value) == ("the plan converts float32 to float16 at the sender, which the nccl engine does not run; run "
                               "it on the mpi or nccl or torch engine (backend='mpi' with an mpi4py communicator, or 'gloo' or "
                               "'nccl' with a torch process group) or compile the plan without dst_dtype")
    assert info.value.same_on_every_rank


def test_an_fp8_conversion_without_scales_is_refused_on_every_rank_alike():
    """A one-tensor problem made by hand (problem files refuse it) converting to FP8 has no scale tensor to carry scales."""
    from xmesh_plan.schemas import DeviceMesh, Placement, ReshardingProblem

    mesh = DeviceMesh(shape=(2,), devices=(0, 1))
    problem = ReshardingProblem(shape=(8, 4), dtype="float32", dst_dtype="float8_e4m3fn", src=Placement(mesh=mesh, spec="S0 R"),
                                dst=Placement(mesh=mesh, spec="R S0"))
    program = lower(compile_plan(problem, solver="greedy"), 1)
    with pytest.raises(PlanMismatchError, match=r"^the plan converts float32 to float8_e4m3fn without scales; give the tensor "
                                                r"scale = \"tensor\" or \"block\" in a multi-tensor problem") as info:
        ENGINES["torch"].make(program, EngineContext(None, {}, 1.0, (1e-3, 1e-2)))
    assert info.value.same_on_every_rank


def test_the_torch_demo_refuses_a_converting_plan_instead_of_checking_it_against_the_source_dtype():
    """`executor.torch_run` fills source patterns and compares destinations with them in the source dtype: a converting
    plan would report every element as differing, so it is refused in one line (every rank reads the same plan)."""
    from xmesh_plan.executor.torch_run import _scaled

    with pytest.raises(PlanMismatchError, match=r"^the plan converts float32 to float16 at the sender, and this command fills "
                                                r"and checks shards of the source dtype; run it with TransferExecutor") as info:
        _scaled(compile_plan(build_transfer(HOOKS)), 16.0)
    assert info.value.same_on_every_rank


def test_a_timeout_in_the_amax_swap_names_the_swap_and_its_peer():
    """The progress thread stuck in the senders' amax swap (per-tensor scales) with device 1: the timeout names that swap,
    not the plan's steps. The engine is built bare around a group whose receive never arrives (its wait raises, as gloo's
    does at its own deadline)."""
    from types import SimpleNamespace

    import torch

    from xmesh_plan.executor.errors import PeerTimeoutError
    from xmesh_plan.executor.torch_engine import TorchEngine

    class Work:
        def wait(self):
            raise RuntimeError("Timed out waiting 1000ms for recv operation to complete")

    group = SimpleNamespace(send=lambda *args: Work(), recv=lambda *args: Work())
    engine = TorchEngine.__new__(TorchEngine)
    engine.__dict__.update(torch=torch, group=group, program=SimpleNamespace(device=0), steps=[], peer_rank=[], works=[], rank=0,
                           context=SimpleNamespace(transport=SimpleNamespace(match_by_tag=True), rank_of={0: 0, 1: 3}),
                           amax_swaps=[(1, [0], torch.zeros(1), torch.zeros(1))], amax_peer=None, current=-1, timeout_s=1.0,
                           failure=None, broken=None, src=None, buffers=[])
    with pytest.raises(RuntimeError, match="Timed out"):
        engine._swap_amax({0: torch.tensor(2.0)})
    with pytest.raises(PeerTimeoutError, match=r"^device 0 \(rank 0\): nothing completed for 1 s; waiting on the amax swap of "
                                               r"per-tensor FP8 scales with device 1 \(rank 3\);"):
        engine.timed_out()


def test_a_dst_dtype_of_the_source_dtype_is_no_conversion_for_any_engine():
    """float32 -> float32, bfloat16 -> bf16: no tensor of the lowered program converts, so the torch engine copies no
    shard before sending, the engines that do not convert (`EngineEntry.make`) run the plan, and so does the torch demo."""
    single = compile_plan(build_problem({"shape": [8, 4], "dtype": "float32", "dst_dtype": "float32", "src": {"mesh": "1x2", "spec": "S0 R"},
                                         "dst": {"mesh": "1x2", "spec": "R S0"}}), solver="greedy")
    multi = compile_plan(build_transfer({"src_mesh": {"shape": [2], "devices": [0, 1]}, "dst_mesh": {"shape": [1], "devices": [2]},
                                         "tensors": [{"name": "w", "shape": [4, 4], "dtype": "bfloat16", "src": "S0 R", "dst": "R R",
                                                      "dst_dtype": "bf16"}]}))
    for plan in (single, multi):
        program = lower(plan, 0)
        assert [t.convert for t in program.tensors] == [None] and program.tensors[0].dst_dtype == program.tensors[0].dtype
    from xmesh_plan.executor.torch_run import _scaled

    assert _scaled(single, 1.0).problem == single.problem  # the torch demo fills and checks it as any plan of float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scales_and_casts_on_cuda_are_bit_for_bit_those_on_cpu():
    """Per-tensor and block scales, and the casts with them, on a CUDA device equal the CPU's and numpy's float32
    quotients bit for bit (CUDA divides by a Python number as a multiply by its reciprocal, one unit off for some)."""
    from xmesh_plan.executor.convert import block_scales, convert, expand_scales, over_fp8_max, tensor_scale
    from xmesh_plan.schemas.convert import FP8_MAX

    g = torch.Generator().manual_seed(0)
    amaxes = torch.rand(1 << 20, generator=g) * torch.float_power(10.0, torch.randint(-6, 6, (1 << 20,), generator=g)).float()
    shard = torch.randn(3, 300, 260, generator=g) * 7
    for fp8 in ("float8_e4m3fn", "float8_e5m2"):
        want = amaxes.numpy() / np.float32(FP8_MAX[fp8])
        assert np.array_equal(over_fp8_max(amaxes.cuda(), fp8).cpu().numpy().view(np.uint32), want.view(np.uint32))
        assert torch.equal(tensor_scale(amaxes[:1].cuda(), fp8).cpu().view(torch.int32), tensor_scale(amaxes[:1], fp8).view(torch.int32))
        on_cpu, on_gpu = block_scales(shard, fp8), block_scales(shard.cuda(), fp8).cpu()
        assert torch.equal(on_gpu.view(torch.int32), on_cpu.view(torch.int32))
        box = tuple((0, n) for n in shard.shape)
        cast_cpu = convert(shard, fp8, expand_scales(on_cpu, box))
        cast_gpu = convert(shard.cuda(), fp8, expand_scales(on_cpu.cuda(), box)).cpu()
        assert torch.equal(cast_gpu.view(torch.uint8), cast_cpu.view(torch.uint8))
