"""`torchrun --nproc-per-node N -m xmesh_plan.executor.torch_run PLAN... --check`: reshard torch tensors with the torch engine.

For each plan: shrink the tensor to at most `--max-mb`, fill every source shard with a pattern of
global indices (as a torch tensor of the plan's dtype, bfloat16 and float8 included), run
`--iters` reshards over the default process group (gloo on CPU, NCCL with `--nccl`), and print on
rank 0 the median over iterations of the slowest rank's time (after `--warmup` untimed ones). With `--check`, each destination shard is
compared bit for bit with numpy slicing of the whole pattern tensor. A multi-tensor plan runs through
`TransferExecutor` (one operation at a time per device across tensors, in the plan's order; with
`--order posted`, tensors one after another), each tensor checked the same way.

    torchrun --nproc-per-node 8 -m xmesh_plan.executor.torch_run plans/case1.plan.json --check
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from xmesh_plan.schemas import Plan, PlanFileError, read_plan_file
from xmesh_plan.schemas.geometry import local_slices
from xmesh_plan.schemas.last_resort import DEBUG_ENV, DEBUG_FLAG, run_guarded
from xmesh_plan.schemas.plan_tensors import is_multi

from .arrays import storage_dtype
from .drive import Tensor, flag_error, refused_input
from .drive import run_plan as run_plan_on
from .engines import TransportOptions
from .errors import ExecutorError, PeerTimeoutError, PlanMismatchError
from .flags import TORCH_RANK, UsageError, check_torchrun, command, launcher_rank, parse
from .pattern import fill
from .scale import factors_for, factors_per_tensor, refuse_conversion, scale_plan, scale_tensors


def source_tensor(problem, block, device, salt: int = 0):
    """The pattern's values for `block` as a torch tensor of the (single-tensor) problem's dtype on `device` (None without a block)."""
    import torch

    if block is None:
        return None
    raw = fill(block, problem.shape, storage_dtype(problem.dtype), salt)
    return torch.from_numpy(raw).view(getattr(torch, problem.dtype)).to(device)


def expected_shard(problem, block, salt: int = 0) -> np.ndarray:
    """The destination shard by plain numpy slicing of the whole pattern tensor of a single-tensor problem (independent of the plan)."""
    shape = problem.shape
    whole = fill(tuple((0, n) for n in shape), shape, storage_dtype(problem.dtype), salt)
    return whole[local_slices(block, tuple((0, n) for n in shape))]


class TorchCollectives:
    """The driver's barrier and reductions over the default process group (`drive.Collectives`); a peer that stopped
    makes gloo raise its own error, which becomes a one-line PeerTimeoutError naming what this rank waited for."""

    def __init__(self, device):
        self.device = device

    def barrier(self, what: str) -> None:
        import torch.distributed as dist

        with _peer_errors(what):
            dist.barrier()

    def _reduce(self, values: np.ndarray, op) -> np.ndarray:
        import torch
        import torch.distributed as dist

        out = torch.tensor(values, device=self.device)
        with _peer_errors("collecting results"):
            dist.all_reduce(out, op=op)
        return out.cpu().numpy()

    def max(self, values: np.ndarray) -> np.ndarray:
        import torch.distributed as dist

        return self._reduce(values, dist.ReduceOp.MAX)

    def sum(self, values: np.ndarray) -> np.ndarray:
        import torch.distributed as dist

        return self._reduce(values, dist.ReduceOp.SUM)


@contextmanager
def _peer_errors(what: str):
    """A collective's failure (a peer stopped, the group's timeout passed) as one line instead of gloo's own error."""
    try:
        yield
    except RuntimeError as err:  # torch's DistBackendError and gloo's errors are RuntimeErrors
        detail = " ".join(str(err).split())[:200]
        raise PeerTimeoutError(f"{what}: a peer stopped or hangs ({detail}); check that every rank is alive") from None


WAYS = {"device": "device order across tensors", "posted": "tensors one after another"}  # how the torch engine runs a multi-tensor plan


def run_plan(plan: Plan, args: SimpleNamespace) -> tuple[str, int]:
    """Reshard `plan` (one tensor or many) `--iters` times (`drive.run_plan`); rank 0's report line and the number of
    wrong elements over all ranks."""
    import torch.distributed as dist

    device = _tensor_device()

    def wrong(t: Tensor, shard) -> tuple[int, str]:
        got, want = t.engine.host_copy(shard), expected_shard(t.problem, t.dst_block, t.salt)
        return int((got.view(f"V{got.itemsize}") != want.view(f"V{want.itemsize}")).sum()), ""

    options = {"backend": "torch", "timeout_s": args.timeout, "order": args.order, "transport": args.transport}
    done = run_plan_on(plan, None, TorchCollectives(device), options, args.iters, args.warmup, args.check,
                       lambda t: source_tensor(t.problem, t.src_block, t.engine.device, t.salt), wrong, lambda line: None)
    per_iter, problem = done.seconds * 1e3, plan.problem
    if is_multi(plan):
        what, ways, ok = f"{len(problem.tensors)} tensors", f" ({WAYS[done.order]})", "every destination shard of every tensor bit-exact"
    else:
        what, ways, ok = f"{'x'.join(map(str, problem.shape))} {problem.dtype}", "", "every destination shard bit-exact"
    line = (f"{problem.name or 'plan'}: {what}, {dist.get_world_size()} ranks, "
            f"{len(plan.operations)} ops, torch/{dist.get_backend()}{ways}: {np.median(per_iter):.2f} ms/iter "
            f"median of {args.iters} (min {per_iter.min():.2f}), slowest rank per iteration")
    if args.check:
        line += f"; check {f'ok: {ok}' if not done.wrong else f'FAILED: {done.wrong} elements differ'}"
    return line, done.wrong


