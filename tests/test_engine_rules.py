"""The box rules of `xmesh_plan.engine_layouts` (padded vocabularies, KV heads replicated beyond their count) against
vLLM's own rules, written here from vLLM's code (vocab_parallel_embedding.py, linear.py's QKVParallelLinear) by slicing
the full tensor, independently of our layout code (`vllm_vocab_shard`, `vllm_kv_shard` in the gloo worker that checks a
synced model with them); through `agree` as every rank runs it, in one process."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from xmesh_plan.engine_layouts import PADDED_VOCAB, kv_heads, padded_vocab
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas.fused import assemble_fused
from xmesh_plan.schemas import Cluster
from xmesh_plan.sides import FrontendError
from xmesh_plan.weight_sync_layouts import Fused, Target, WeightSyncError, agree, describe, engine_targets

from tests.support.transfer import fake_executors, run_everywhere
from tests.workers.weight_sync_models_worker import vllm_kv_shard, vllm_vocab_shard

NAN = float("nan")


def synced(full: torch.Tensor, rule, mesh: list[list[int]], local_shape) -> dict[int, torch.Tensor]:
    """Each inference rank's tensor (NaN before) after its plan box of `full` is written where WeightSync writes it:
    the rows come from `agree` on the ranks' rows (one trainer rank holding `full`, the engine ranks of `mesh`)."""
    ranks = [r for row in mesh for r in row]
    trainer = {"rank": 0, "src": {"mesh": [[1], [0]], "tensors": [["w", list(full.shape), "float32", " ".join("R" * full.dim()),
                                                                   list(full.shape)]]}}
    engine = {r: torch.full(local_shape, NAN) for r in ranks}
    rows = [trainer] + [describe(r, None, {"w": (engine[r], rule)}, mesh, {r: r for r in ranks}, Cluster()) for r in ranks]
    problem, _ = agree(rows, len(ranks) + 1)
    for r in ranks:
        box = problem.tensor_problem(0).blocks("dst")[r]
        engine_targets(problem, {"w": Target(engine[r], rule)}, r)["w"].tensor.copy_(full[tuple(slice(a, b) for a, b in box)])
    return engine


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("seed", range(40))
def test_padded_vocab_writes_each_ranks_real_rows_at_the_top_and_leaves_the_padding(seed):
    rng = random.Random(seed)
    pad_to, replicas = rng.choice([8, 16, 64]), rng.randint(1, 2)
    tp = rng.choice([t for t in (1, 2, 4, 8) if pad_to % t == 0])
    vocab, hidden = rng.randint(1, 3 * pad_to), rng.randint(1, 4)
    full = torch.randn(vocab, hidden)
    mesh = [[1 + r * tp + t for t in range(tp)] for r in range(replicas)]
    rule = padded_vocab(pad_to)
    local = rule.local_shape((vocab, hidden), (replicas, tp))
    for rank, tensor in synced(full, rule, mesh, local).items():
        assert same(tensor, vllm_vocab_shard(full, (rank - 1) % tp, tp, pad_to)), (rank, vocab, pad_to, tp)


@pytest.mark.parametrize("seed", range(40))
def test_kv_heads_give_each_tp_rank_vllms_heads_replicated_when_tp_exceeds_them(seed):
    rng = random.Random(seed)
    heads, head_dim, hidden, replicas = rng.choice([1, 2, 4, 8]), rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 2)
    tp = rng.choice([t for t in (1, 2, 4, 8, 16) if t % heads == 0 or heads % t == 0])
    full = torch.randn(heads * head_dim, hidden) if seed % 4 else torch.randn(heads * head_dim)  # a bias too
    mesh = [[1 + r * tp + t for t in range(tp)] for r in range(replicas)]
    rule = kv_heads(heads)
    local = rule.local_shape(tuple(full.shape), (replicas, tp))
    for rank, tensor in synced(full, rule, mesh, local).items():
        assert same(tensor, vllm_kv_shard(full, (rank - 1) % tp, tp, heads)), (rank, heads, tp)


def test_a_padded_vocab_rank_with_no_real_rows_keeps_only_padding():
    full = torch.randn(10, 2)  # 10 rows padded to 64, 16 per rank of 4: ranks 2-4 hold padding only
    engine = synced(full, PADDED_VOCAB, [[1, 2, 3, 4]], (16, 2))
    assert same(engine[1][:10], full) and all(torch.isnan(engine[r]).all() for r in (2, 3, 4))


