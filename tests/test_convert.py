"""Conversion at the sender (`schemas.convert`, `executor.convert`): the plan states each destination dtype and its
FP8 scales as tensors of the plan, counts the bytes that cross converted, and the casts match torch's own."""

from __future__ import annotations

import doctest
import re

import pytest
import torch

from xmesh_plan.executor import convert as executor_convert
from xmesh_plan.executor.convert import amax, block_scales, convert, expand_scales, tensor_scale
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import InputError, build_problem
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.verify import fused_provenance, verify_plan
from xmesh_plan.schemas.fused import fused_pieces
from xmesh_plan.schemas.transfer import TensorTransfer, TransferProblem, scale_tensor, single_problem
from xmesh_plan.schemas.validation import describe_validation_error
from tests.support.cli import run_cli


def converted_raw(**tensor_edits) -> dict:
    """FSDP-like sources on 4 ranks, TP=2 x 2 replicas: a block-scaled FP8 weight, a tensor-scaled FP8 one and a cast."""
    tensors = [{"name": "w", "shape": [512, 256], "dst_dtype": "float8_e4m3fn", "scale": "block"},
               {"name": "e", "shape": [300, 64], "dst_dtype": "fp8", "scale": "tensor", "src": "R S0"},
               {"name": "h", "shape": [64, 64], "dtype": "float32", "dst_dtype": "bf16"}]
    for name, edit in tensor_edits.items():
        next(t for t in tensors if t["name"] == name).update(edit)
    return {"src_mesh": {"shape": [4], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [2, 2], "devices": [4, 5, 6, 7]},
            "cluster": {"devices_per_host": 2}, "dtype": "bfloat16",
            "rules": [{"match": "*", "src": "S0 R", "dst": "R S1"}], "tensors": tensors}


def test_the_plan_states_each_conversion_and_carries_the_scales_as_tensors():
    problem = build_transfer(converted_raw())
    assert problem.names == ("w", "w.scale", "e", "e.scale", "h")
    w_scale = problem.tensors[1]
    assert (w_scale.shape, w_scale.dtype, w_scale.scale_of) == ((4, 2), "float32", "w")
    # sources hold the scales of the blocks they hold (128 rows each); a TP rank the scales of its columns' block
    assert w_scale.src_boxes == tuple(((k, k + 1), (0, 2)) for k in range(4))
    assert w_scale.dst_boxes == (((0, 4), (0, 1)), ((0, 4), (1, 2))) * 2
    assert problem.tensors[3].src_boxes == (((0, 1),),) * 4  # every source device agrees on the one scale
    plan = compile_plan(problem, solver="greedy")
    assert plan.schema_version == 2
    report = verify_plan(plan)
    assert report.conversions == ("w: bfloat16 -> float8_e4m3fn, block scales in 'w.scale'",
                                  "w.scale: float32 scales of 'w', computed by its senders",
                                  "e: bfloat16 -> float8_e4m3fn, tensor scales in 'e.scale'",
                                  "e.scale: float32 scales of 'e', computed by its senders", "h: float32 -> bfloat16")
    assert "converted at the sender: 1 to bfloat16, 2 to float8_e4m3fn (2 with their scales" in str(report)


def test_the_bound_and_the_prediction_count_the_bytes_that_cross():
    """A plan converting at the sender moves, and is timed, exactly as one whose sources already hold the
    destination dtype (its scale tensors as plain float32 tensors)."""
    converting = build_transfer(converted_raw())
    plain = TransferProblem.model_validate(converting.model_dump() | {"tensors": [
        t.model_dump(exclude={"dst_dtype", "scale", "scale_of"}) | {"dtype": t.dst_dtype or t.dtype} for t in converting.tensors]})
    a, b = compile_plan(converting, solver="greedy"), compile_plan(plain, solver="greedy")
    assert [t.nbytes for t in a.tasks] == [t.nbytes for t in b.tasks]
    assert a.lower_bound_seconds == b.lower_bound_seconds and a.predicted_seconds == b.predicted_seconds
    w = converting.tensor_problem(0)
    assert (w.itemsize, w.src_itemsize, w.nbytes) == (1, 2, 512 * 256)
    wider = compile_plan(TransferProblem.model_validate(converting.model_dump() | {"tensors": [
        t.model_dump(exclude={"dst_dtype", "scale", "scale_of"}) for t in converting.tensors]}), solver="greedy")
    assert wider.lower_bound_seconds > a.lower_bound_seconds  # bf16 / fp32 on the wire: more bytes


