"""`mpiexec -disable-auto-cleanup -n N python -m xmesh_plan.executor.run PLAN... --check`: reshard a pattern, check it, time it.

For each plan: shrink the tensor to fit this machine (`--max-mb`, or exact `--scale 4,4,2`), fill
every source shard with a pattern of global indices, run `--warmup` + `--iters` reshards, and print
on rank 0 the time per iteration (slowest rank, median) and the achieved bandwidth (bytes moved
between devices per iteration over that time). With `--check`, the destination buffers are poisoned
before the last iteration and every destination shard is then compared bit for bit.

    mpiexec -disable-auto-cleanup -n 16 python -m xmesh_plan.executor.run plans/case4.plan.json --check

A rank that fails reports it and exits; every other rank stops within `--timeout` seconds, saying why,
so the whole job ends with or without `-disable-auto-cleanup` (which lets the others report).
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from xmesh_plan.schemas import Plan, PlanFileError, read_plan_file
from xmesh_plan.schemas.last_resort import DEBUG_ENV, DEBUG_FLAG, run_guarded
from xmesh_plan.schemas.plan_tensors import is_multi

from .drive import Tensor, bytes_moved, flag_error, refused_input, run_plan
from .errors import ExecutorError, PeerTimeoutError, PlanMismatchError
from .engines import ENGINES
from .executor import DEFAULT_POLL_S, poll
from .flags import MPI_RANK, UsageError, command, launcher_rank, parse
from .pattern import fill, mismatches
from .scale import factors_for, factors_per_tensor, refuse_conversion, scale_plan, scale_tensors

__all__ = ["bytes_moved", "console_main", "demo", "main"]


PROG = "python -m xmesh_plan.executor.run"
LAUNCH = "mpiexec -disable-auto-cleanup -n 16 python -m xmesh_plan.executor.run plans/case4.plan.json --check"  # docs/executor.md shows it too
EPILOG = """A rank that fails ends the job within --timeout seconds; -disable-auto-cleanup lets the
other ranks report why they stopped. Exit status: 0 ok, 1 a check failed, 2 a plan was refused,
3 a peer timed out, 4 an unexpected error; with -disable-auto-cleanup, mpiexec returns the bitwise
OR of the ranks' statuses."""
MAX_GPU = 2**31 - 1  # CUDA device ordinals are C ints
DEFAULT_TIMEOUT_S = 60.0  # --timeout's default, also for the agreement on a usage error (when no flag could be read)


def _launcher_rank() -> int:
    """This process's rank as the MPI launcher set it (read before MPI starts; 0 when not under mpiexec)."""
    return launcher_rank(*MPI_RANK)


