"""One gloo rank of tests/test_weight_sync.py: a tiny Llama-like model synced from FSDP2 into two TP=2 replicas.

`python tests/workers/weight_sync_worker.py MODE`, with env:// variables (tests/support/launch.py):
- `joint`: 8 ranks of one world; ranks 0-3 train (FSDP2 `fully_shard` on a mesh of 4), ranks 4-7 are two TP=2
  replicas ([[4, 5], [6, 7]]). Two syncs with a training step between, each destination element checked bit for
  bit against the trainer's `full_tensor()`; a second WeightSync of the same layouts (the plan cache); then
  mismatches, each of which must fail every rank with the same line within WeightSync's 5 s deadline.
- `trainer` / `inference`: the same sync as two launches of 4 ranks each, joined by `transfer_group` at
  127.0.0.1:$TRANSFER_PORT (trainer ranks are transfer ranks 0-3, inference ranks 4-7).
Each rank prints `rank R: <what>: <result>` lines for the test to compare.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from xmesh_plan.transfer_group import transfer_group
from xmesh_plan.weight_sync import COLUMN, REPLICATED, ROW, VOCAB, WeightSync, WeightSyncError

VOCAB_SIZE, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 51, 12, 3, 1, 4, 18, 2  # uneven splits on purpose
RULES = [("norm.weight", REPLICATED), ("o_proj.weight", ROW), ("down_proj.weight", ROW), ("_proj.weight", COLUMN),
         ("embed_tokens.weight", VOCAB), ("lm_head.weight", VOCAB)]
PLACEMENTS = {COLUMN: [Replicate(), Shard(0)], ROW: [Replicate(), Shard(1)], VOCAB: [Replicate(), Shard(0)],
              REPLICATED: [Replicate(), Replicate()]}  # the same layouts as DTensor placements, for the reference


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (p(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
                for p in (self.k_proj, self.v_proj))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(HIDDEN, MLP, bias=False), nn.Linear(HIDDEN, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = nn.RMSNorm(HIDDEN), Attention()
        self.post_attention_layernorm, self.mlp = nn.RMSNorm(HIDDEN), Mlp()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB_SIZE, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.model, self.lm_head = Decoder(), nn.Linear(HIDDEN, VOCAB_SIZE, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def rule(name: str):
    return next(layout for suffix, layout in RULES if name.endswith(suffix))


def shapes() -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: p.shape for name, p in TinyLlama().state_dict().items()}


def trainer_model(mesh: DeviceMesh) -> tuple[TinyLlama, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLlama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def train_step(model: TinyLlama, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB_SIZE, (2, 5))
    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def engine_tensors(mesh: DeviceMesh) -> dict[str, tuple[torch.Tensor, object]]:
    """This inference rank's part of every parameter, by the engine's rules, filled with NaN (nothing synced yet)."""
    out = {}
    for name, shape in shapes().items():
        local, _ = compute_local_shape_and_global_offset(shape, mesh, PLACEMENTS[rule(name)])
        out[name] = (torch.full(local, float("nan")), rule(name))
    return out


def references(model: TinyLlama | None, group) -> dict[str, torch.Tensor]:
    """Every parameter's full value from the trainer's `full_tensor()` (transfer rank 0), broadcast over `group`."""
    full = model.state_dict() if model is not None else {}
    out = {}
    for name, shape in shapes().items():
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


def steps(sync: WeightSync, model, optimizer, targets, mesh, group) -> None:
    """Two syncs with a training step between, each checked against the trainer's full_tensor(); the second must
    change what the first wrote (the training step moved every weight the loss reaches)."""
    before = {}
    for step in range(2):
        sync.run()
        refs = references(model, group)
        changed = any(not torch.equal(before[n], t) for n, (t, _) in targets.items()) if before else None
        say(f"step {step}", (check(targets, mesh, refs) + ("" if step == 0 else f", changed {changed}")) if targets else "sent")
        before = {name: tensor.clone() for name, (tensor, _) in targets.items()}
        if model is not None:
            train_step(model, optimizer)


def say(what: str, result: object) -> None:
    print(f"rank {os.environ['RANK']}: {what}: {result}", flush=True)


def attempt(what: str, make) -> None:
    """Run `make()` (a WeightSync built and run with a 5 s deadline) and report the error every rank must raise."""
    try:
        make().run()
        say(what, "no error")
    except WeightSyncError as err:
        say(what, f"WeightSyncError: {err}")
    except Exception as err:  # a timeout (or anything else) is reported as such, and fails the test
        say(what, f"{type(err).__name__}: {err}")


def joint() -> None:
    rank = dist.get_rank()
    train_mesh, infer_mesh = DeviceMesh("cpu", [0, 1, 2, 3]), DeviceMesh("cpu", [[4, 5], [6, 7]])
    group = dist.group.WORLD
    model, optimizer = trainer_model(train_mesh) if rank < 4 else (None, None)
    targets = engine_tensors(infer_mesh) if rank >= 4 else {}
    kwargs = {"trainer": model.state_dict()} if model else {"inference": targets, "inference_mesh": [[4, 5], [6, 7]]}
    sync = WeightSync(**kwargs)
    say("compiled", sync.compiled)
    steps(sync, model, optimizer, targets, infer_mesh, group)
    say("same layouts again, compiled", WeightSync(**kwargs).compiled)
    mismatches(rank, model, kwargs)


def mismatches(rank: int, model, kwargs) -> None:
    """Each: every rank reaches the barrier, then must fail within WeightSync's 5 s deadline, naming the cause."""
    def changed(name: str, on: int, tensor) -> dict:
        if rank != on:
            return kwargs
        return {**kwargs, "inference": {**kwargs["inference"], name: (tensor, kwargs["inference"][name][1])}}

    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"
    cases = {
        "dtype": lambda: changed(q, 5, torch.zeros(kwargs["inference"][q][0].shape, dtype=torch.float16)) if rank >= 4 else kwargs,
        "shape": lambda: changed(down, 6, torch.zeros(HIDDEN, MLP)) if rank >= 4 else kwargs,
        "missing": lambda: ({**kwargs, "inference": {k: v for k, v in kwargs["inference"].items() if k != "lm_head.weight"}}
                            if rank == 7 else kwargs),
    }
    for name, given in cases.items():
        dist.barrier()
        attempt(name, lambda: WeightSync(**given(), timeout_s=5))
    dist.barrier()
    sync = WeightSync(**kwargs, timeout_s=5)
    wrong = {k: (v.to(torch.float64) if k == "model.norm.weight" else v) for k, v in model.state_dict().items()} if rank == 2 else None
    attempt("trainer shard dtype at run()", lambda: _Run(sync, wrong))
    sync.close()