def test_a_converting_plan_file_compiles_checks_and_verifies(tmp_path):
    import json

    path = tmp_path / "convert.json"
    path.write_text(json.dumps(converted_raw()))
    assert run_cli("compile", path, "-o", tmp_path / "plan.json").exit_code == 0
    result = run_cli("check", tmp_path / "plan.json", "--max-ratio", "1e9")
    assert result.exit_code == 0, result.output
    assert "converted at the sender" in run_cli("verify", tmp_path / "plan.json").output


@pytest.mark.parametrize("edits, message", [
    (dict(w={"scale": None}), r"tensors\[0\] \(w\): scale: an FP8 destination \(float8_e4m3fn\) needs scales"),
    (dict(h={"scale": "tensor"}), r"scale: float16|scale: bfloat16 takes no scales; drop scale"),
    (dict(h={"dtype": "int32"}), r"dst_dtype: int32 -> bfloat16 is not a conversion made at the sender"),
    (dict(h={"dst_dtype": None, "scale": "block"}), r"scale: 'block' without dst_dtype"),
    (dict(e={"scale": "block", "shape": [300], "src": "R", "dst": "R"}), r"block scales are for tensors of 2 dims or more"),
    (dict(e={"scale": "block", "src": "S0 R"}), r"tensors\[1\] \(e\).scale: source device 0 holds \[0:75, 0:64\], not whole 128x128 blocks; .*use scale = \"tensor\""),
    (dict(e={"scale": "block", "shape": [2, 300, 64], "src": "R S0 R", "dst": "R R S1"}),
     r"source device 0 holds \[0:2, 0:75, 0:64\], not whole 128x128 blocks"),  # stacked: blocks of the last two dims
    (dict(h={"dst_dtype": "float8_e9"}), r"unknown dtype 'float8_e9'"),
])
def test_bad_conversions_get_one_line_naming_the_field_and_the_fix(edits, message):
    with pytest.raises(InputError) as info:
        build_transfer(converted_raw(**edits))
    assert re.search(message, str(info.value)) and "\n" not in str(info.value), str(info.value)


def test_a_scale_tensor_must_be_the_one_its_tensor_needs():
    problem = build_transfer(converted_raw())
    tensors = list(problem.tensors)
    with pytest.raises(ValueError, match=r"tensors\[0\] \(w\).scale: no tensor 'w.scale' with scale_of = 'w' carries its scales"):
        TransferProblem.model_validate(problem.model_dump() | {"tensors": [t.model_dump() for t in tensors[:1] + tensors[2:]]})
    bad = tensors[1].model_copy(update={"dst_boxes": ((((0, 4), (0, 2)),) * 4)})
    with pytest.raises(ValueError, match=r"tensors\[1\] \(w.scale\): not the scale tensor 'w' needs"):
        TransferProblem.model_validate(problem.model_dump() | {"tensors": [t.model_dump() for t in [tensors[0], bad] + tensors[2:]]})
    stray = TensorTransfer(name="h.scale", shape=(1,), src="R", dst="R", scale_of="h")
    with pytest.raises(ValueError, match=r"\(h.scale\).scale_of: 'h' is not an FP8 tensor with scales"):
        TransferProblem.model_validate(problem.model_dump() | {"tensors": [t.model_dump() for t in tensors + [stray]]})
    # what problem files do, by hand
    mine = TensorTransfer(name="x", shape=(512, 128), src="S0 R", dst="R R", dst_dtype="float8_e4m3fn", scale="block")
    made = scale_tensor(mine, single_problem(mine, problem.src_mesh, problem.dst_mesh, problem.cluster))
    TransferProblem(src_mesh=problem.src_mesh, dst_mesh=problem.dst_mesh, tensors=(mine, made))


