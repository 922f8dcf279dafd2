"""The frontier weight-sync problems of `planner/weight_sync.py`: the Kimi-K2-like 1T MoE into FP8 and the shrunk
DeepSeek-V3-like MoE the 48-rank MPI run moves."""

from __future__ import annotations

import dataclasses
import tomllib

from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import DEEPSEEK_V3, KIMI_K2, MOE_TOY, WEIGHT_SYNC, parameter_count, tensor_count, weight_sync_toml


def cut(name: str, layers: int):
    file_name, model, layout = WEIGHT_SYNC[name]
    return build_transfer(tomllib.loads(weight_sync_toml(file_name, dataclasses.replace(model, layers=layers), layout)))


def test_kimi_k2_is_a_1t_moe_with_fp8_destinations():
    assert 1.0e12 < parameter_count(KIMI_K2) < 1.05e12 and tensor_count(KIMI_K2) == 1035
    p = cut("weight_sync_kimi_k2", 2)  # the dense first layer and one MoE layer
    by_name = {t.name: t for t in p.tensors}
    experts = by_name["model.layers.1.mlp.experts.gate_proj.weight"]
    assert tuple(experts.shape) == (384 * 2048, 7168) and (experts.dst_dtype, experts.scale) == ("float8_e4m3fn", "block")
    assert "model.layers.1.mlp.experts.gate_proj.weight.scale" in by_name
    assert (by_name["model.layers.0.self_attn.o_proj.weight"].dst_dtype, by_name["model.layers.0.self_attn.o_proj.weight"].scale) \
        == ("float8_e4m3fn", "tensor")
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
        assert by_name[kept].dst_dtype is None
    single = p.tensor_problems()[p.index_of(experts.name)]
    rows = {box[0][1] - box[0][0] for box in single.blocks("src").values()}
    assert rows == {384 * 2048 // 256} and 384 * 2048 // 256 % 128 == 0  # each source device holds whole 128-row blocks
    wire = sum(s.nbytes for s in p.tensor_problems())
    assert wire < 0.6 * p.nbytes  # FP8 on the wire: about half of bfloat16 (scales and bfloat16 tensors aside)


def test_the_deepseek_problem_file_keeps_its_3d_experts():
    text = weight_sync_toml(*WEIGHT_SYNC["weight_sync_deepseek_v3"])
    assert "shape = [256, 2048, 7168]" in text and "dst_dtype" not in text and not DEEPSEEK_V3.fp8


def test_the_shrunk_moe_has_the_deepseek_structure_on_48_ranks():
    p = build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC["weight_sync_moe_small"])))
    assert len(set(p.src_mesh.devices) | set(p.dst_mesh.devices)) == 48 and p.dst_mesh.shape == (2, 2, 8)
    experts = p.tensors[p.index_of("model.layers.1.mlp.experts.up_proj.weight")]
    assert (str(experts.src), str(experts.dst)) == ("S0 S1 R", "S12 R R") and tuple(experts.shape) == (MOE_TOY.experts, 64, 128)
