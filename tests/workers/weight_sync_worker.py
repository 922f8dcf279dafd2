"""One gloo rank of tests/test_weight_sync.py: a tiny Llama-like model synced from FSDP2 into two TP=2 replicas.

`python tests/workers/weight_sync_worker.py MODE`, with env:// variables (tests/support/launch.py):
- `joint`: 8 ranks of one world; ranks 0-3 train (FSDP2 `fully_shard` on a mesh of 4), ranks 4-7 are two TP=2
  replicas ([[4, 5], [6, 7]]). Two syncs with a training step between, each destination element checked bit for
  bit against the trainer's `full_tensor()`; a second WeightSync of the same layouts (the plan cache); ranks 0-3 as
  trainer and engine at once (colocated); qkv and gate_up fused on the engine; the demo's fused and converting engine
  (`weight_sync_demo.converted_sync`: FP8 with block and per-tensor scales, float16, bfloat16); then mismatches, each of which must fail every rank with the same line within WeightSync's 5 s deadline.
- `trainer` / `inference`: the same sync as two launches of 4 ranks each, joined by `transfer_group` at
  127.0.0.1:$TRANSFER_PORT (trainer ranks are transfer ranks 0-3, inference ranks 4-7).
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
from xmesh_plan.weight_sync_demo import (ENGINE, TINY, check, converted_sync, engine_tensors, references, say, shapes, steps,
                                         sync_model, trainer_model)


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
    refs = references(model, dist.group.WORLD)
    if model is not None:
        say("fused", "sent")
        return
    tp = mesh.get_coordinate()[1]
    ok = all(torch.equal(t.tensor.view(torch.int32), torch.cat([refs[p].chunk(2)[tp] for p in groups[n]]).view(torch.int32))
             for n, t in targets.items())
    say("fused", "ok" if ok else "differs")


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
