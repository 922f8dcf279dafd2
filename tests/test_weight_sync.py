"""`xmesh_plan.weight_sync.WeightSync` on gloo: a tiny Llama-like model, FSDP2 `fully_shard` on 4 trainer ranks, into two
TP=2 inference replicas, every destination element checked bit for bit against the trainer's `full_tensor()`.

One launch of 8 ranks (one world) and one pair of launches of 4 (separate worlds joined by `transfer_group`), each
with plain, fused and converted (FP8 with block or per-tensor scales, float16, bfloat16) destinations;
tests/workers/weight_sync_worker.py does the work and prints what the tests compare. Each mismatch case runs
with WeightSync's deadline at 5 s after a barrier, so a mismatch noticed late would surface as a timeout,
not as the cause the tests expect.
"""

from __future__ import annotations

import pytest

from tests.support.launch import ROOT, TORCH_LAUNCH_TIMEOUT_S as LAUNCH_TIMEOUT_S, finish_ranks, free_port, lines_of, run_ranks, start_ranks

WORKER = ROOT / "tests" / "workers" / "weight_sync_worker.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)]


@pytest.fixture(scope="module")
def joint() -> dict[str, list[str]]:
    return lines_of(run_ranks(8, WORKER, "joint", timeout=LAUNCH_TIMEOUT_S))


def test_fsdp2_weights_land_bit_exact_in_the_tp_replicas_every_step(joint):
    assert joint["step 0"] == ["sent"] * 4 + ["ok"] * 4
    assert joint["step 1"] == ["sent"] * 4 + ["ok, changed True"] * 4


def test_colocated_ranks_pass_both_mappings_and_sync_bit_exact(joint):
    assert joint["colocated"] == ["ok"] * 4 + ["outside"] * 4


def test_fused_qkv_and_gate_up_land_as_each_tp_rank_concatenates_its_shares(joint):
    assert joint["fused"] == ["sent"] * 4 + ["ok"] * 4


def test_fp8_and_fp16_destinations_converted_by_the_senders_land_bit_exact_with_their_scales(joint):
    """qkv and gate_up fused in FP8 e4m3 with block scales, o and down in FP8 with per-tensor scales, embeddings and LM
    head in float16, norms in bfloat16: every element and every scale (`sync.scales`) equal bit for bit to torch's own
    cast of `full_tensor()` with scales computed block by block (`weight_sync_demo.cast_reference`), twice with a
    training step between."""
    assert joint["fp8 step 0"] == ["sent"] * 4 + ["ok"] * 4
    assert joint["fp8 step 1"] == ["sent"] * 4 + ["ok"] * 4


def test_the_plan_is_compiled_once_and_found_by_fingerprint_after(joint):
    assert joint["compiled"] == ["True"] * 8
    assert joint["same layouts again, compiled"] == ["False"] * 8


Q, DOWN = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("case, message", [
    ("dtype", f"WeightSyncError: inference tensor '{Q}': rank 5 has dtype float16 but rank 4 has float32; give it the same "
              "dtype on every rank"),
    ("shape", f"WeightSyncError: inference tensor '{DOWN}' on rank 6 has shape (12, 18) but R S1 of the global (12, 18) gives "
              "that rank (12, 9); give it the shape of its part"),
    ("missing", "WeightSyncError: inference tensor 'lm_head.weight' is not passed on rank 7 (its other ranks pass it); pass "
                "every inference tensor on every rank of the inference mesh"),
    ("trainer shard dtype at run()", "WeightSyncError: trainer tensor 'model.norm.weight' on rank 2 is float64, not float32 as "
                                     "agreed; nothing was moved"),
])
def test_a_mismatch_fails_every_rank_with_its_cause_before_the_deadline(joint, case, message):
    assert joint[case] == [message] * 8


def test_the_weights_land_in_the_engines_own_tensors_with_no_buffer_or_view_kept_by_the_executor(joint):
    assert joint["in place"] == ["sent"] * 4 + ["ok"] * 4
    assert joint["fused in place"] == ["sent"] * 4 + ["ok"] * 4


@pytest.fixture(scope="module")
def separate() -> dict[str, list[str]]:
    """Two launches of 4 ranks (trainer, inference) joined by `transfer_group`; lines in transfer rank order."""
    env = {"TRANSFER_PORT": str(free_port())}
    procs = start_ranks(4, WORKER, "trainer", env=env) + start_ranks(4, WORKER, "inference", env=env)
    return lines_of(finish_ranks(procs, LAUNCH_TIMEOUT_S))


def test_separate_launches_joined_by_a_tcp_rendezvous_sync_bit_exact(separate):
    assert separate["transfer rank"] == [str(r) for r in range(8)]
    assert separate["step 0"] == ["sent"] * 4 + ["ok"] * 4
    assert separate["step 1"] == ["sent"] * 4 + ["ok, changed True"] * 4
    assert separate["in place"] == ["sent"] * 4 + ["ok"] * 4


def test_fused_and_converted_destinations_across_separate_launches_land_bit_exact_with_their_scales(separate):
    """The converting engine across the two launches: layer 0's qkv and gate_up fused in FP8 e4m3 with block scales,
    layer 1's q, k, v, gate and up each its own FP8 destination with block scales, o and down FP8 per tensor,
    embeddings and LM head float16, norms bfloat16: every element and scale bit for bit torch's own cast of
    `full_tensor()` (`weight_sync_demo.cast_reference`), twice with a training step between."""
    assert separate["separate fp8 kinds"] == ["sent"] * 4 + [
        "bfloat16 5, float16 2, float8_e4m3fn block 5, float8_e4m3fn tensor 4, fused float8_e4m3fn block 2"] * 4
    assert separate["separate fp8 step 0"] == ["sent"] * 4 + ["ok"] * 4
    assert separate["separate fp8 step 1"] == ["sent"] * 4 + ["ok"] * 4


@pytest.mark.parametrize("case, message", [
    ("separate dtype", f"WeightSyncError: inference tensor '{Q}' on ranks 4,5,6,7 is float16 but the trainer's '{Q}' is float32; "
                       "give the destination the trainer's dtype, or convert at the sender with Target(..., dtype='float16')"),
    ("separate shape", f"WeightSyncError: inference tensor '{DOWN}' on rank 6 has shape (12, 18) but R S1 of the global (12, 18) "
                       "gives that rank (12, 9); give it the shape of its part"),
    ("separate trainer shard dtype at run()", "WeightSyncError: trainer tensor 'model.norm.weight' on rank 2 is float64, not "
                                              "float32 as agreed; nothing was moved"),
])
def test_a_mismatch_across_separate_launches_fails_every_rank_of_both_with_its_cause_before_the_deadline(separate, case, message):
    assert separate[case] == [message] * 8