def rows_with(rule, local, full_shape=(51, 4), mesh=((4, 5),), parts=None) -> list[dict]:
    ranks = [r for row in mesh for r in row]
    trainer = [{"rank": r, "src": {"mesh": [[4], [0, 1, 2, 3]], "tensors": [[name, list(full_shape), "float32", "R R",
                                                                            list(full_shape)] for name in parts or ["w"]]}}
               for r in range(4)]
    given = Target(torch.zeros(local), rule, source=Fused(tuple(parts))) if parts else (torch.zeros(local), rule)
    return trainer + [describe(r, None, {"w": given}, [list(row) for row in mesh], {r: r for r in ranks}, Cluster()) for r in ranks]


@pytest.mark.parametrize("rule, local, full_shape, mesh, parts, message", [
    (PADDED_VOCAB, (26, 4), (51, 4), ((4, 5),), None,
     "inference tensor 'w' on rank 4 has shape (26, 4) but PADDED_VOCAB of the global (51, 4) gives that rank (32, 4)"),
    (PADDED_VOCAB, (22, 4), (51, 4), ((4, 5, 6),), None,
     "inference tensor 'w' (PADDED_VOCAB) of the trainer's shape (51, 4): the vocabulary of 51 rows padded to a multiple of 64 "
     "is 64 rows, which 3 TP ranks cannot share equally (vLLM refuses it too)"),
    (kv_heads(2), (4, 4), (8, 4), ((4, 5, 6),), None,
     "inference tensor 'w' (kv_heads(2)) of the trainer's shape (8, 4): 3 TP ranks neither divide 2 KV heads nor are a multiple"),
    (kv_heads(3), (4, 4), (8, 4), ((4, 5),), None, "8 rows are not 3 KV heads of equal size"),
    (kv_heads(2), (8, 4), (8, 4), ((4, 5),), ["a", "b"],
     "inference tensor 'w' is fused (Fused(...)) and laid out by kv_heads(2), which fused tensors do not take"),
])
def test_a_box_rule_that_does_not_fit_fails_naming_the_tensor_and_cause(rule, local, full_shape, mesh, parts, message):
    rows = rows_with(rule, local, full_shape, mesh, parts)
    with pytest.raises(WeightSyncError) as err:
        agree(rows, 4 + len(mesh[0]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_two_ranks_with_different_rules_for_one_tensor_are_named():
    rows = rows_with(PADDED_VOCAB, (32, 4))
    rows[5] = describe(5, None, {"w": (torch.zeros(32, 4), padded_vocab(32))}, [[4, 5]], {4: 4, 5: 5}, Cluster())
    with pytest.raises(WeightSyncError, match="inference tensor 'w': rank 5 has layout padded_vocab\\(32\\) but rank 4 has PADDED_VOCAB"):
        agree(rows, 6)


@pytest.mark.parametrize("make, message", [
    (lambda: padded_vocab(0), "padded_vocab: pad_to is 0; give a positive integer"),
    (lambda: kv_heads(True), "kv_heads: heads is True; give the model's number of KV heads"),
    (lambda: describe(4, None, {"w": (torch.zeros(2, 2, 2), kv_heads(2))}, [[4]], {4: 4}, Cluster())["error"],
     "inference['w']: kv_heads(2) lays out tensors of 1 or 2 dims, not 3"),
])
def test_bad_rule_arguments_are_one_line(make, message):
    try:
        text = make()
    except FrontendError as err:
        text = str(err)
    assert message in text


def test_a_plan_of_box_rules_runs_bit_exact_through_the_executor_even_to_ranks_with_only_padding():
    """10 vocabulary rows padded to 64 over TP 4 (ranks 2-4 hold padding only) and 2 KV heads over TP 4, compiled and
    run through the fake executors; each rank's result written where WeightSync writes it (engine_targets)."""
    full = {"lm": torch.randn(10, 3), "k": torch.randn(4, 3)}
    trainer = {"rank": 0, "src": {"mesh": [[1], [0]], "tensors": [[n, list(t.shape), "float32", "R R", list(t.shape)]
                                                                    for n, t in full.items()]}}
    rules = {"lm": PADDED_VOCAB, "k": kv_heads(2)}
    engine = {r: {"lm": torch.full((16, 3), NAN), "k": torch.full((2, 3), NAN)} for r in (1, 2, 3, 4)}
    rows = [trainer] + [describe(r, None, {n: (engine[r][n], rules[n]) for n in full}, [[1, 2, 3, 4]], {r: r for r in range(5)},
                                 Cluster()) for r in (1, 2, 3, 4)]
    problem, _ = agree(rows, 5)
    plan = compile_plan(problem)
    out = run_everywhere(plan, fake_executors(plan), {n: t.numpy() for n, t in full.items()})
    for r in (1, 2, 3, 4):
        for name, target in engine_targets(problem, {n: Target(engine[r][n], rules[n]) for n in full}, r).items():
            target.tensor.copy_(torch.from_numpy(out[r][name]).reshape(target.tensor.shape))
        assert same(engine[r]["lm"], vllm_vocab_shard(full["lm"], r - 1, 4, 64)), r
        assert same(engine[r]["k"], vllm_kv_shard(full["k"], r - 1, 4, 2)), r


@pytest.mark.parametrize("kv, tp", [(1, 2), (2, 4), (2, 8), (4, 2), (2, 2)])
def test_a_fused_qkv_with_kv_heads_replicated_verifies_and_runs_bit_exact_as_vllm_holds_it(kv, tp):
    """vLLM's QKVParallelLinear on TP rank t: cat(q's t-th share, k and v of head t // (T / kv) when T > kv), as
    `Fused((q, k, v), rules=(None, kv_heads(kv), kv_heads(kv)))` says; verified element by element, run through the
    fake executors and assembled as WeightSync's wait() assembles it."""
    head_dim, hidden = 2, 3
    full = {"q": torch.randn(8 * head_dim, hidden), "k": torch.randn(kv * head_dim, hidden), "v": torch.randn(kv * head_dim, hidden)}
    trainer = {"rank": 0, "src": {"mesh": [[1], [0]], "tensors": [[n, list(t.shape), "float32", "R R", list(t.shape)]
                                                                    for n, t in full.items()]}}
    ranks = list(range(1, tp + 1))
    local = (8 * head_dim // tp + 2 * vllm_kv_shard(full["k"], 0, tp, kv).shape[0], hidden)
    fused = Fused(("q", "k", "v"), rules=(None, kv_heads(kv), kv_heads(kv)))
    rows = [trainer] + [describe(r, None, {"qkv": Target(torch.zeros(local), "S1 R", source=fused)}, [ranks],
                                 {r: r for r in range(tp + 1)}, Cluster()) for r in ranks]
    problem, _ = agree(rows, tp + 1)
    plan = compile_plan(problem)
    assert verify_plan(plan).fused == 1
    out = run_everywhere(plan, fake_executors(plan), {n: t.numpy() for n, t in full.items()})
    for r in ranks:
        got = assemble_fused(problem, 0, r, out[r], np.full(local, np.nan, np.float32))
        want = torch.cat([full["q"].chunk(tp)[r - 1]] + [vllm_kv_shard(full[p], r - 1, tp, kv) for p in "kv"])
        assert same(torch.from_numpy(got), want), (r, kv, tp)


@pytest.mark.parametrize("fused, local, message", [
    (Fused(("a", "b"), rules=(None,)), (4, 4), "rank 4: inference['w'].source.rules: (None,); give one rule per part"),
    (Fused(("a", "b"), rules=(None, PADDED_VOCAB)), (4, 4), "rules[1]: PADDED_VOCAB; a part takes None (its equal share) or kv_heads(n)"),
    (Fused(("a", "b"), dim=1, rules=(None, kv_heads(2))), (4, 4),
     "inference tensor 'w': part 'b' takes kv_heads(2), which splits dim 0 over the TP ranks; fuse along dim 0"),
    (Fused(("a", "b"), rules=(None, kv_heads(3))), (4, 4),
     "inference tensor 'w': part 'b' (kv_heads(3)) of the trainer's shape (4, 4): 4 rows are not 3 KV heads of equal size"),
])
def test_part_rules_that_do_not_fit_a_fused_tensor_are_refused(fused, local, message):
    rows = rows_with("S1 R", (4, 4), (4, 4), ((4, 5),), ["a", "b"])
    layout = "R S1" if fused.dim == 1 else "S1 R"
    rows[4:] = [describe(r, None, {"w": Target(torch.zeros(local), layout, source=fused)}, [[4, 5]], {4: 4, 5: 5}, Cluster())
                for r in (4, 5)]
    with pytest.raises(WeightSyncError) as err:
        agree(rows, 6)
    assert message in str(err.value) and "\n" not in str(err.value)
