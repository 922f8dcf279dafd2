"""WeightSync against `full_tensor()` + broadcast + slice, per sync, on 8 gloo ranks (one torchrun launch).

The demo's Llama-like model at the size of `planner/weight_sync.py`'s TOY (vocabulary 4096, hidden 256, 2
layers; float32, 15.5 MiB) under FSDP2 `fully_shard` on ranks 0-3, into two TP=2 replicas on ranks 4-7
(`xmesh_plan.weight_sync_demo`). Each iteration times three ways of syncing, taking turns, between barriers:
**WeightSync** (`sync.run()`: one plan, received straight into the engine's tensors), **the same plan into the
executor's buffers, then copied** (`TransferExecutor.run()` without `into`, each shard then copied into its
tensor: what receiving in place saves) and **full_tensor + broadcast + slice** (each tensor gathered on the
trainer ranks by `full_tensor()`, broadcast from rank 0 to every rank, and each inference rank's part copied
into its tensor), as the issue's user synced. Each is checked bit for bit against `full_tensor()` once.
2 CPU cores and 8 ranks: ratios, not speed figures.

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

    def copied() -> None:  # the plan's own check and move, into the executor's buffers, then one copy per tensor
        sync._agree_step(sync._local_problem())
        got = sync.executor.run({name: sync.trainer[source].to_local() for name, source in sync.sources.items()}
                                if state is not None else None)
        for name, (tensor, _) in targets.items():
            tensor.copy_(got[name])

    ways = {"weight_sync_ms": sync.run, "executor_buffers_then_copy_ms": copied, "full_tensor_broadcast_slice_ms": baseline}
    verdicts = []
    for run in ways.values():
        for tensor, _ in targets.values():  # each way must write every element itself
            tensor.fill_(float("nan"))
        run()
        refs = references(model, dist.group.WORLD, config)  # a collective: every rank takes part
        verdicts.append(check(targets, mesh, refs) if targets else "ok")
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(iters):
        for name, run in ways.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            times[name].append((time.perf_counter() - start) * 1e3)
    bad = torch.tensor([sum(v != "ok" for v in verdicts)])
    dist.all_reduce(bad)
    if dist.get_rank() == 0:
        print(json.dumps({"tensors": len(sync.problem.tensors), "mib": sync.problem.nbytes / 2**20, "checked": not bad.item(),
                          **{name: statistics.median(t) for name, t in times.items()}}), flush=True)
    sync.close()
    dist.destroy_process_group()


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
    if not row["checked"]:
        sys.exit("a destination element differs from full_tensor(); nothing written")
    write_json("weight_sync_torch.json", {"command": f"{COMMAND} --iters {iters}", "iters": iters, "ranks": 8, **row})
    print(f"{row['tensors']} tensors, {row['mib']:.1f} MiB: WeightSync {row['weight_sync_ms']:.2f} ms, into the executor's "
          f"buffers then copied {row['executor_buffers_then_copy_ms']:.2f} ms "
          f"({row['executor_buffers_then_copy_ms'] / row['weight_sync_ms']:.2f}x), full_tensor + broadcast + slice "
          f"{row['full_tensor_broadcast_slice_ms']:.2f} ms ({row['full_tensor_broadcast_slice_ms'] / row['weight_sync_ms']:.2f}x) per sync")
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
