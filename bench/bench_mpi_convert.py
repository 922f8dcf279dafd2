"""The MPI engine's conversion at the sender and receive into the caller's arrays, per weight sync, on 8 `mpiexec` ranks.

A weight-sync-like plan (FSDP over 4 ranks -> two TP=2 replicas on the other 4: per layer qkv and gate_up FP8 with
128x128 block scales, o FP8 with a per-tensor scale its 4 senders agree on, down bf16; an fp16 embedding) is run by
three variants taking turns in one launch (each first in a round in turn), `--rounds` times `--iters` syncs each:

- `cast first`: every tensor cast in start(), before the first message (the swapped per-tensor ones once the amax
  swaps arrive), emulated on the engine by casting each tensor as soon as it may be cast; results in the engine's own
  buffers, then copied into the caller's arrays (what a caller without `into` does);
- `cast per tensor`: the engine as it is (each tensor cast just before its first reader), own buffers + the copy;
- `cast per tensor, into`: the same, received straight into the caller's arrays (`run(shards, into=...)`).

Each sync's wall time is the slowest rank's (a barrier before each); CPU seconds are summed over the ranks (and over the
sending and the receiving ranks apart); start() is the slowest rank's time in `start()`. The figure
per variant is the median over its syncs; ratios are against `cast first`. 8 ranks on a 2-core machine: the ratios,
not the times, mean anything, and only where they exceed the spread between rounds (printed).

    .venv/bin/python -m bench.bench_mpi_convert [--layers 4] [--iters 5] [--rounds 3]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
VARIANTS = ("cast first", "cast per tensor", "cast per tensor, into")
HIDDEN, FFN, VOCAB = 512, 1024, 4096


def problem(layers: int) -> dict:
    """The transfer problem: 8 devices, FSDP on 0-3, two TP=2 replicas on 4-7."""
    tensors = [{"name": "embed", "shape": [VOCAB, HIDDEN], "src": "S0 R", "dst": "S1 R", "dst_dtype": "fp16"}]
    for k in range(layers):
        tensors += [{"name": f"l{k}.qkv", "shape": [3 * HIDDEN, HIDDEN], "src": "S0 R", "dst": "S1 R", "dst_dtype": "fp8", "scale": "block"},
                    {"name": f"l{k}.o", "shape": [HIDDEN, HIDDEN], "src": "S0 R", "dst": "R S1", "dst_dtype": "fp8", "scale": "tensor"},
                    {"name": f"l{k}.gate_up", "shape": [2 * FFN, HIDDEN], "src": "S0 R", "dst": "S1 R", "dst_dtype": "fp8", "scale": "block"},
                    {"name": f"l{k}.down", "shape": [HIDDEN, FFN], "src": "S0 R", "dst": "R S1", "dst_dtype": "bf16"}]
    return {"src_mesh": {"shape": [4], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [2, 2], "devices": [4, 5, 6, 7]},
            "cluster": {"devices_per_host": 8}, "dtype": "float32", "tensors": tensors}


def cast_first(engine) -> None:
    """Make `engine` cast every tensor as soon as it may: the unswapped ones in start(), before any message, the
    swapped ones as their amaxes are merged (what the engine did before it cast per tensor)."""
    prepare, merge = engine._prepare_casts, engine._merge_amaxes
    unswapped = tuple(k for k, (_, c, _) in enumerate(engine.converting) if not c.peers)
    swapped = tuple(k for k, (_, c, _) in enumerate(engine.converting) if c.peers)

    def prepare_and_cast() -> None:
        prepare()
        engine._cast(unswapped)

    def merge_and_cast() -> None:
        merge()
        engine._cast(swapped)

    engine._prepare_casts, engine._merge_amaxes = prepare_and_cast, merge_and_cast


def worker(plan_path: str, iters: int, rounds: int) -> None:
    import numpy as np
    from mpi4py import MPI

    from xmesh_plan.executor import TransferExecutor
    from xmesh_plan.schemas.plan import read_plan_file

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    plan = read_plan_file(plan_path)
    executors = {v: TransferExecutor(plan, comm, timeout_s=300.0).prepare() for v in VARIANTS}
    cast_first(executors["cast first"].engine)
    ex = executors["cast per tensor"]
    rng = np.random.default_rng(rank)
    shards = {name: rng.standard_normal(t.given_shape).astype(np.float32) for name, t in zip(ex.names, ex.program.tensors)
              if t.given_shape is not None}
    mine = {name: np.empty(t.dst_shape, ex.engine.dtypes[k]) for k, (name, t) in enumerate(zip(ex.names, ex.program.tensors))
            if t.dst_shape is not None}  # the inference engine's own tensors

    def sync(variant: str) -> float:
        """One sync into `mine`; the seconds start() took."""
        ex, into = executors[variant], variant.endswith("into")
        began = time.perf_counter()
        ex.start(shards or None, into=mine or None) if into else ex.start(shards or None)
        started = time.perf_counter() - began
        out = ex.wait()
        if not into:
            for name, array in mine.items():
                np.copyto(array, out[name])
        return started

    for variant in VARIANTS:  # warm up: binds, own buffers, first casts
        sync(variant)
    first = {name: array.copy() for name, array in mine.items()}
    for variant in VARIANTS[1:]:
        sync(variant)
        assert all(np.array_equal(first[name].view(np.uint8), array.view(np.uint8)) for name, array in mine.items()), variant
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:  # each variant first in a round in turn
            for _ in range(iters):
                comm.Barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                started = sync(variant)
                cpu = time.process_time() - cpu
                comm.Barrier()
                wall = time.perf_counter() - wall
                times[variant].append((r, wall, cpu, started))
    gathered = comm.gather((bool(shards), times), root=0)
    for ex in executors.values():
        ex.close()
    if rank == 0:
        out, senders = {}, [g for sends, g in gathered if sends]
        gathered = [g for _, g in gathered]
        for variant in VARIANTS:
            walls = [max(g[variant][i][1] for g in gathered) for i in range(len(times[variant]))]
            cpus = [sum(g[variant][i][2] for g in gathered) for i in range(len(times[variant]))]
            sending = [sum(g[variant][i][2] for g in senders) for i in range(len(times[variant]))]
            starts = [max(g[variant][i][3] for g in gathered) for i in range(len(times[variant]))]
            per_round = [statistics.median(w for (r, *_), w in zip(times[variant], walls) if r == k) for k in range(rounds)]
            out[variant] = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "round_wall_s": per_round,
                            "start_s": statistics.median(starts), "sender_cpu_s": statistics.median(sending),
                            "receiver_cpu_s": statistics.median(c - s for c, s in zip(cpus, sending))}
        print("RESULT " + json.dumps(out), flush=True)


@click.command(help=__doc__.splitlines()[0])
@click.option("--layers", type=int, default=4, show_default=True)
@click.option("--iters", type=int, default=5, show_default=True, help="syncs per variant and round")
@click.option("--rounds", type=int, default=3, show_default=True, help="rounds, the variants taking turns in each")
@click.option("--worker-plan", hidden=True)
def main(layers: int, iters: int, rounds: int, worker_plan: str | None) -> None:
    if worker_plan:
        worker(worker_plan, iters, rounds)
        return
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.transfer_io import build_transfer
    from xmesh_plan.schemas.plan import write_atomic

    plan = compile_plan(build_transfer(problem(layers)))
    mb = sum(4 * t["shape"][0] * t["shape"][1] for t in problem(layers)["tensors"]) / 2**20
    with tempfile.TemporaryDirectory(prefix="bench-mpi-convert-") as folder:
        path = Path(folder) / "sync.plan.json"
        write_atomic(path, plan.to_json())
        cmd = [str(MPIEXEC), "-n", "8", sys.executable, "-m", "bench.bench_mpi_convert", "--worker-plan", str(path),
               "--iters", str(iters), "--rounds", str(rounds)]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                                env={"PYTHONPATH": str(ROOT), "PATH": str(MPIEXEC.parent), "OMP_NUM_THREADS": "1"})
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result.returncode or line is None:
        sys.exit(f"the launch failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    out = json.loads(line.removeprefix("RESULT "))
    base = out[VARIANTS[0]]
    print(f"{len(plan.problem.tensors)} tensors ({mb:.1f} MiB float32 at the source), 8 ranks, {rounds} rounds x {iters} syncs per variant")
    for variant, row in out.items():
        print(f"{variant:24s} wall {row['wall_s'] * 1e3:8.1f} ms ({row['wall_s'] / base['wall_s']:.3f}x)  "
              f"cpu {row['cpu_s']:.3f} s summed over ranks ({row['cpu_s'] / base['cpu_s']:.3f}x; senders {row['sender_cpu_s']:.3f} s "
              f"{row['sender_cpu_s'] / base['sender_cpu_s']:.3f}x, receivers {row['receiver_cpu_s']:.3f} s "
              f"{row['receiver_cpu_s'] / base['receiver_cpu_s']:.3f}x)  "
              f"start() {row['start_s'] * 1e3:.1f} ms  "
              f"rounds {', '.join(f'{w * 1e3:.0f}' for w in row['round_wall_s'])} ms")


if __name__ == "__main__":
    main()
