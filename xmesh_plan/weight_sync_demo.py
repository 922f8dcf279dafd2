"""`torchrun --standalone --nproc-per-node 8 -m xmesh_plan.weight_sync_demo`: sync an FSDP2 model into TP inference tensors.

A tiny Llama-like model (torch.nn, random weights, sizes that split unevenly) trains on ranks 0-3 under FSDP2
`fully_shard`; ranks 4-7 are an inference engine of two replicas of TP=2 ([[4, 5], [6, 7]]) holding its own
parameter tensors, laid out by the engine's rules (column-, row-, vocab-parallel, replicated). One
`WeightSync` moves every parameter into those tensors; it runs twice with a training step between, and each
time every destination element is compared bit for bit with the trainer's `full_tensor()` (broadcast from
rank 0). Then the same for an engine that fuses and converts (`converted_sync`, a model sized for 128x128
blocks): qkv and gate_up fused in FP8 e4m3 with block scales, o and down in FP8 with per-tensor scales,
embeddings and LM head in float16, norms in bfloat16, all converted by the senders; every element and every
scale compared bit for bit with torch's own cast of `full_tensor()` (scales computed here, block by block).
Rank 0 prints the results; exit status 1 if any element differs. `--device cuda` runs the same on CUDA tensors over
NCCL (each rank on GPU LOCAL_RANK modulo the GPUs it sees), the engine's tensors received in place.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from xmesh_plan.schemas.convert import block_box
from xmesh_plan.weight_sync import COLUMN, REPLICATED, ROW, VOCAB, Fused, Target, WeightSync

TRAINER, ENGINE = [0, 1, 2, 3], [[4, 5], [6, 7]]
RULES = [("norm.weight", REPLICATED), ("o_proj.weight", ROW), ("down_proj.weight", ROW), ("_proj.weight", COLUMN),
         ("embed_tokens.weight", VOCAB), ("lm_head.weight", VOCAB)]
PLACEMENTS = {COLUMN: [Replicate(), Shard(0)], ROW: [Replicate(), Shard(1)], VOCAB: [Replicate(), Shard(0)],
              REPLICATED: [Replicate(), Replicate()]}  # the same layouts as DTensor placements, for the reference


@dataclass(frozen=True)
class Config:
    """The model's sizes; the defaults split unevenly on purpose (51 vocabulary rows, 18 MLP columns, ...)."""

    vocab: int = 51
    hidden: int = 12
    heads: int = 3
    kv_heads: int = 1
    head_dim: int = 4
    mlp: int = 18
    layers: int = 2


TINY = Config()
BLOCKED = Config(hidden=64, heads=4, kv_heads=4, head_dim=128, mlp=512)  # FSDP shards of q, k, v, gate, up: 128 rows
FP8 = "float8_e4m3fn"
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
CASTS = [("norm.weight", "bfloat16", None), ("o_proj.weight", FP8, "tensor"), ("down_proj.weight", FP8, "tensor"),
         ("_proj.weight", FP8, "block"), ("embed_tokens.weight", "float16", None), ("lm_head.weight", "float16", None)]
BLOCK, FLOOR = 128, 1e-12  # scales: amax (at least FLOOR) of each 128x128 block, or of the tensor, over the FP8 largest


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)

    def forward(self, x):
        (b, t, _), c = x.shape, self.c
        q = self.q_proj(x).view(b, t, c.heads, c.head_dim).transpose(1, 2)
        k, v = (p(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2).repeat_interleave(c.heads // c.kv_heads, 1)
                for p in (self.k_proj, self.v_proj))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, c.heads * c.head_dim))


