"""WeightSync against `full_tensor()` + broadcast + slice, per sync, on 8 gloo ranks (one torchrun launch).

The demo's Llama-like model at the size of `planner/weight_sync.py`'s TOY (vocabulary 4096, hidden 256, 2
layers; float32, 15.5 MiB) under FSDP2 `fully_shard` on ranks 0-3, into two TP=2 replicas on ranks 4-7
(`xmesh_plan.weight_sync_demo`). Each iteration times both ways of syncing, taking turns, between barriers:
**WeightSync** (`sync.run()`: one plan, the weights copied into the engine's tensors) and **full_tensor +
broadcast + slice** (each tensor gathered on the trainer ranks by `full_tensor()`, broadcast from rank 0 to
every rank, and each inference rank's part copied into its tensor), as the issue's user synced. Two more
take turns with them (`fused_ways`), into an engine whose q, k, v and gate, up are fused (`qkv_proj`,
`gate_up_proj`): **WeightSync, fused in the plan** (float32 destinations) and **redistribute per tensor + cat +
cast** (`xmesh_plan.redistribute` of each trainer tensor to its TP layout, then each fused parameter
concatenated and every parameter cast into the engine's float16 tensors). Each is checked bit for bit against
`full_tensor()` (cast by torch) once. Then, for an engine that fuses and converts (`converted_ways`: qkv and
gate_up fused in FP8 with block scales, o and down in FP8 with per-tensor scales, the rest float16/bfloat16,
`weight_sync_demo.converted_targets`, on a model whose FSDP shards lie on 128-row blocks): **WeightSync** with
the fusion and the conversion in the plan against **full_tensor + broadcast + slice + cat + cast** (each
inference rank slices its TP share of every part, concatenates the fused ones and casts with the scales it
computes), both checked bit for bit against torch's own cast once. 2 CPU cores and 8 ranks: ratios, not speed
figures.

    .venv/bin/python -m bench.bench_weight_sync_torch [--iters 10]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import click

from bench.report import ROOT, update_benchmarks_doc, write_json

COMMAND = ".venv/bin/python -m bench.bench_weight_sync_torch"


def rank_main(iters: int) -> None:
    """One rank of the launch; rank 0 prints the result as one JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from xmesh_plan.weight_sync_demo import PLACEMENTS, Config, check, references, shapes, sync_model

    dist.init_process_group("gloo")
    config = Config(vocab=4096, hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=1024, layers=2)
    sync, model, _, given, mesh = sync_model(config)
    targets = given.get("inference", {})

    sizes, state = shapes(config), model.state_dict() if model is not None else None

    def part(name: str, layout) -> tuple[slice, ...]:
        local, offset = compute_local_shape_and_global_offset(sizes[name], mesh, PLACEMENTS[layout])
        return tuple(slice(o, o + n) for o, n in zip(offset, local))

    parts = {name: part(name, layout) for name, (_, layout) in targets.items()}

    def baseline() -> None:
        for name, shape in sizes.items():
            full = state[name].full_tensor() if state is not None else torch.empty(shape)
            dist.broadcast(full, 0)
            if name in targets:
                targets[name][0].copy_(full[parts[name]])

    ways = {"weight_sync_ms": sync.run, "full_tensor_broadcast_slice_ms": baseline}
    verdicts = []
    for run in ways.values():
        run()
        refs = references(model, dist.group.WORLD, config)  # a collective: every rank takes part
        verdicts.append(check(targets, mesh, refs) if targets else "ok")
    more, checked, fused_sync = fused_ways(model, mesh, sizes)
    for run in more.values():
        run()
    verdicts.append(checked(references(model, dist.group.WORLD, config)))
    ways |= more
    times = take_turns(ways, iters)
    bad = torch.tensor([sum(v != "ok" for v in verdicts)])
    dist.all_reduce(bad)
    sync.close()
    fused_sync.close()
    converted = converted_ways(iters)
    if dist.get_rank() == 0:
        print(json.dumps({"tensors": len(sync.problem.tensors), "mib": sync.problem.nbytes / 2**20, "checked": not bad.item(),
                          **times, "converted": converted}), flush=True)
    dist.destroy_process_group()


CAST = "float16"  # the engine's dtype in the redistribute + cat + cast baseline


