"""One gloo rank of tests/test_weight_sync.py: a tiny Llama-like model synced from FSDP2 into two TP=2 replicas.

`python tests/workers/weight_sync_worker.py MODE`, with env:// variables (tests/support/launch.py):
- `joint`: 8 ranks of one world; ranks 0-3 train (FSDP2 `fully_shard` on a mesh of 4), ranks 4-7 are two TP=2
  replicas ([[4, 5], [6, 7]]). Two syncs with a training step between, each destination element checked bit for
  bit against the trainer's `full_tensor()`; a second WeightSync of the same layouts (the plan cache); ranks 0-3 as
  trainer and engine at once (colocated); qkv and gate_up fused on the engine; the demo's fused and converting engine
  (`weight_sync_demo.converted_sync`: FP8 with block and per-tensor scales, float16, bfloat16); then mismatches, each of which must fail every rank with the same line within WeightSync's 5 s deadline.
- `trainer` / `inference`: the same sync as two launches of 4 ranks each, joined by `transfer_group` at
  127.0.0.1:$TRANSFER_PORT (trainer ranks are transfer ranks 0-3, inference ranks 4-7); then the converting engine
  across the two launches (`separate_converted`: fused and unfused FP8 with block scales, FP8 per tensor, float16,
  bfloat16); then mismatches across the two launches, each of which must fail every rank of both with the same line within WeightSync's 5 s deadline.
`XMESH_WORKER_DEVICE=cuda` runs the two-launch syncs (not the mismatches, not `joint`) on CUDA tensors over NCCL, every
rank on GPU LOCAL_RANK modulo the GPUs it sees (bench/gpu/check.sh). After each sync the inference ranks check where the weights landed: in their own tensors (a fused one through its
parts' views), with no destination buffer of the executor's own and no view of them kept once `run()` returns.
Each rank prints `rank R: <what>: <result>` lines for the test to compare.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from xmesh_plan.transfer_group import transfer_group
from xmesh_plan.weight_sync import COLUMN, Fused, Target, WeightSync, WeightSyncError
from xmesh_plan.weight_sync_demo import (BLOCKED, ENGINE, TINY, check, converted_steps, converted_sync, converted_targets,
                                         engine_tensors, references, say, shapes, steps, sync_model, trainer_model)

DEVICE = os.environ.get("XMESH_WORKER_DEVICE", "cpu")


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
    """The demo's sync (and its checks), the plan cache, then the mismatches."""
    sync, model, optimizer, kwargs, mesh = sync_model()
    say("compiled", sync.compiled)
    steps(sync, model, optimizer, kwargs.get("inference", {}), mesh, dist.group.WORLD)
    say("in place", in_place(sync, kwargs.get("inference", {})))
    say("same layouts again, compiled", WeightSync(**kwargs).compiled)
    colocated(model)
    fused(model)
    converted_sync()
    mismatches(dist.get_rank(), model, kwargs)


