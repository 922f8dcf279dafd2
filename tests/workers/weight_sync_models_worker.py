"""One gloo rank of tests/test_weight_sync_models.py: two more trainers synced by WeightSync into an engine's tensors.

`python tests/workers/weight_sync_models_worker.py`, 8 ranks with env:// variables (tests/support/launch.py):
- `moe`: a tiny MoE model (attention, a router, stacked experts w1 / w3 [E, I, H] and w2 [E, H, I]) under FSDP2
  `fully_shard` on ranks 0-3; ranks 4-7 one engine of TP = EP = 4 ([[4, 5, 6, 7]]): experts split over the ranks
  (EXPERT), w13 = cat(w1, w3) on dim 1 fused, q / o tensor-parallel, k / v of 2 KV heads replicated on 2 ranks each
  (`kv_heads(2)`; layer 0 fused as qkv_proj, layer 1 apart), the vocabulary padded to 64 rows (`PADDED_VOCAB`).
  Two syncs with a training step between, into that engine's tensors in the trainer's dtype and into a converting
  engine of the same layouts: w13 (fused) and w2 in FP8 e4m3 with 128x128 block scales per expert, embeddings and LM
  head float16, the rest bfloat16, every element and scale checked against torch's own cast (`cast_reference`).
- `fsdp_tp`: the tiny Llama-like model of `xmesh_plan.weight_sync_demo` on a 2x2 mesh of ranks 0-3 (dp, tp),
  `parallelize_module` over tp then `fully_shard` over dp (DTensor's strided shards), into two TP=2 replicas.
Every destination element is compared bit for bit with what vLLM's rules take from the trainer's `full_tensor()`
(broadcast from rank 0), by slicing written here; padding rows must keep what the engine had (NaN).
Each rank prints `rank R: <what>: <result>` lines for the test to compare.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from xmesh_plan.engine_layouts import PADDED_VOCAB, kv_heads
from xmesh_plan.weight_sync import COLUMN, EXPERT, REPLICATED, ROW, Fused, Target, WeightSync
from xmesh_plan.weight_sync_demo import ENGINE, FP8, Config, TinyLlama, cast_reference, check, engine_tensors, references, say

NAN = float("nan")


def vllm_vocab_shard(full: torch.Tensor, tp_rank: int, tp_size: int, pad_to: int) -> torch.Tensor:
    """VocabParallelEmbedding's parameter on one TP rank after its weight_loader: pad_vocab_size, then
    vocab_range_from_global_vocab_size (divide, rank * per_partition), clipped to the real vocabulary; the loaded
    rows at the top, the rest padding (NaN here: what the engine had before)."""
    vocab = full.shape[0]
    padded = ((vocab + pad_to - 1) // pad_to) * pad_to
    assert padded % tp_size == 0
    per_partition = padded // tp_size
    start, end = min(tp_rank * per_partition, vocab), min(tp_rank * per_partition + per_partition, vocab)
    param = torch.full((per_partition, *full.shape[1:]), NAN, dtype=full.dtype)
    loaded = full.narrow(0, start, end - start)
    param[:loaded.shape[0]] = loaded
    return param


def vllm_kv_shard(full: torch.Tensor, tp_rank: int, tp_size: int, total_kv_heads: int) -> torch.Tensor:
    """QKVParallelLinear's k (or v) on one TP rank: num_kv_heads / num_kv_head_replicas from tp_size, then
    shard_id = tp_rank // num_kv_head_replicas, shard_size = num_kv_heads * head_size."""
    if tp_size >= total_kv_heads:
        num_kv_heads, replicas = 1, tp_size // total_kv_heads
    else:
        num_kv_heads, replicas = total_kv_heads // tp_size, 1
    shard_size = num_kv_heads * (full.shape[0] // total_kv_heads)
    return full.narrow(0, (tp_rank // replicas) * shard_size, shard_size)


MOE = Config(vocab=51, hidden=8, heads=4, kv_heads=2, head_dim=2, mlp=128, layers=2)  # w1 / w3: one 128-row block per expert
EXPERTS, TOP_K, MOE_TRAINER, MOE_ENGINE = 8, 2, [0, 1, 2, 3], [[4, 5, 6, 7]]


class Experts(nn.Module):
    """E experts stacked: w1 (gate) and w3 (up) [E, I, H], w2 (down) [E, H, I]."""

    def __init__(self, c: Config):
        super().__init__()
        self.w1, self.w3 = (nn.Parameter(torch.randn(EXPERTS, c.mlp, c.hidden) / c.hidden ** 0.5) for _ in range(2))
        self.w2 = nn.Parameter(torch.randn(EXPERTS, c.hidden, c.mlp) / c.mlp ** 0.5)


class MoeMlp(nn.Module):
    """A router (`gate`, [E, H]) picks TOP_K experts per token; their outputs are summed with the router's weights."""

    def __init__(self, c: Config):
        super().__init__()
        self.gate, self.experts = nn.Linear(c.hidden, EXPERTS, bias=False), Experts(c)

    def forward(self, x):
        weights, picked = self.gate(x).softmax(-1).topk(TOP_K, -1)
        dense = torch.zeros(*x.shape[:-1], EXPERTS).scatter(-1, picked, weights)
        e = self.experts
        h = nn.functional.silu(torch.einsum("bth,eih->btei", x, e.w1)) * torch.einsum("bth,eih->btei", x, e.w3)
        return (torch.einsum("btei,ehi->bteh", h, e.w2) * dense[..., None]).sum(-2)


class TinyMoe(TinyLlama):
    """The demo's Llama-like decoder with an MoE MLP in every layer (model.layers.{i}.mlp.gate.weight, .experts.w1, ...)."""

    def __init__(self, c: Config = MOE):
        super().__init__(c)
        for layer in self.model.layers:
            layer.mlp = MoeMlp(c)


def moe_shapes() -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: p.shape for name, p in TinyMoe().state_dict().items()}


def fused_w13(name: str) -> str:
    return name.replace(".experts.w1", ".experts.w13_weight")


FUSED_QKV = "model.layers.0.self_attn.qkv_proj.weight"
QKV_PARTS = tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def moe_rule(name: str):
    """The engine's rule of trainer tensor `name` (w1 stands for the fused w13, w3 has none of its own)."""
    for suffix, rule in (("embed_tokens.weight", PADDED_VOCAB), ("lm_head.weight", PADDED_VOCAB), ("q_proj.weight", COLUMN),
                         ("k_proj.weight", kv_heads(MOE.kv_heads)), ("v_proj.weight", kv_heads(MOE.kv_heads)),
                         ("o_proj.weight", ROW), ("experts.w1", EXPERT), ("experts.w2", EXPERT)):
        if name.endswith(suffix):
            return rule
    return REPLICATED  # norms, the router


def vllm_shard(name: str, full: dict[str, torch.Tensor], tp: int, size: int) -> torch.Tensor:
    """What the engine's TP rank `tp` of `size` holds of trainer tensor `name` by vLLM's rules, sliced from `full`."""
    if name == FUSED_QKV:  # QKVParallelLinear: this rank's q share, then its KV head's k and v
        return torch.cat([vllm_shard(part, full, tp, size) for part in QKV_PARTS])
    value = full[name]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return vllm_vocab_shard(value, tp, size, 64)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return vllm_kv_shard(value, tp, size, MOE.kv_heads)
    if name.endswith("q_proj.weight"):
        return value.chunk(size, 0)[tp]
    if name.endswith("o_proj.weight"):
        return value.chunk(size, 1)[tp]
    if name.endswith("experts.w1"):  # FusedMoE's w13_weight of this rank's experts
        return torch.cat([value, full[name.replace("w1", "w3")]], 1).chunk(size, 0)[tp]
    if name.endswith("experts.w2"):
        return value.chunk(size, 0)[tp]
    return value


def moe_cast(name: str) -> tuple[str | None, str | None]:
    """The converting engine's dtype and scale kind of trainer tensor `name`: the stacked experts in FP8 with 128x128
    block scales per expert, embeddings and LM head float16, the rest (attention, norms, router) bfloat16."""
    if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
        return FP8, "block"
    return ("float16", None) if name.endswith(("embed_tokens.weight", "lm_head.weight")) else ("bfloat16", None)


def moe_engine(mesh: DeviceMesh, converted: bool = False) -> dict[str, Target]:
    """This engine rank's tensors (NaN: nothing synced yet), the padded ones with their padding rows; `converted`:
    each in the dtype `moe_cast` gives it (plain: the trainer's)."""
    size, out = mesh.size(1), {}
    shapes, tp = moe_shapes(), mesh.get_coordinate()[1]

    def target(local, layout, name: str, **source) -> Target:
        dtype, scale = moe_cast(name) if converted else (None, None)
        tensor = torch.full(local, NAN).to(getattr(torch, dtype or "float32"))
        return Target(tensor, layout, dtype=dtype, scale=scale, **source)

    for name, shape in shapes.items():
        if name.endswith("experts.w3") or name in QKV_PARTS[1:]:
            continue
        if name == QKV_PARTS[0]:
            local = vllm_shard(FUSED_QKV, {p: torch.zeros(shapes[p]) for p in QKV_PARTS}, tp, size).shape
            out[FUSED_QKV] = target(local, COLUMN, name,
                                    source=Fused(QKV_PARTS, rules=(None, kv_heads(MOE.kv_heads), kv_heads(MOE.kv_heads))))
        elif name.endswith("experts.w1"):
            out[fused_w13(name)] = target((EXPERTS // size, 2 * MOE.mlp, MOE.hidden), EXPERT, name,
                                          source=Fused((name, name.replace("w1", "w3")), dim=1))
        else:
            local = vllm_shard(name, {name: torch.zeros(shape)}, tp, size).shape
            out[name] = target(local, moe_rule(name), name)
    return out


def moe_check(targets: dict[str, Target], mesh: DeviceMesh, full: dict[str, torch.Tensor], scales: dict | None = None) -> str:
    """'ok' when every element of every engine tensor is what vLLM's rule takes from the trainer's full tensors, cast
    first where the engine converts (`cast_reference`: torch's own cast, FP8 scales computed block by block of each
    expert), and every FP8 scale (`scales`: WeightSync's) is vLLM's rule applied to those scales; else the first that is not."""
    tp, size = mesh.get_coordinate()[1], mesh.size(1)
    converted = {n: cast_reference(v, *moe_cast(n)) for n, v in full.items()} if scales is not None else {}
    values = {n: v for n, (v, _) in converted.items()} or full
    for name, target in targets.items():
        source = name.replace("w13_weight", "w1")
        want = vllm_shard(source, values, tp, size)
        if target.tensor.dtype != want.dtype or target.tensor.shape != want.shape or not torch.equal(bits(target.tensor), bits(want)):
            return f"{name} differs"
        if target.scale is not None:
            want_scales = vllm_shard(source, {n: s for n, (_, s) in converted.items() if s is not None}, tp, size)
            if not torch.equal(bits(scales[name]), bits(want_scales)):
                return f"{name}'s scales differ"
    return "ok"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def full_values(model, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every trainer tensor's `full_tensor()` on rank 0, broadcast to every rank."""
    out = {}
    for name, shape in shapes.items():
        tensor = model.state_dict()[name].full_tensor() if model is not None else torch.empty(shape)
        dist.broadcast(tensor, 0)
        out[name] = tensor
    return out


def moe() -> None:
    """The MoE model synced into two engines of the same layouts, each twice with a training step between: one in the
    trainer's dtype, one converting (`moe_cast`: the stacked experts FP8 with block scales, the rest float16 or
    bfloat16)."""
    rank = dist.get_rank()
    trainer_mesh, engine_mesh = DeviceMesh("cpu", MOE_TRAINER), DeviceMesh("cpu", MOE_ENGINE)
    model = optimizer = None
    if rank in MOE_TRAINER:
        torch.manual_seed(0)
        model = TinyMoe()
        for layer in model.model.layers:
            fully_shard(layer, mesh=trainer_mesh)
        fully_shard(model, mesh=trainer_mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        say("moe experts", f"{type(model.state_dict()['model.layers.0.mlp.experts.w1']).__name__} "
                           f"{tuple(model.state_dict()['model.layers.0.mlp.experts.w1'].to_local().shape)}")
    targets = moe_engine(engine_mesh) if rank not in MOE_TRAINER else {}
    converting = moe_engine(engine_mesh, converted=True) if rank not in MOE_TRAINER else {}
    given = {"trainer": model.state_dict()} if model is not None else {"inference": targets, "inference_mesh": MOE_ENGINE}
    converted = {"trainer": model.state_dict()} if model is not None else {"inference": converting, "inference_mesh": MOE_ENGINE}
    with WeightSync(**given) as sync, WeightSync(**converted) as fp8:
        before = {}
        for step in range(2):
            sync.run()
            fp8.run()
            full = full_values(model, moe_shapes())
            if targets:
                result = moe_check(targets, engine_mesh, full)
                if before:
                    result += f", changed {any(not torch.equal(before[n], t.tensor) for n, t in targets.items() if n in before)}"
                before = {n: t.tensor.clone() for n, t in targets.items() if not n.endswith(("embed_tokens.weight", "lm_head.weight"))}
                say(f"moe step {step}", result)
                say(f"moe fp8 step {step}", moe_check(converting, engine_mesh, full, fp8.scales))
            else:
                say(f"moe step {step}", "sent")
                say(f"moe fp8 step {step}", "sent")
            if model is not None:
                torch.manual_seed(1)
                ids = torch.randint(0, MOE.vocab, (2, 5))
                nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()


def fsdp_tp() -> None:
    """TP over mesh dim "tp" (parallelize_module), then FSDP2 over "dp": torch's FSDP + TP, strided shards included."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    engine_mesh = DeviceMesh("cpu", ENGINE)
    model = None
    if rank < 4:
        torch.manual_seed(0)
        model = TinyLlama()
        plan = {"model.embed_tokens": RowwiseParallel(), "model.norm": SequenceParallel(), "lm_head": ColwiseParallel()}
        for i in range(len(model.model.layers)):
            at = f"model.layers.{i}"
            plan |= {f"{at}.input_layernorm": SequenceParallel(), f"{at}.post_attention_layernorm": SequenceParallel(),
                     f"{at}.self_attn.o_proj": RowwiseParallel(), f"{at}.mlp.down_proj": RowwiseParallel(),
                     **{f"{at}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
                     **{f"{at}.mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")}}
        parallelize_module(model, mesh["tp"], plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        say("fsdp_tp q_proj placements", model.state_dict()["model.layers.0.self_attn.q_proj.weight"].placements)
    targets = engine_tensors(engine_mesh) if rank >= 4 else {}
    given = {"trainer": model.state_dict()} if model is not None else {"inference": targets, "inference_mesh": ENGINE}
    with WeightSync(**given) as sync:
        for step in range(2):
            sync.run()
            refs = references(model, dist.group.WORLD)
            say(f"fsdp_tp step {step}", check(targets, engine_mesh, refs) if targets else "sent")
            if model is not None:  # an optimizer's in-place update, shard by shard
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-0.5)


def main() -> int:
    dist.init_process_group("gloo")
    for part in sys.argv[1:] or ["moe", "fsdp_tp"]:
        {"moe": moe, "fsdp_tp": fsdp_tp}[part]()
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