def fused_ways(model, mesh, sizes: dict) -> tuple[dict, object, object]:
    """The issue's second baseline and WeightSync into the same fused engine (every rank calls it): ({"weight_sync_fused_ms":
    run, "redistribute_cat_cast_ms": run}, a check of both engines' tensors against `references()` giving "ok" or what
    differs, the fused WeightSync to close). qkv_proj = cat(q, k, v) and gate_up_proj = cat(gate, up) per layer, column-
    parallel: TP rank t holds cat of the parts' t-th halves."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from xmesh_plan.redistribute import redistribute, set_cache_size
    from xmesh_plan.weight_sync import COLUMN, Fused, Target, WeightSync
    from xmesh_plan.weight_sync_demo import ENGINE, PLACEMENTS, TRAINER, rule

    train_mesh = DeviceMesh("cpu", TRAINER)  # every rank makes it: ranks outside it pass an empty shard
    state, engine = model.state_dict() if model is not None else None, mesh.get_coordinate() is not None
    groups = {}  # fused engine parameter -> its trainer parts
    for name in sizes:
        for module, fused, parts in (("self_attn", "qkv", ("q", "k", "v")), ("mlp", "gate_up", ("gate", "up"))):
            first = f".{module}.{parts[0]}_proj.weight"
            if name.endswith(first):
                stem = name[:-len(first)] + f".{module}."
                groups[f"{stem}{fused}_proj.weight"] = [f"{stem}{p}_proj.weight" for p in parts]
    parted = {p for parts in groups.values() for p in parts}
    local = {name: compute_local_shape_and_global_offset(shape, mesh, PLACEMENTS[rule(name)]) for name, shape in sizes.items()}
    shapes = {name: local[name][0] for name in sizes if name not in parted}
    shapes |= {name: (sum(local[p][0][0] for p in parts), *local[parts[0]][0][1:]) for name, parts in groups.items()}
    synced = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()} if engine else {}
    cast = {name: torch.full(shape, float("nan"), dtype=getattr(torch, CAST)) for name, shape in shapes.items()} if engine else {}
    given = {"trainer": state} if state is not None else {"inference": {
        name: Target(tensor, COLUMN, source=Fused(tuple(groups[name]))) if name in groups else (tensor, rule(name))
        for name, tensor in synced.items()}, "inference_mesh": ENGINE}
    sync = WeightSync(**given)
    set_cache_size(len(sizes))  # one layout per tensor at most: none recompiled
    sources = {name: state[name] if state is not None else
               DTensor.from_local(torch.empty(0), train_mesh, [Shard(0)], shape=shape, stride=torch.empty(shape).stride())
               for name, shape in sizes.items()}

    def redistribute_cat_cast() -> None:
        moved = {name: redistribute(x, mesh, PLACEMENTS[rule(name)]).to_local() for name, x in sources.items()}
        for name, tensor in cast.items():
            tensor.copy_(torch.cat([moved[p] for p in groups[name]]) if name in groups else moved[name])

    def checked(refs: dict) -> str:
        if not engine:
            return "ok"
        tp = mesh.get_coordinate()[1]
        for name, tensor in synced.items():
            part = [] if name in groups else [slice(o, o + n) for o, n in zip(local[name][1], local[name][0])]
            want = torch.cat([refs[p].chunk(2)[tp] for p in groups[name]]) if name in groups else refs[name][tuple(part)]
            if not torch.equal(tensor.view(torch.int32), want.contiguous().view(torch.int32)):
                return f"{name} differs (WeightSync, fused)"
            if not torch.equal(cast[name].view(torch.int16), want.to(getattr(torch, CAST)).view(torch.int16)):
                return f"{name} differs (redistribute + cat + cast)"
        return "ok"

    return {"weight_sync_fused_ms": sync.run, "redistribute_cat_cast_ms": redistribute_cat_cast}, checked, sync


def take_turns(ways: dict, iters: int) -> dict[str, float]:
    """Each way's median time in ms over `iters` rounds, the ways taking turns, each run between barriers."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(iters):
        for name, run in ways.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def converted_ways(iters: int) -> dict:
    """WeightSync with fusion and conversion in the plan against full_tensor() + broadcast + slice + cat + cast, taking
    turns between barriers; medians in ms, and whether both matched torch's own cast once (every rank calls it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from xmesh_plan.executor.convert import block_scales, convert, expand_scales, tensor_scale
    from xmesh_plan.weight_sync import Fused, WeightSync
    from xmesh_plan.weight_sync_demo import (ENGINE, PLACEMENTS, TRAINER, Config, check_converted, converted_targets, references,
                                             shapes, trainer_model)

    config = Config(vocab=4096, hidden=256, heads=8, kv_heads=8, head_dim=64, mlp=1024, layers=2)
    rank, mesh = dist.get_rank(), DeviceMesh("cpu", ENGINE)
    model, _ = trainer_model(DeviceMesh("cpu", TRAINER), config) if rank in TRAINER else (None, None)
    targets = converted_targets(mesh, config) if rank not in TRAINER else {}
    sync = WeightSync(**({"trainer": model.state_dict()} if model else {"inference": targets, "inference_mesh": ENGINE}))
    sizes, state = shapes(config), model.state_dict() if model is not None else None
    tp, shares = (mesh.get_coordinate()[1], mesh.size(1)) if targets else (0, 1)
    wanted = {p: name for name, t in targets.items() for p in (t.source.parts if isinstance(t.source, Fused) else (name,))}
    parts = {}
    for name, target in targets.items():
        if not isinstance(target.source, Fused):
            local, offset = compute_local_shape_and_global_offset(sizes[name], mesh, PLACEMENTS[target.layout])
            parts[name] = tuple(slice(o, o + n) for o, n in zip(offset, local))
    scales: dict[str, torch.Tensor] = {}

    def cast(name: str, mine: torch.Tensor, whole: torch.Tensor | None = None) -> None:
        """This rank's part `mine` into its target, cast with scales of its own blocks, or of the `whole` tensor."""
        target, made = targets[name], None
        if target.scale == "block":
            made = block_scales(mine, target.dtype)
            mine = convert(mine, target.dtype, expand_scales(made, tuple((0, n) for n in mine.shape)))
        elif target.scale == "tensor":
            made = tensor_scale(whole.abs().max(), target.dtype)
            mine = convert(mine, target.dtype, made)
        target.tensor.copy_(mine)
        if made is not None:
            scales[name] = made

    def baseline() -> None:
        pending: dict[str, list] = {}
        for name, shape in sizes.items():
            full = state[name].full_tensor() if state is not None else torch.empty(shape)
            dist.broadcast(full, 0)
            if name not in wanted:
                continue
            dst = wanted[name]
            if not isinstance(targets[dst].source, Fused):
                cast(dst, full[parts[dst]], full)
                continue
            pending.setdefault(dst, []).append(full.chunk(shares)[tp])
            if len(pending[dst]) == len(targets[dst].source.parts):
                cast(dst, torch.cat(pending.pop(dst)))

    ways = {"weight_sync_ms": sync.run, "full_tensor_broadcast_slice_cat_cast_ms": baseline}
    verdicts = []
    for name, run in ways.items():
        run()
        refs = references(model, dist.group.WORLD, config)
        verdicts.append(check_converted(targets, sync.scales if name == "weight_sync_ms" else scales, mesh, refs) if targets else "ok")
    times = take_turns(ways, iters)
    bad = torch.tensor([sum(v != "ok" for v in verdicts)])
    dist.all_reduce(bad)
    out = {"tensors": len(sync.problem.tensors), "mib": sync.problem.nbytes / 2**20, "checked": not bad.item(), **times}
    sync.close()
    return out