PROG = "torchrun --nproc-per-node N -m xmesh_plan.executor.torch_run"


@command(__doc__.splitlines()[0])
@click.argument("plans", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--check", is_flag=True, help="compare every destination shard with numpy slicing, bit for bit")
@click.option("--iters", type=int, default=5, help="timed iterations (default 5)")
@click.option("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
@click.option("--order", type=click.Choice(["device", "posted"]),
              help="device: one operation at a time per device, in plan order, across the tensors of a multi-tensor "
                   "plan too (default); posted: every message at once (a multi-tensor plan: tensors one after another)")
@click.option("--max-mb", type=float, default=16.0, help="shrink the tensor to at most this many MiB (default 16)")
@click.option("--nccl", is_flag=True, help="use an NCCL process group on cuda:LOCAL_RANK instead of gloo on the CPU")
@click.option("--timeout", type=float, default=60.0, help="seconds without progress before a rank gives up (default 60)")
@click.option(DEBUG_FLAG, "debug", is_flag=True, help=f"show the full traceback of an internal error (or set {DEBUG_ENV}=1)")
def _command(**_) -> None:
    """The flags (`_arguments` reads them)."""


def _arguments(argv: list[str] | None) -> SimpleNamespace:
    """Parsed flags, each in its range; UsageError (one line naming the flag, or saying the command needs torchrun)
    otherwise. `--help` is printed by rank 0."""
    args = parse(_command, argv, PROG, show_help=_launcher_rank() == 0)
    error = flag_error(args.iters, args.warmup, args.max_mb, args.timeout)
    if error is not None:
        raise UsageError(error)
    check_torchrun(PROG)
    return args


def main(argv: list[str] | None = None, transport: TransportOptions | None = None) -> int:
    """The command; `transport`: the engines' message options (`engines.TransportOptions`; None: the defaults)."""
    import torch
    import torch.distributed as dist

    try:
        args = _arguments(argv)
    except UsageError as err:  # the same flags on every rank (torchrun), and no rank has joined the group yet
        if _launcher_rank() == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    args.transport = transport or TransportOptions()
    if args.nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.nccl else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, status = dist.get_rank(), 0
    world = TorchCollectives(_tensor_device())
    try:
        for path in args.plans:
            try:  # every rank learns whether any could not read or shrink its plan, before any byte moves
                plan, error = read_plan_file(path), None
                plan = _scaled(plan, args.max_mb)
            except (PlanFileError, PlanMismatchError) as err:
                error = f"{path.name}: {err}"
            if refused_input(world, rank, error, _report):
                status = 2
                break
            try:
                line, bad = run_plan(plan, args)
            except PlanMismatchError as err:  # before any byte moved
                if rank == 0 or not err.same_on_every_rank:
                    _report(f"rank {rank}: error: {path.name}: {err}")
                status = 2
                continue
            if rank == 0:
                print(line, flush=True)
            status = status or (1 if bad else 0)
    except ExecutorError as err:  # a peer died or hangs: work is pending, so the group cannot shut down cleanly
        _leave(rank, f"error: {err}", 3 if isinstance(err, PeerTimeoutError) else 2)
    except KeyboardInterrupt:
        _leave(rank, "interrupted; the other ranks stop within --timeout", 130)
    dist.destroy_process_group()
    return status


def _tensor_device():
    """The device this rank's tensors live on (the CPU on gloo, its GPU on NCCL)."""
    from .worlds import TorchWorld

    return TorchWorld(None).tensor_device()


def _scaled(plan: Plan, max_mb: float) -> Plan:
    """The plan shrunk to at most `max_mb` per tensor; PlanMismatchError for a plan that converts at the sender, whose
    destinations this command's pattern and check (of the source dtype) do not describe."""
    refuse_conversion(plan)
    if is_multi(plan):
        return scale_tensors(plan, factors_per_tensor(plan, int(max_mb * 2**20)))
    return scale_plan(plan, factors_for(plan, int(max_mb * 2**20)))


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _leave(rank: int, line: str, code: int):
    """Report in one line and end this rank at once: with work pending the process group cannot shut down cleanly,
    and the other ranks learn of it through their own timeouts."""
    _report(f"rank {rank}: {line}")
    sys.stdout.flush()
    os._exit(code)


def _launcher_rank() -> int:
    """This process's rank as torchrun set it (0 outside torchrun)."""
    return launcher_rank(*TORCH_RANK)


def console_main(program: str = "python -m xmesh_plan.executor.torch_run") -> int:
    """The command behind the last-resort handler: anything unexpected is one line per rank, not a traceback."""
    return run_guarded(main, program, sys.argv[1:], prefix=f"rank {_launcher_rank()}: ")


if __name__ == "__main__":
    sys.exit(console_main())