class Mlp(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(c.hidden, c.mlp, bias=False), nn.Linear(c.hidden, c.mlp, bias=False)
        self.down_proj = nn.Linear(c.mlp, c.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.input_layernorm, self.self_attn = nn.RMSNorm(c.hidden), Attention(c)
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(c.hidden), Mlp(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLlama(nn.Module):
    """A Llama-like decoder with Hugging Face's parameter names (model.layers.{i}.self_attn.q_proj.weight, ...)."""

    def __init__(self, c: Config = TINY):
        super().__init__()
        self.config = c
        self.model, self.lm_head = Decoder(c), nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def rule(name: str):
    return next(layout for suffix, layout in RULES if name.endswith(suffix))


def shapes(c: Config = TINY) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: p.shape for name, p in TinyLlama(c).state_dict().items()}


def trainer_model(mesh: DeviceMesh, c: Config = TINY) -> tuple[TinyLlama, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLlama(c)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def train_step(model: TinyLlama, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab, (2, 5))
    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def engine_tensors(mesh: DeviceMesh, c: Config = TINY) -> dict[str, tuple[torch.Tensor, object]]:
    """This inference rank's part of every parameter, by the engine's rules, filled with NaN (nothing synced yet)."""
    out = {}
    for name, shape in shapes(c).items():
        local, _ = compute_local_shape_and_global_offset(shape, mesh, PLACEMENTS[rule(name)])
        out[name] = (torch.full(local, float("nan")), rule(name))
    return out


def references(model: TinyLlama | None, group, c: Config = TINY) -> dict[str, torch.Tensor]:
    """Every parameter's full value from the trainer's `full_tensor()` (transfer rank 0), broadcast over `group`."""
    full = model.state_dict() if model is not None else {}
    out = {}
    for name, shape in shapes(c).items():
        tensor = full[name].full_tensor() if model is not None else torch.empty(shape)
        group.broadcast(tensor, 0).wait()
        out[name] = tensor
    return out


def check(targets, mesh: DeviceMesh, refs: dict[str, torch.Tensor]) -> str:
    """'ok' when every element of every destination tensor is bit for bit the reference's, else the first that is not."""
    for name, (tensor, layout) in targets.items():
        local, offset = compute_local_shape_and_global_offset(refs[name].shape, mesh, PLACEMENTS[layout])
        want = refs[name][tuple(slice(o, o + n) for o, n in zip(offset, local))]
        if tensor.shape != want.shape or not torch.equal(tensor.view(torch.int32), want.contiguous().view(torch.int32)):
            return f"{name} differs"
    return "ok"


def steps(sync: WeightSync, model, optimizer, targets, mesh, group) -> list[str]:
    """Two syncs with a training step between, each checked against the trainer's full_tensor() and printed; the
    second must change what the first wrote (the training step moves the weights). This rank's results."""
    before, results = {}, []
    for step in range(2):
        sync.run()
        refs = references(model, group)
        changed = any(not torch.equal(before[n], t) for n, (t, _) in targets.items()) if before else None
        results.append((check(targets, mesh, refs) + ("" if step == 0 else f", changed {changed}")) if targets else "sent")
        say(f"step {step}", results[-1])
        before = {name: tensor.clone() for name, (tensor, _) in targets.items()}
        if model is not None:
            train_step(model, optimizer)
    return results


def cast_of(name: str) -> tuple[str, str | None]:
    """The destination dtype and scale kind of parameter `name` in the converting engine."""
    return next((dtype, scale) for suffix, dtype, scale in CASTS if name.endswith(suffix))


def cast_reference(full: torch.Tensor, dtype: str, scale: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`full` as the destination dtype by torch's own `.to()`, with its FP8 scales (per tensor, or per 128x128 block
    computed block by block, of each index of the leading dims of a tensor of more than 2) and the values divided by
    them and clamped to the FP8 range first."""
    target = getattr(torch, dtype)
    if scale is None:
        return full.to(target), None
    top = torch.finfo(target).max
    if scale == "tensor":
        scales = torch.tensor([max(full.float().abs().max().item(), FLOOR) / top], dtype=torch.float32)
        return (full.float() / scales).clamp(-top, top).to(target), scales
    if full.dim() > 2:  # stacked experts [E, I, H]: each expert's own 128x128 blocks
        casts = [cast_reference(one, dtype, scale) for one in full]
        return torch.stack([values for values, _ in casts]), torch.stack([scales for _, scales in casts])
    rows, cols = full.shape
    scales = torch.empty((-(-rows // BLOCK), -(-cols // BLOCK)), dtype=torch.float32)
    out = torch.empty(full.shape, dtype=target)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = full[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scales[i, j] = max(block.abs().max().item(), FLOOR) / top  # in Python floats: the same on every device
            out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scales[i, j]).clamp(-top, top).to(target)
    return out, scales


def converted_targets(mesh: DeviceMesh, c: Config = BLOCKED, unfused: tuple[int, ...] = ()) -> dict[str, Target]:
    """This inference rank's part of every engine tensor (qkv and gate_up fused, except in the layers `unfused`, whose
    q, k, v, gate and up are destinations of their own, FP8 with block scales all the same) in its destination dtype,
    zeros until synced: `Target`s that name the dtype and FP8 scale kind."""
    sizes, out = shapes(c), {}
    tp = mesh.size(1)
    for i in (i for i in range(c.layers) if i not in unfused):
        fused = {f"model.layers.{i}.{k}": [f"model.layers.{i}.{p}" for p in parts] for k, parts in FUSED.items()}
        for name, parts in fused.items():
            rows = sum(sizes[p][0] for p in parts) // tp
            dtype, scale = cast_of(parts[0])
            out[name] = Target(torch.zeros(rows, c.hidden, dtype=getattr(torch, dtype)), COLUMN, source=Fused(tuple(parts)),
                               dtype=dtype, scale=scale)
    taken = {p for t in out.values() for p in t.source.parts}
    for name, shape in sizes.items():
        if name in taken:
            continue
        local, _ = compute_local_shape_and_global_offset(shape, mesh, PLACEMENTS[rule(name)])
        dtype, scale = cast_of(name)
        out[name] = Target(torch.zeros(local, dtype=getattr(torch, dtype)), rule(name), dtype=dtype, scale=scale)
    return out


def check_converted(targets: dict[str, Target], scales: dict, mesh: DeviceMesh, refs: dict[str, torch.Tensor]) -> str:
    """'ok' when every element and scale of every converted destination is bit for bit `cast_reference`'s of the
    trainer's full tensor (a fused one: each part's share on this rank, concatenated along `Fused.dim`), else the
    first that is not."""
    for name, target in targets.items():
        fused = isinstance(target.source, Fused)
        shares = [_share(refs[p], target, mesh) for p in (target.source.parts if fused else (name,))]
        dim = target.source.dim if fused else 0
        want = torch.cat([values for values, _ in shares], dim)
        want_scales = None if target.scale is None else shares[0][1] if target.scale == "tensor" else \
            torch.cat([s for _, s in shares], dim)
        if target.tensor.dtype != want.dtype or not torch.equal(_bits(target.tensor), _bits(want)):
            return f"{name} differs"
        if want_scales is not None and not torch.equal(_bits(scales[name]), _bits(want_scales)):
            return f"{name}'s scales differ"
    return "ok"


def _share(full: torch.Tensor, target: Target, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's box of `full` laid out by `target.layout`, cast by `cast_reference`, with its scales: per tensor
    the one, per block those of the blocks the box touches (`block_box`: 1 per index of a leading dim)."""
    values, scales = cast_reference(full, target.dtype, target.scale)
    local, offset = compute_local_shape_and_global_offset(full.shape, mesh, PLACEMENTS[target.layout])
    box = tuple((o, o + n) for o, n in zip(offset, local))
    if target.scale == "block":
        scales = scales[tuple(slice(a, b) for a, b in block_box(box))]
    return values[tuple(slice(a, b) for a, b in box)], scales


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def converted_sync(c: Config = BLOCKED) -> list[str]:
    """The fused and converting engine's sync (`converted_targets`) of a model of sizes `c` on 8 ranks, twice with a
    training step between, each checked by `check_converted` and printed ('fp8 step k'); this rank's results."""
    rank = dist.get_rank()
    mesh = DeviceMesh(_device_type(), ENGINE)
    model, optimizer = trainer_model(DeviceMesh(_device_type(), TRAINER), c) if rank in TRAINER else (None, None)
    targets = converted_targets(mesh, c) if rank not in TRAINER else {}
    given = {"trainer": model.state_dict()} if model else {"inference": targets, "inference_mesh": ENGINE}
    with WeightSync(**given) as sync:
        return converted_steps(sync, model, optimizer, targets, mesh, dist.group.WORLD, c)


def converted_steps(sync: WeightSync, model, optimizer, targets: dict[str, Target], mesh: DeviceMesh, group, c: Config = BLOCKED,
                    label: str = "fp8") -> list[str]:
    """Two runs of a converting `sync` with a training step between, each checked by `check_converted` against the
    trainer's `full_tensor()` (broadcast over `group` from its rank 0) and printed ('<label> step k'); this rank's results."""
    results = []
    for step in range(2):
        sync.run()
        refs = references(model, group, c)
        results.append(check_converted(targets, sync.scales, mesh, refs) if targets else "sent")
        say(f"{label} step {step}", results[-1])
        if model is not None:
            train_step(model, optimizer)
    return results


def say(what: str, result: object) -> None:
    print(f"rank {dist.get_rank()}: {what}: {result}", flush=True)


def sync_model(c: Config = TINY, **options) -> tuple[WeightSync, TinyLlama | None, torch.optim.Optimizer | None, dict, DeviceMesh]:
    """The sync of the demo on 8 ranks of the default group: (WeightSync, the trainer's model and optimizer or None,
    this rank's WeightSync arguments, the engine's mesh); `options` go to WeightSync. Every rank calls it."""
    rank = dist.get_rank()
    train_mesh, engine_mesh = DeviceMesh(_device_type(), TRAINER), DeviceMesh(_device_type(), ENGINE)
    model, optimizer = trainer_model(train_mesh, c) if rank in TRAINER else (None, None)
    given = {"trainer": model.state_dict()} if model else {"inference": engine_tensors(engine_mesh, c), "inference_mesh": ENGINE}
    return WeightSync(**given, **options), model, optimizer, given, engine_mesh


def _device_type() -> str:
    """Where the demo's tensors live: torch's default device ("cuda" after `--device cuda`, else "cpu")."""
    return torch.get_default_device().type


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmesh_plan.weight_sync_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo (default); cuda: NCCL, every tensor on GPU LOCAL_RANK %% the GPUs this process sees")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda: torch sees no GPU here; run with --device cpu", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.set_default_device("cuda")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if dist.get_world_size() != 8:
        if dist.get_rank() == 0:
            print("error: this demo needs 8 ranks; run it with torchrun --standalone --nproc-per-node 8", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    sync, model, optimizer, given, mesh = sync_model()
    results = steps(sync, model, optimizer, given.get("inference", {}), mesh, dist.group.WORLD)
    tensors = len(sync.problem.tensors)
    sync.close()
    converted = converted_sync()
    wrong = torch.tensor([sum(r not in ("ok", "sent", "ok, changed True") for r in results + converted)])
    dist.all_reduce(wrong)
    if dist.get_rank() == 0:
        print(f"{tensors} tensors synced twice (a training step between), every element bit-exact against full_tensor()\n"
              "fused qkv/gate_up in FP8 with block scales, o/down in FP8 with per-tensor scales, fp16/bf16 the rest: every "
              "element and scale bit-exact against torch's own cast" if not wrong.item() else f"FAILED on {wrong.item()} checks",
              flush=True)
    dist.destroy_process_group()
    return 1 if wrong.item() else 0


if __name__ == "__main__":
    sys.exit(main())