def test_fused_parts_take_the_fused_conversion_and_refuse_tensor_scales():
    raw = converted_raw(w={"dst_dtype": None, "scale": None}, h={"dtype": "bfloat16", "dst_dtype": None})
    raw["tensors"].append({"name": "wh", "fuse": ["h", "w"], "dim": 1, "dst": "S1 R", "dst_dtype": "float16"})
    raw["tensors"][0]["shape"] = [64, 256]
    problem = build_transfer(raw)
    assert {t.name: t.dst_dtype for t in problem.tensors if t.name in ("h", "w")} == {"h": "float16", "w": "float16"}
    verify_plan(compile_plan(problem, solver="greedy"))
    raw["tensors"][-1]["dst_dtype"] = "float8_e4m3fn"
    raw["tensors"][0] |= {"dst_dtype": "float8_e4m3fn", "scale": "tensor"}
    raw["tensors"][2] |= {"dst_dtype": "float8_e4m3fn", "scale": "tensor"}
    with pytest.raises(InputError, match=r"tensors\[0\] \(w\).scale: the parts of fused tensor 'wh' convert as .*; a fused "
                                         r"FP8 tensor takes block scales"):
        build_transfer(raw)


def test_a_single_tensor_problem_casts_but_refuses_fp8_without_scales():
    raw = {"shape": [8, 4], "dtype": "float32", "dst_dtype": "fp16", "src": {"mesh": "1x2", "spec": "S0 R"},
           "dst": {"mesh": "1x2", "spec": "R S0"}}
    problem = build_problem(raw)
    assert (problem.dst_dtype, problem.itemsize) == ("float16", 2)
    report = verify_plan(compile_plan(problem, solver="greedy"))
    assert report.conversions == ("tensor: float32 -> float16",) and "converted at the sender: 1 to float16" in str(report)
    with pytest.raises(InputError, match="dst_dtype: an FP8 destination needs scales"):
        build_problem(raw | {"dst_dtype": "float8_e4m3fn"})


# --- the casts (executor/convert.py) against torch's own --------------------------------------------------

def test_the_module_examples_hold():
    assert doctest.testmod(executor_convert, report=False).failed == 0


def random_weight(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])[None, :]  # magnitudes far apart across blocks
    x[:130, :5] = 0  # an all-zero corner block
    return x.to(dtype)