def _parse_scale(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        factors = tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:
        factors = ()
    if not factors or any(f < 1 for f in factors):
        raise UsageError(f"--scale {text!r}: give one positive integer factor per tensor dim, e.g. --scale 4,4,2")
    return factors


def _check_numbers(args: SimpleNamespace) -> None:
    """Every numeric flag in its range, or a UsageError naming the flag and a valid value."""
    error = flag_error(args.iters, args.warmup, args.max_mb, args.timeout)
    if error is not None:
        raise UsageError(error)
    if args.gpu is not None and not 0 <= args.gpu <= MAX_GPU:
        raise UsageError(f"--gpu {args.gpu}: give a GPU index from 0 to {MAX_GPU}, e.g. --gpu 0")


@command(__doc__.splitlines()[0], epilog=f"\b\nlaunch (-n: the devices the plan uses):\n{LAUNCH}\n\n\b\n{EPILOG}")
@click.argument("plans", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--check", is_flag=True, help="compare every destination shard with the pattern, bit for bit")
@click.option("--iters", type=int, default=5, help="timed iterations (default 5)")
@click.option("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
@click.option("--max-mb", type=float, default=64.0, help="shrink the tensor to at most this many MiB (default 64)")
@click.option("--scale", help="exact shrink factors per dim instead of --max-mb, e.g. 4,4,2 (1,1,1 = full size)")
@click.option("--backend", type=click.Choice([n for n, e in ENGINES.items() if e.world == "mpi"]), default="mpi",
              help="the engine (default mpi)")
@click.option("--gpu", type=int, help="nccl: put every rank on this GPU instead of device % devices_per_host")
@click.option("--fake-hosts", is_flag=True,
              help="nccl: give each rank its own NCCL_HOSTID and the socket transport, so several ranks can share one GPU")
@click.option(DEBUG_FLAG, "debug", is_flag=True, help=f"show the full traceback of an internal error (or set {DEBUG_ENV}=1)")
@click.option("--order", type=click.Choice(["device", "posted"]),
              help="device: one operation at a time per device, in plan order, across the tensors of a multi-tensor "
                   "plan too (the default for one tensor, on --backend nccl, and for a multi-tensor plan compiled with "
                   "--max-staging-mb); posted: every message at once (the default for other multi-tensor plans on mpi, "
                   "measured faster there)")
@click.option("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds without progress before a rank gives up (default 60)")
def _command(**_) -> None:
    """The flags (`_arguments` reads them)."""


def _arguments(argv: list[str] | None) -> SimpleNamespace:
    """Parsed flags; raises UsageError (one line naming the flag) instead of printing and exiting; `--help` is printed
    by rank 0 (the other ranks exit quietly)."""
    args = parse(_command, argv, PROG, show_help=_launcher_rank() == 0)
    _check_numbers(args)
    args.scale = _parse_scale(args.scale)
    return args


class MpiCollectives:
    """The driver's barrier and reductions over an mpi4py communicator, each bounded by `--timeout` (`drive.Collectives`)."""

    def __init__(self, comm, timeout_s: float):
        self.comm, self.timeout_s = comm, timeout_s

    def barrier(self, what: str) -> None:
        poll(self.comm.Ibarrier(), self.timeout_s, DEFAULT_POLL_S, what)

    def _reduce(self, values: np.ndarray, op) -> np.ndarray:
        out = np.empty_like(values)
        poll(self.comm.Iallreduce(values, out, op=op), self.timeout_s, DEFAULT_POLL_S, "collecting results")
        return out

    def max(self, values: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        return self._reduce(values, MPI.MAX)

    def sum(self, values: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        return self._reduce(values, MPI.SUM)


def _size(nbytes: int) -> str:
    """`24 B`, `256.0 KiB`, `2.0 MiB`."""
    return f"{nbytes} B" if nbytes < 2**10 else f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def demo(plan: Plan, comm, args: SimpleNamespace) -> tuple[str, bool]:
    """Run one plan, one tensor or many (`drive.run_plan`); returns rank 0's report line and whether every check passed."""
    rank = comm.Get_rank()

    def source(t: Tensor):
        return t.engine.adopt(fill(t.src_block, t.problem.shape, t.dtype, t.salt))  # on the GPU for nccl

    def wrong(t: Tensor, shard) -> tuple[int, str]:
        count, first = mismatches(t.engine.host_copy(shard), t.dst_block, t.problem.shape, t.salt)
        return count, f", first at global index {first}"

    def report(line: str) -> None:
        print(f"rank {rank}: {line}", file=sys.stderr, flush=True)

    options = {"backend": args.backend, "timeout_s": args.timeout, "gpu": args.gpu, "order": args.order}
    done = run_plan(plan, comm, MpiCollectives(comm, args.timeout), options, args.iters, args.warmup, args.check,
                    source, wrong, report)
    problem, median, moved = plan.problem, done.median_s, bytes_moved(plan)
    if is_multi(plan):
        what = f"{len(problem.tensors)} tensors ({problem.nbytes / 2**20:.1f} MiB)"
        ok = f"{len(problem.tensors)} tensors x {len(problem.dst_mesh.devices)} destination shards bit-exact"
        failed = f"{done.wrong} elements differ in {done.wrong_shards} (tensor, device) shards"
    else:
        what = f"{'x'.join(map(str, problem.shape))} {problem.dtype} ({problem.nbytes / 2**20:.1f} MiB)"
        ok = f"{len(problem.dst.mesh.devices)} destination shards bit-exact"
        failed = f"{done.wrong} elements differ on {done.wrong_shards} devices"
    line = (f"{problem.name or 'plan'}: {what}, {comm.Get_size()} ranks, "
            f"{len(plan.operations)} ops ({','.join(sorted({o.kind for o in plan.operations}))}), "
            f"{args.backend}: {median * 1e3:.2f} ms/iter median of {args.iters} (min {done.seconds.min() * 1e3:.2f}), "
            f"moved {moved / 2**20:.1f} MiB/iter = {moved / median / 1e9:.3f} GB/s, staging {_size(done.staging)}/rank at most "
            f"({done.order} order)")
    if args.check:
        line += f"; check ok: {ok}" if not done.wrong else f"; CHECK FAILED: {failed}"
    return line, not done.wrong


def fake_hosts(rank: int) -> None:
    """Make NCCL treat each rank as its own host, so several ranks can share one GPU.

    NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"); the host is identified
    by a hash that NCCL_HOSTID overrides. Sockets replace the P2P and shared-memory transports, which
    assume distinct GPUs. Must run before the first NCCL call.
    """
    os.environ["NCCL_HOSTID"] = f"xmesh-rank-{rank}"
    for key in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("NCCL_NET", "Socket")


def _fail_alone(rank: int, message: str, code: int, line: str | None = None):
    """This rank failed and its peers may not know: report it in one line (`rank R: error: message`, or `rank R: line`)
    and exit without MPI_Finalize, which would wait for the peers for ever. The peers see the silence as a timeout
    within their own `--timeout`."""
    print(f"rank {rank}: {line or f'error: {message}'}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _leave_together(comm, status: int, timeout_s: float) -> int:
    """Finish only when every rank finished: MPI_Finalize blocks for ever on a peer that failed (and exited
    without finalizing) when the launcher does not kill the job (`mpiexec -disable-auto-cleanup`)."""
    try:
        poll(comm.Ibarrier(), timeout_s, DEFAULT_POLL_S, "the barrier where every rank finishes")
    except PeerTimeoutError as err:
        _fail_alone(comm.Get_rank(), f"{err} (a peer failed or hangs)", 3)
    return status




def _scaled(plan: Plan, args: SimpleNamespace) -> tuple[Plan, str]:
    """The plan shrunk as the flags say, and the note saying how (empty when not shrunk)."""
    refuse_conversion(plan)
    if is_multi(plan):
        if args.scale:
            raise PlanMismatchError("--scale gives one tensor's factors; a multi-tensor plan is shrunk with --max-mb")
        per_tensor = factors_per_tensor(plan, int(args.max_mb * 2**20))
        shrunk = sum(set(f) != {1} for f in per_tensor)
        return scale_tensors(plan, per_tensor), (f" [{shrunk} of {len(per_tensor)} tensors scaled down to fit --max-mb]" if shrunk else "")
    full, factors = plan.problem, args.scale or factors_for(plan, int(args.max_mb * 2**20))
    scaled = scale_plan(plan, factors)
    return scaled, ("" if set(factors) == {1} else f" [scaled from {'x'.join(map(str, full.shape))} by {','.join(map(str, factors))}]")


def main(argv: list[str] | None = None) -> int:
    asked_help = False
    try:
        args, usage_error = _arguments(argv), None
    except UsageError as err:
        args, usage_error = None, str(err)
    except SystemExit as done:  # --help, printed: this rank still joins, or MPI_Init on a rank without it waits for ever
        if done.code not in (0, None):
            raise
        args, usage_error, asked_help = None, None, True
    from mpi4py import MPI

    comm, status = MPI.COMM_WORLD, 0
    rank, timeout_s = comm.Get_rank(), args.timeout if args is not None else DEFAULT_TIMEOUT_S
    world = MpiCollectives(comm, timeout_s)
    try:
        if _help_given(world, rank, asked_help):
            return _leave_together(comm, 0 if asked_help else 2, timeout_s)
        if refused_input(world, rank, usage_error, _report):
            return _leave_together(comm, 2, timeout_s)
        if _flags_differ(world, args):
            if rank == 0:
                _report("error: the ranks were given different flags (or numbers of plans); give every rank the same "
                        "flags, e.g. one mpiexec -n N command")
            return _leave_together(comm, 2, timeout_s)
        if args.fake_hosts:
            fake_hosts(rank)
        for path in args.plans:
            try:  # ranks may be given different files (mpiexec ... : ...), so every rank learns whether any failed here
                plan, error = read_plan_file(path), None
                plan, shrink = _scaled(plan, args)
            except PlanFileError as err:
                error = str(err)
            except PlanMismatchError as err:
                error = f"{path.name}: {err}"
            if refused_input(world, rank, error, _report):
                status = 2
                break
            code = _run_one(plan, path, shrink, comm, args)
            status = status or code
    except ExecutorError as err:  # an agreement or barrier timed out: a peer died or hangs
        _fail_alone(rank, str(err), 3 if isinstance(err, PeerTimeoutError) else 2)
    except KeyboardInterrupt:  # MPI_Finalize would wait for ever for peers that do not know
        _fail_alone(rank, "interrupted", 130, "interrupted; the other ranks stop within --timeout")
    return _leave_together(comm, status, timeout_s)


def _help_given(world: MpiCollectives, rank: int, asked: bool) -> bool:
    """Whether any rank was given `--help` (it printed the help, on rank 0, and runs nothing), agreed in one reduction;
    rank 0, when it was not given it, says why it stops."""
    high = int(world.max(np.array([int(asked)], np.int64))[0])
    if high and not asked and rank == 0:
        _report("rank 0: stopped: another rank was given --help; give every rank the same flags, e.g. one mpiexec -n N command")
    return bool(high)


def _flags_differ(world: MpiCollectives, args: SimpleNamespace) -> bool:
    """Whether any two ranks were given different flags or numbers of plans (`mpiexec ... : ...`), agreed in one
    reduction: such ranks would run different collectives and wait out the timeout. Plan files may differ (each is
    checked when read)."""
    flags = {k: v for k, v in vars(args).items() if k not in ("plans", "debug")}
    mine = zlib.crc32(repr((sorted(flags.items()), len(args.plans))).encode())
    high, low = (int(v) for v in world.max(np.array([mine, -mine], np.int64)))
    return high != -low


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_one(plan: Plan, path: Path, shrink: str, comm, args: SimpleNamespace) -> int:
    """Run one plan that every rank read; its exit status (0 ok, 1 a check failed, 2 refused). A failure that
    leaves requests pending ends this rank at once (`_fail_alone`): MPI could not finalize."""
    rank = comm.Get_rank()
    try:
        line, ok = demo(plan, comm, args)
        if rank == 0:
            print(line + shrink, flush=True)
        return 0 if ok else 1
    except PlanMismatchError as err:  # raised before any byte moved
        if err.same_on_every_rank:
            if rank == 0:
                print(f"error: {path.name}: {err}", file=sys.stderr, flush=True)
        else:
            print(f"rank {rank}: error: {path.name}: {err}", file=sys.stderr, flush=True)
        return 2
    except ExecutorError as err:  # a peer died or hangs: requests are pending, so MPI cannot finalize
        _fail_alone(rank, f"{path.name}: {err}", 3 if isinstance(err, PeerTimeoutError) else 2)
    except Exception as err:  # a bug on this rank alone: end it the same way, or the job would hang
        _fail_alone(rank, f"{path.name}: unexpected {type(err).__name__}: {err}", 4)


def console_main(program: str = "xmesh-plan-run") -> int:
    """The demo behind the last-resort handler: the `xmesh-plan-run` console script and `python -m`."""
    return run_guarded(main, program, sys.argv[1:], prefix=f"rank {_launcher_rank()}: ")


if __name__ == "__main__":
    sys.exit(console_main("python -m xmesh_plan.executor.run"))
