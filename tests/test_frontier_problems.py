"""The frontier weight-sync problems of `planner/weight_sync.py`: the Kimi-K2-like 1T MoE into FP8, the DeepSeek-V3-like
MoE on 48 GPUs that `bench.bench_moe_mpi` runs, and the same structure run bit-exact on 12 MPI ranks."""

from __future__ import annotations

import dataclasses
import tomllib

from xmesh_plan.planner.transfer_io import build_transfer
import pytest

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.weight_sync import (DEEPSEEK_V3, KIMI_K2, WEIGHT_SYNC, Layout, MoeModel, parameter_count, tensor_count,
                                            weight_sync_toml)
from xmesh_plan.schemas.plan import write_atomic

from tests.support.launch import MPIEXEC, run_demo


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


def test_the_48_gpu_problem_has_the_deepseek_structure():
    p = build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC["weight_sync_deepseek_v3_48"])))
    assert len(set(p.src_mesh.devices) | set(p.dst_mesh.devices)) == 48 and p.dst_mesh.shape == (2, 2, 8)
    experts = p.tensors[p.index_of("model.layers.1.mlp.experts.up_proj.weight")]
    assert (str(experts.src), str(experts.dst)) == ("S0 S1 R", "S12 R R") and tuple(experts.shape) == (256, 2048, 7168)
    assert p.tensors[p.index_of("model.layers.0.mlp.down_proj.weight")].dst is not None  # the dense first layer


TINY_MOE = MoeModel(vocab=512, hidden=128, layers=3, dense_layers=1, heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_dim=16,
                    qk_rope_dim=8, v_head_dim=16, mlp=256, experts=8, expert_mlp=64)


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)")
def test_the_moe_structure_runs_bit_exact_on_mpi(tmp_path):
    """FSDP + EP over 2 hosts of 2 -> 2 instances of 2 hosts of 2 (experts split over an instance, TP inside a host):
    12 ranks, every destination shard of every tensor checked."""
    layout = Layout("tiny MoE", "2x2", "2x2x2", devices_per_host=2, nic_gbps=400.0, intra_host_gbps=2400.0, nics=2)
    plan = compile_plan(build_transfer(tomllib.loads(weight_sync_toml("tiny_moe", TINY_MOE, layout))))
    path = tmp_path / "tiny_moe.plan.json"
    write_atomic(path, plan.to_json())
    result = run_demo(12, path, "--check", "--iters", "1", "--warmup", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"check ok: {len(plan.problem.tensors)} tensors x 8 destination shards bit-exact" in result.stdout + result.stderr