def reference_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Block by block as torch says it: (block / its scale), clamped, `.to(torch.float8_e4m3fn)`."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            amax_block = x[block].float().abs().max()
            assert scales[i, j] == amax_block.clamp(min=1e-12) / 448.0
            out[block] = (x[block].float() / scales[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return out


def test_block_scales_from_each_senders_shard_quantize_every_box_as_torch_does():
    x = random_weight((300, 400), seed=3)
    full_scales = block_scales(x, "float8_e4m3fn")
    assert full_scales.shape == (3, 4) and full_scales.dtype == torch.float32
    want = reference_fp8(x, full_scales)
    # sources on block bounds (rows 0:128, 128:256, 256:300): each computes its own blocks' scales from its shard alone
    for r0, r1 in ((0, 128), (128, 256), (256, 300)):
        own = block_scales(x[r0:r1], "float8_e4m3fn")
        assert torch.equal(own, full_scales[r0 // 128: -(-r1 // 128)])
        for box in (((r0, r1), (0, 400)), ((r0 + 3, r1), (100, 333))):  # any box a sender sends out of its shard
            values = x[box[0][0]:box[0][1], box[1][0]:box[1][1]]
            got = convert(values, "float8_e4m3fn", expand_scales(own, box, origin=(r0 // 128, 0)))
            assert torch.equal(got.view(torch.uint8), want[box[0][0]:box[0][1], box[1][0]:box[1][1]].view(torch.uint8)), box


def test_a_tensor_scale_from_the_senders_amaxes_quantizes_as_torch_does():
    x = random_weight((200, 64), seed=4)
    shards = [x[:70], x[70:140], x[140:]]
    scale = tensor_scale(torch.stack([amax(s) for s in shards]).max(), "float8_e4m3fn")
    assert scale.shape == (1,) and scale.item() == pytest.approx(x.float().abs().max().item() / 448.0)
    want = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    for k, shard in enumerate(shards):
        got = convert(shard, "float8_e4m3fn", scale)
        assert torch.equal(got.view(torch.uint8), want[[slice(0, 70), slice(70, 140), slice(140, 200)][k]].view(torch.uint8))
    assert amax(x[:0]).item() == 0.0


@pytest.mark.parametrize("src, dst", [("float32", "float16"), ("float32", "bfloat16"), ("bfloat16", "float16"),
                                      ("float16", "float32"), ("bfloat16", "float32")])
def test_plain_casts_are_torchs(src, dst):
    x = random_weight((64, 48), seed=5, dtype=getattr(torch, src))
    assert torch.equal(convert(x, dst), x.to(getattr(torch, dst)))


def test_validation_errors_from_python_name_the_field():
    with pytest.raises(Exception) as info:
        TensorTransfer(name="w", shape=(4, 4), src="R R", dst="R R", dst_dtype="float8_e4m3fn")
    assert "needs scales" in describe_validation_error(info.value)


def fused_fp8_raw() -> dict:
    """q, k, v on 4 FSDP ranks (128-row shards) fused as two TP ranks keep them, in FP8 with block scales."""
    tp = ["q[0:512]", "k[0:256]", "v[0:256]", "q[512:1024]", "k[256:512]", "v[256:512]"]
    return {"src_mesh": {"shape": [4], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [2, 2], "devices": [4, 5, 6, 7]},
            "cluster": {"devices_per_host": 2}, "dtype": "bfloat16", "rules": [{"match": "*", "src": "S0 R"}],
            "tensors": [{"name": "q", "shape": [1024, 192]}, {"name": "k", "shape": [512, 192]}, {"name": "v", "shape": [512, 192]},
                        {"name": "qkv", "fuse": tp, "dim": 0, "dst": "S1 R", "dst_dtype": "float8_e4m3fn", "scale": "block"}]}


def test_a_fused_fp8_destination_gets_its_parts_block_scales_fused_the_same_way():
    problem = build_transfer(fused_fp8_raw())
    assert [f.name for f in problem.fused] == ["qkv", "qkv.scale"]
    scales = problem.fused[1]
    assert scales.parts == ("q.scale[0:4]", "k.scale[0:2]", "v.scale[0:2]", "q.scale[4:8]", "k.scale[2:4]", "v.scale[2:4]")
    assert problem.fused_shape(1) == (16, 2) and problem.fused_blocks(1)[5] == ((8, 16), (0, 2))
    assert problem.tensors[problem.index_of("k.scale")].src_boxes == (((0, 1), (0, 2)), ((1, 2), (0, 2)), ((2, 3), (0, 2)), ((3, 4), (0, 2)))
    plan = compile_plan(problem, solver="greedy")
    report = verify_plan(plan)
    assert report.fused == 2 and "3 to float8_e4m3fn" in str(report)
    # what each destination device assembles, converted at the senders with their own blocks' scales, is the fused
    # tensor quantized with its own block scales: fused blocks are part blocks
    g = torch.Generator().manual_seed(9)
    full = {n: (torch.randn(t.shape, generator=g) * (1 + 10 * i)).to(torch.bfloat16) for i, (n, t) in
            enumerate((t.name, t) for t in problem.tensors if t.scale_of is None)}
    own_scales = {n: block_scales(x, "float8_e4m3fn") for n, x in full.items()}
    fused = torch.cat([full["q"][:512], full["k"][:256], full["v"][:256], full["q"][512:], full["k"][256:], full["v"][256:]])
    fused_scales = block_scales(fused, "float8_e4m3fn")
    want = convert(fused, "float8_e4m3fn", expand_scales(fused_scales, ((0, 2048), (0, 192))))
    for device, box in problem.fused_blocks(0).items():
        shard = torch.empty([b - a for a, b in box], dtype=torch.float8_e4m3fn)
        for name, piece, where in fused_pieces(problem, 0, device):
            values = full[name][piece[0][0]:piece[0][1], piece[1][0]:piece[1][1]]
            shard[where] = convert(values, "float8_e4m3fn", expand_scales(own_scales[name], piece))
        assert torch.equal(shard.view(torch.uint8), want[box[0][0]:box[0][1], box[1][0]:box[1][1]].view(torch.uint8)), device
        tensors, index = fused_provenance(plan, "qkv.scale", device)
        sbox = problem.fused_blocks(1)[device]
        traced = torch.tensor([own_scales[problem.tensors[t].scale_of].flatten()[i].item() for t, i in zip(tensors.flat, index.flat)])
        assert torch.equal(traced.reshape(tensors.shape), fused_scales[sbox[0][0]:sbox[0][1], sbox[1][0]:sbox[1][1]]), device


@pytest.mark.parametrize("edit, message", [
    (lambda t: t[3].update(scale="tensor"), r"a fused FP8 tensor takes block scales"),
    (lambda t: t[3].update(fuse=["q[0:500]", "k", "v", "q[500:1024]"]), r"parts\[0\]: 'q\[0:500\]' is not whole 128-blocks of 'q'"),
    (lambda t: t[1].update(scale="tensor"), r"tensors\[1\] \(k\).scale: 'tensor', but its fused tensor qkv gives 'block'; give it once"),
])
def test_bad_fused_fp8_destinations_are_refused_naming_the_fix(edit, message):
    raw = fused_fp8_raw()
    edit(raw["tensors"])
    with pytest.raises(InputError) as info:
        build_transfer(raw)
    assert re.search(message, str(info.value)), str(info.value)


def stacked_raw() -> dict:
    """Stacked experts [E, I, H] (FSDP shards of 2 experts on 4 ranks) into EP = 2 ranks, FP8 with block scales, w13 =
    cat(w1, w3) on dim 1 fused as FusedMoE keeps it; w2 on its own."""
    return {"src_mesh": {"shape": [4], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [2], "devices": [4, 5]},
            "cluster": {"devices_per_host": 2}, "dtype": "bfloat16", "rules": [{"match": "*", "src": "S0 R R", "dst": "S0 R R"}],
            "tensors": [{"name": "w1", "shape": [8, 256, 200]}, {"name": "w3", "shape": [8, 256, 200]},
                        {"name": "w13", "fuse": ["w1", "w3"], "dim": 1, "dst": "S0 R R", "dst_dtype": "float8_e4m3fn", "scale": "block"},
                        {"name": "w2", "shape": [8, 200, 256], "dst_dtype": "float8_e4m3fn", "scale": "block"}]}


def test_stacked_experts_take_128x128_block_scales_per_expert():
    """An FP8 tensor of more than 2 dims has one scale per 128x128 block of its last two dims for each index of the
    others (DeepSeek-V3's `weight_scale_inv` of stacked experts [E, ceil(I/128), ceil(H/128)]), so a source shard of
    whole experts lies on block bounds; the fused w13's scales are w1's then w3's along dim 1."""
    problem = build_transfer(stacked_raw())
    w2 = problem.tensors[problem.index_of("w2.scale")]
    assert (w2.shape, w2.src_boxes, w2.dst_boxes) == ((8, 2, 2), tuple(((2 * k, 2 * k + 2), (0, 2), (0, 2)) for k in range(4)),
                                                      (((0, 4), (0, 2), (0, 2)), ((4, 8), (0, 2), (0, 2))))
    assert problem.fused[1].parts == ("w1.scale", "w3.scale") and problem.fused_shape(1) == (8, 4, 2)
    verify_plan(compile_plan(problem, solver="greedy"))
    raw = stacked_raw()
    raw["tensors"][3] |= {"shape": [8, 512, 256], "src": "R S0 R"}  # every expert's rows split on 128-row bounds
    split = build_transfer(raw)
    assert split.tensors[split.index_of("w2.scale")].src_boxes == tuple(((0, 8), (k, k + 1), (0, 2)) for k in range(4))
    x = random_weight((3 * 300, 400), seed=6).reshape(3, 300, 400)
    scales = block_scales(x, "float8_e4m3fn")
    assert scales.shape == (3, 3, 4)
    for e in range(3):  # each expert's blocks as a 2-d tensor's, and its values cast with them as torch casts
        assert torch.equal(scales[e], block_scales(x[e], "float8_e4m3fn"))
        want = reference_fp8(x[e], scales[e])
        box = ((e, e + 1), (5, 290), (100, 333))
        got = convert(x[e:e + 1, 5:290, 100:333], "float8_e4m3fn", expand_scales(scales, box))
        assert torch.equal(got[0].view(torch.uint8), want[5:290, 100:333].view(torch.uint8))
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    executor_convert.convert_shard(out, x, "float8_e4m3fn", "block", scales)
    assert torch.equal(out[1].view(torch.uint8), reference_fp8(x[1], scales[1]).view(torch.uint8))