class _Run:
    """`attempt`'s object whose run() passes a state dict to WeightSync.run()."""

    def __init__(self, sync: WeightSync, trainer):
        self.sync, self.trainer = sync, trainer

    def run(self) -> None:
        self.sync.run(self.trainer)


def separate(side: str) -> None:
    """One side of the two-launch sync: this launch's own world, plus the transfer group both launches join."""
    rank = dist.get_rank()
    offset = 0 if side == "trainer" else 4
    group = transfer_group("127.0.0.1", int(os.environ["TRANSFER_PORT"]), offset + rank, 8)
    ranks = {r: offset + r for r in range(4)}
    if side == "trainer":
        model, optimizer = trainer_model(DeviceMesh("cpu", [0, 1, 2, 3]))
        targets, mesh, kwargs = {}, None, {"trainer": model.state_dict()}
    else:
        model, optimizer, mesh = None, None, DeviceMesh("cpu", [[0, 1], [2, 3]])
        targets = engine_tensors(mesh)
        kwargs = {"inference": targets, "inference_mesh": [[0, 1], [2, 3]]}
    sync = WeightSync(**kwargs, group=group, ranks=ranks)
    say("transfer rank", group.rank())
    steps(sync, model, optimizer, targets, mesh, group)
    sync.close()


def main() -> int:
    dist.init_process_group("gloo")
    mode = sys.argv[1]
    joint() if mode == "joint" else separate(mode)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
