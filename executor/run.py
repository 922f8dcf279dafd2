"""`mpiexec -n N python -m executor.run PLAN... --check`: reshard a pattern, check it bit for bit, time it.

For each plan: shrink the tensor to fit this machine (`--max-mb`, or exact `--scale 4,4,2`), fill
every source shard with a pattern of global indices, run `--warmup` + `--iters` reshards, and print
on rank 0 the time per iteration (slowest rank, median) and the achieved bandwidth (bytes moved
between devices per iteration over that time). With `--check`, the destination buffers are poisoned
before the last iteration and every destination shard is then compared bit for bit.

    mpiexec -n 16 python -m executor.run plans/case4.plan.json --check
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from schemas import Plan, load_plan
from schemas.geometry import region_size

from .errors import ExecutorError, PeerTimeoutError, PlanMismatchError
from .executor import BACKENDS, DEFAULT_POLL_S, ReshardingExecutor, poll
from .pattern import fill, mismatches
from .scale import factors_for, scale_plan


def bytes_moved(plan: Plan) -> int:
    """Bytes that cross from one device to another in one reshard (local copies excluded)."""
    size = plan.problem.itemsize
    total = 0
    for op in plan.operations:
        if op.kind in ("send", "broadcast"):
            total += region_size(op.region) * size * len(op.dsts)
        elif op.kind == "allgather":
            total += sum(region_size(p) for p in op.parts if all(a < b for a, b in p)) * size * (len(op.dsts) - 1)
    return total


def _parse_scale(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        raise SystemExit(f"--scale {text!r}: give one integer factor per tensor dim, e.g. --scale 4,4,2") from None


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m executor.run", description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+", type=Path, help="plan files (plans/*.plan.json)")
    parser.add_argument("--check", action="store_true", help="compare every destination shard with the pattern, bit for bit")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    parser.add_argument("--max-mb", type=float, default=64.0, help="shrink the tensor to at most this many MiB (default 64)")
    parser.add_argument("--scale", help="exact shrink factors per dim instead of --max-mb, e.g. 4,4,2 (1,1,1 = full size)")
    parser.add_argument("--backend", choices=BACKENDS, default="mpi")
    parser.add_argument("--gpu", type=int, help="nccl: put every rank on this GPU instead of device %% devices_per_host")
    parser.add_argument("--fake-hosts", action="store_true",
                        help="nccl: give each rank its own NCCL_HOSTID and the socket transport, so several ranks can share one GPU")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a rank gives up (default 60)")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    args.scale = _parse_scale(args.scale)
    return args


def _reduce(comm, values: np.ndarray, op) -> np.ndarray:
    out = np.empty_like(values)
    poll(comm.Iallreduce(values, out, op=op), 60.0, DEFAULT_POLL_S, "collecting results")
    return out


def _barrier(comm) -> None:
    poll(comm.Ibarrier(), 60.0, DEFAULT_POLL_S, "barrier between iterations")


def demo(plan: Plan, comm, args: argparse.Namespace) -> tuple[str, bool]:
    """Run one plan; returns rank 0's report line and whether every check passed."""
    from mpi4py import MPI

    ex = ReshardingExecutor(plan, comm, backend=args.backend, timeout_s=args.timeout, gpu=args.gpu).prepare()
    problem, program = plan.problem, ex.program
    shard = fill(program.src_block, problem.shape, ex.engine.dtype) if program.src_block else None
    if args.backend == "nccl" and shard is not None:
        shard = ex.engine.adopt(shard)
    times = np.zeros(args.iters)
    for i in range(args.warmup + args.iters):
        last = i == args.warmup + args.iters - 1
        if last and args.check and ex.engine.dst is not None:
            ex.engine.poison()
        _barrier(comm)
        start = time.perf_counter()
        out = ex.run(shard)
        if i >= args.warmup:
            times[i - args.warmup] = time.perf_counter() - start
    bad, first = (0, None)
    if args.check and out is not None:
        bad, first = mismatches(ex.engine.host_copy(out), program.dst_block, problem.shape)
        if bad:
            print(f"rank {comm.Get_rank()}: device {program.device}: {bad} elements differ, first at global index {first}",
                  file=sys.stderr, flush=True)
    slowest = _reduce(comm, times, MPI.MAX)
    failures = _reduce(comm, np.array([bad, int(bad > 0)], np.int64), MPI.SUM)
    median = float(np.median(slowest))
    moved = bytes_moved(plan)
    line = (f"{problem.name or 'plan'}: {'x'.join(map(str, problem.shape))} {problem.dtype} ({problem.nbytes / 2**20:.1f} MiB), "
            f"{comm.Get_size()} ranks, {len(plan.operations)} ops ({','.join(sorted({o.kind for o in plan.operations}))}), "
            f"{args.backend}: {median * 1e3:.2f} ms/iter median of {args.iters} (min {slowest.min() * 1e3:.2f}), "
            f"moved {moved / 2**20:.1f} MiB/iter = {moved / median / 1e9:.3f} GB/s")
    if args.check:
        line += (f"; check ok: {len(problem.dst.mesh.devices)} destination shards bit-exact" if not failures[0]
                 else f"; CHECK FAILED: {failures[0]} elements differ on {failures[1]} devices")
    return line, not failures[0]


def fake_hosts(rank: int) -> None:
    """Make NCCL treat each rank as its own host (untested here: no GPU on the development machine).

    NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"); the host is identified
    by a hash that NCCL_HOSTID overrides. Sockets replace the P2P and shared-memory transports, which
    assume distinct GPUs. Must run before the first NCCL call.
    """
    os.environ["NCCL_HOSTID"] = f"xmesh-rank-{rank}"
    for key in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("NCCL_NET", "Socket")


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    from mpi4py import MPI

    comm, status = MPI.COMM_WORLD, 0
    rank = comm.Get_rank()
    if args.fake_hosts:
        fake_hosts(rank)
    for path in args.plans:
        try:
            plan = load_plan(path)
        except (OSError, ValueError) as err:
            print(f"rank {rank}: error: cannot read plan {path}: {str(err).splitlines()[0]}; compile one with `xmesh-plan compile`",
                  file=sys.stderr, flush=True)
            return 2
        try:
            full = plan.problem
            factors = args.scale or factors_for(plan, int(args.max_mb * 2**20))
            plan = scale_plan(plan, factors)
            line, ok = demo(plan, comm, args)
            if rank == 0:
                shrink = "" if set(factors) == {1} else f" [scaled from {'x'.join(map(str, full.shape))} by {','.join(map(str, factors))}]"
                print(line + shrink, flush=True)
            status = status or (0 if ok else 1)
        except PlanMismatchError as err:  # raised on every rank, before any byte moved
            if rank == 0 or not err.same_on_every_rank:
                print(f"rank {rank}: error: {path.name}: {err}", file=sys.stderr, flush=True)
            status = 2
        except ExecutorError as err:  # a peer died or hangs: requests are pending, so MPI cannot finalize
            print(f"rank {rank}: error: {path.name}: {err}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(3 if isinstance(err, PeerTimeoutError) else 2)
    return status


if __name__ == "__main__":
    sys.exit(main())
