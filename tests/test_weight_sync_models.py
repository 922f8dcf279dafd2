"""WeightSync on gloo with two more trainers (tests/workers/weight_sync_models_worker.py, one launch of 8 ranks):

- a tiny MoE model (stacked experts, a router, attention) under FSDP2 on ranks 0-3 into one engine of TP = EP = 4 on
  ranks 4-7: experts split over the ranks with w13 = cat(w1, w3) fused, KV heads replicated (2 heads, TP 4), the
  vocabulary padded to 64 rows; two syncs with a training step between; the same into a converting engine (the
  stacked experts in FP8 with 128x128 block scales per expert, the rest float16 / bfloat16);
- the tiny Llama-like model with TP (`parallelize_module`) then FSDP2 over a 2x2 mesh (DTensor's strided shards) into
  two TP=2 replicas.
Every destination element is compared bit for bit with vLLM's rule applied by slicing the trainer's `full_tensor()`;
the padding rows must keep what the engine had.
"""

from __future__ import annotations

import pytest

from tests.support.launch import ROOT, TORCH_LAUNCH_TIMEOUT_S as LAUNCH_TIMEOUT_S, lines_of, run_ranks

WORKER = ROOT / "tests" / "workers" / "weight_sync_models_worker.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[str]]:
    return lines_of(run_ranks(8, WORKER, timeout=LAUNCH_TIMEOUT_S))


def test_an_fsdp2_moe_model_lands_bit_exact_in_expert_parallel_fused_w13_padded_vocab_and_replicated_kv_heads(runs):
    assert runs["moe experts"] == ["DTensor (2, 128, 8)"] * 4  # FSDP2 shards the 8 stacked experts over 4 ranks
    assert runs["moe step 0"] == ["sent"] * 4 + ["ok"] * 4
    assert runs["moe step 1"] == ["sent"] * 4 + ["ok, changed True"] * 4


def test_the_moe_models_stacked_experts_land_in_fp8_with_block_scales_per_expert_the_rest_in_fp16_and_bf16(runs):
    """The same layouts into a converting engine: w13 = cat(w1, w3) fused and w2 in FP8 e4m3 with one scale per 128x128
    block of each expert (scales [experts, ceil(I/128), ceil(H/128)]), embeddings and LM head (padded) float16, the
    rest bfloat16; every element and scale bit for bit vLLM's rule applied to torch's own cast of `full_tensor()`
    (`weight_sync_demo.cast_reference`, scales computed block by block), twice with a training step between."""
    assert runs["moe fp8 step 0"] == ["sent"] * 4 + ["ok"] * 4
    assert runs["moe fp8 step 1"] == ["sent"] * 4 + ["ok"] * 4


def test_fsdp_over_tp_strided_shards_land_bit_exact_in_two_tp_replicas(runs):
    assert runs["fsdp_tp q_proj placements"] == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))"] * 4
    assert runs["fsdp_tp step 0"] == ["sent"] * 4 + ["ok"] * 4
    assert runs["fsdp_tp step 1"] == ["sent"] * 4 + ["ok"] * 4