def fused(model) -> None:
    """qkv and gate_up fused on the engine (ranks 4-7, two TP=2 replicas): TP rank t holds cat(q_t, k_t, v_t), each
    part's t-th half, as vLLM's QKVParallelLinear; checked against the same cat of full_tensor()'s halves."""
    mesh, sizes = DeviceMesh("cpu", ENGINE), shapes()  # every rank makes the mesh
    groups = {"model.layers.0.self_attn.qkv_proj.weight": [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"],
              "model.layers.1.mlp.gate_up_proj.weight": [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up")]}
    targets = {name: Target(torch.full((sum(sizes[p][0] for p in parts) // 2, TINY.hidden), float("nan")), COLUMN,
                            source=Fused(tuple(parts))) for name, parts in groups.items()} if model is None else {}
    given = {"trainer": model.state_dict()} if model is not None else {"inference": targets, "inference_mesh": ENGINE}
    with WeightSync(**given) as sync:
        sync.run()
        say("fused in place", in_place(sync, {n: (t.tensor, t.layout) for n, t in targets.items()}))
    refs = references(model, dist.group.WORLD)
    if model is not None:
        say("fused", "sent")
        return
    tp = mesh.get_coordinate()[1]
    ok = all(torch.equal(t.tensor.view(torch.int32), torch.cat([refs[p].chunk(2)[tp] for p in groups[n]]).view(torch.int32))
             for n, t in targets.items())
    say("fused", "ok" if ok else "differs")


def storage_uses(tensor) -> int:
    """How many tensors (views included) use `tensor`'s memory, as torch counts them."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def in_place(sync: WeightSync, targets) -> str:
    """One more sync (every rank); on an inference rank, 'ok' when it wrote the caller's tensors themselves: no
    destination buffer of the executor's own, nothing copied after, each tensor at its address and no more views of
    its memory than before the call (a view the executor kept would count)."""
    before = {name: (tensor.data_ptr(), storage_uses(tensor)) for name, (tensor, _) in targets.items()}
    sync.run()
    if not targets:
        return "sent"
    own = [name for name, shard in zip(sync.executor.names, sync.executor.engine.dsts) if shard is not None]
    moved = [name for name, (tensor, _) in targets.items() if (tensor.data_ptr(), storage_uses(tensor)) != before[name]]
    return "ok" if not own and not moved and not sync.copied else f"own buffers {own}, copied {len(sync.copied)}, kept {moved}"


def colocated(model) -> None:
    """Ranks 0-3 are both the trainer and a TP=2 engine of two replicas ([[0, 1], [2, 3]]), over a group of their own:
    each passes both mappings, and its own part moves by local copies."""
    group, mesh = dist.new_group([0, 1, 2, 3]), DeviceMesh("cpu", [[0, 1], [2, 3]])  # every rank makes both
    targets = engine_tensors(mesh) if model is not None else {}
    if model is not None:
        with WeightSync(trainer=model.state_dict(), inference=targets, inference_mesh=[[0, 1], [2, 3]], group=group) as sync:
            sync.run()
    refs = references(model, dist.group.WORLD)
    say("colocated", check(targets, mesh, refs) if model is not None else "outside")


def mismatches(rank: int, model, kwargs) -> None:
    """Each: every rank reaches the barrier, then must fail within WeightSync's 5 s deadline, naming the cause."""
    def changed(name: str, on: int, tensor) -> dict:
        if rank != on:
            return kwargs
        return {**kwargs, "inference": {**kwargs["inference"], name: (tensor, kwargs["inference"][name][1])}}

    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"
    cases = {
        "dtype": lambda: changed(q, 5, torch.zeros(kwargs["inference"][q][0].shape, dtype=torch.float16)) if rank >= 4 else kwargs,
        "shape": lambda: changed(down, 6, torch.zeros(TINY.hidden, TINY.mlp)) if rank >= 4 else kwargs,
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
    group = transfer_group("127.0.0.1", int(os.environ["TRANSFER_PORT"]), offset + rank, 8,
                           backend="nccl" if DEVICE == "cuda" else "gloo")
    ranks = {r: offset + r for r in range(4)}
    model, optimizer, targets, mesh, kwargs = one_side(side, TINY, engine_tensors)
    sync = WeightSync(**kwargs, group=group, ranks=ranks)
    say("transfer rank", group.rank())
    steps(sync, model, optimizer, targets, mesh, group)
    say("in place", in_place(sync, targets))
    sync.close()
    separate_converted(side, group, ranks)
    if DEVICE == "cpu":  # each mismatch fails collectives mid-way: checked on gloo only
        separate_mismatches(group.rank(), group, model, {**kwargs, "group": group, "ranks": ranks})
    else:  # every rank of both launches is done with the transfer group before its communicators go, none exits first
        barrier(group)
        torch.cuda.synchronize()
        group.shutdown()
        say("transfer group", "closed")


def one_side(side: str, c, make_targets) -> tuple:
    """This launch's part of a two-launch sync of the demo's model of sizes `c`: (model, optimizer, targets, engine
    mesh, WeightSync arguments but the group); the trainer trains FSDP2 on its 4 ranks, the engine is two TP=2
    replicas of its 4 ranks holding `make_targets(mesh, c)`."""
    if side == "trainer":
        model, optimizer = trainer_model(DeviceMesh(DEVICE, [0, 1, 2, 3]), c)
        return model, optimizer, {}, None, {"trainer": model.state_dict()}
    mesh = DeviceMesh(DEVICE, [[0, 1], [2, 3]])
    targets = make_targets(mesh, c)
    return None, None, targets, mesh, {"inference": targets, "inference_mesh": [[0, 1], [2, 3]]}


def separate_converted(side: str, group, ranks) -> None:
    """The converting engine across the two launches (`weight_sync_demo.converted_targets`, sizes on 128x128 blocks):
    layer 0's qkv and gate_up fused in FP8 with block scales, layer 1's q, k, v, gate, up each its own FP8 destination
    with block scales, o and down FP8 per tensor, embeddings and LM head float16, norms bfloat16; two syncs with a
    training step between, every element and scale checked against torch's own cast of `full_tensor()`."""
    model, optimizer, targets, mesh, kwargs = one_side(side, BLOCKED, lambda m, c: converted_targets(m, c, unfused=(1,)))
    with WeightSync(**kwargs, group=group, ranks=ranks) as sync:
        say("separate fp8 kinds", kinds(targets) if targets else "sent")
        converted_steps(sync, model, optimizer, targets, mesh, group, BLOCKED, label="separate fp8")


def kinds(targets) -> str:
    """How the engine's destinations are converted, counted by kind: `fused float8_e4m3fn block 4, ...`, sorted."""
    counts: dict[str, int] = {}
    for target in targets.values():
        kind = " ".join(filter(None, ["fused" if isinstance(target.source, Fused) else "", target.dtype, target.scale]))
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def separate_mismatches(rank: int, group, model, kwargs) -> None:
    """Mismatches between the two launches (transfer ranks 0-3 train, 4-7 infer): each after a barrier of both launches
    over the transfer group, then within WeightSync's 5 s deadline every rank of both must fail naming the cause."""
    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"

    def changed(name: str, on, make) -> dict:
        if rank not in on:
            return kwargs
        inference = kwargs["inference"]
        return {**kwargs, "inference": {**inference, name: (make(inference[name][0]), inference[name][1])}}

    cases = {  # the inference launch passes q_proj as float16 on all its ranks, or down_proj of the wrong shape on one
        "separate dtype": lambda: changed(q, range(4, 8), lambda t: torch.zeros(t.shape, dtype=torch.float16)),
        "separate shape": lambda: changed(down, (6,), lambda t: torch.zeros(TINY.hidden, TINY.mlp)),
    }
    for name, given in cases.items():
        barrier(group)
        attempt(name, lambda: WeightSync(**given(), timeout_s=5))
    barrier(group)
    sync = WeightSync(**kwargs, timeout_s=5)
    wrong = {k: (v.to(torch.float64) if k == "model.norm.weight" else v) for k, v in model.state_dict().items()} if rank == 2 else None
    attempt("separate trainer shard dtype at run()", lambda: _Run(sync, wrong))
    sync.close()


def barrier(group) -> None:
    """Every rank of the transfer group reaches this point (a group from `transfer_group` is not one torch.distributed's
    barrier() knows): an all-gather of one number."""
    mine = torch.zeros(1)
    group.allgather([[torch.empty(1) for _ in range(group.size())]], [mine]).wait()


def main() -> int:
    mode = sys.argv[1]
    if DEVICE == "cuda":
        if mode == "joint":
            raise SystemExit("XMESH_WORKER_DEVICE=cuda runs the two launches (trainer, inference), not joint")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.set_default_device("cuda")
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    joint() if mode == "joint" else separate(mode)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