@click.command(help=__doc__.splitlines()[0])
@click.option("--iters", type=int, default=10, show_default=True, help="timed syncs of each way, taking turns")
@click.option("--rank", "as_rank", is_flag=True, hidden=True, help="run as one rank of the launch")
def main(iters: int, as_rank: bool) -> None:
    if as_rank:
        rank_main(iters)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", "-m",
           "bench.bench_weight_sync_torch", "--rank", "--iters", str(iters)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env={"OMP_NUM_THREADS": "1",
                                                                                              "PATH": str(ROOT / ".venv" / "bin")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        sys.exit(f"the launch failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    row = json.loads(lines[-1])
    if not row["checked"] or not row["converted"]["checked"]:
        sys.exit("a destination element differs from full_tensor() (or from torch's cast of it); nothing written")
    write_json("weight_sync_torch.json", {"command": f"{COMMAND} --iters {iters}", "iters": iters, "ranks": 8, **row})
    print(f"{row['tensors']} tensors, {row['mib']:.1f} MiB: WeightSync {row['weight_sync_ms']:.2f} ms, full_tensor + broadcast "
          f"+ slice {row['full_tensor_broadcast_slice_ms']:.2f} ms per sync "
          f"({row['full_tensor_broadcast_slice_ms'] / row['weight_sync_ms']:.2f}x); fused: WeightSync {row['weight_sync_fused_ms']:.2f} "
          f"ms, redistribute + cat + cast {row['redistribute_cat_cast_ms']:.2f} ms "
          f"({row['redistribute_cat_cast_ms'] / row['weight_sync_fused_ms']:.2f}x)")
    converted = row["converted"]
    print(f"fused and converted: WeightSync {converted['weight_sync_ms']:.2f} ms, full_tensor + broadcast + slice + cat + cast "
          f"{converted['full_tensor_broadcast_slice_cat_cast_ms']:.2f} ms per sync "
          f"({converted['full_tensor_broadcast_slice_cat_cast_ms'] / converted['weight_sync_ms']:.2f}x)")
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
