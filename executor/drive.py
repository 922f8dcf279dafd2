"""The demo driver behind `executor.run` (MPI) and `executor.torch_run` (torch.distributed): one plan, every tensor.

Both commands do the same thing to a plan, one tensor or many: fill every source shard with a pattern of
global indices (each tensor with its own salt, so tensors of one shape carry different bits), run
`--warmup` + `--iters` reshards each after a barrier, check every destination shard bit for bit against
the pattern, and gather over the ranks the slowest rank's time per iteration, the wrong elements and
shards, and the largest staging. What differs is the world (`Collectives`: a barrier and two reductions)
and how a command prints the outcome.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.plan_tensors import is_multi, tensor_plans

from .arrays import storage_dtype
from .executor import ReshardingExecutor
from .pattern import tensor_salt
from .timeouts import MAX_TIMEOUT_S
from .transfer_executor import TransferExecutor


class Collectives(Protocol):
    """What the driver needs of the world its ranks run in (every rank calls each in the same order)."""

    def barrier(self, what: str) -> None: ...

    def max(self, values: np.ndarray) -> np.ndarray: ...

    def sum(self, values: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Tensor:
    """One tensor of the plan as this rank runs it: its name and single-tensor problem, its shards on this device,
    their storage dtype, the engine that moves every tensor, and the tensor's pattern salt."""

    name: str
    problem: Any  # schemas.ReshardingProblem
    device: int
    src_block: Any
    dst_block: Any
    dtype: np.dtype
    engine: Any
    salt: int


@dataclass(frozen=True)
class Outcome:
    """What every rank agrees on after a plan ran: the slowest rank's seconds per timed iteration, the wrong
    elements and the (tensor, device) shards holding them, and the largest staging any rank allocated."""

    seconds: np.ndarray
    wrong: int
    wrong_shards: int
    staging: int
    order: str

    @property
    def median_s(self) -> float:
        return float(np.median(self.seconds))


def prepare(plan: Plan, comm, options: dict) -> tuple[Any, list[Tensor], Callable[[dict], dict]]:
    """The executor for `plan` (`ReshardingExecutor` for one tensor, `TransferExecutor` for several) prepared on every
    rank, its tensors, and one reshard as a function of name -> source shard to name -> destination shard."""
    if is_multi(plan):
        ex = TransferExecutor(plan, comm, **options).prepare()
        names, salts, reshard = ex.names, [tensor_salt(k) for k in range(len(ex.names))], ex.run
    else:
        ex = ReshardingExecutor(plan, comm, **{**options, "order": options.get("order") or "device"}).prepare()
        name = plan.problem.name or "plan"
        names, salts = (name,), [0]

        def reshard(shards: dict) -> dict:
            out = ex.run(shards.get(name))
            return {} if out is None else {name: out}

    p = ex.program
    tensors = [Tensor(name, problem, p.device, shards.src_block, shards.dst_block, storage_dtype(problem.dtype), ex.engine, salt)
               for name, problem, shards, salt in zip(names, plan.problem.tensor_problems(), p.tensors, salts)]
    return ex, tensors, reshard


def timed(reshard: Callable[[], Any], world: Collectives, iters: int, warmup: int, before_last: Callable[[], None] | None = None):
    """Run `reshard` `warmup` + `iters` times, each after a barrier; the last output and the timed seconds.
    `before_last` runs before the last run (poisoning the destination shards, so a check proves that run wrote
    them). A last barrier keeps a rank that finished early from checking its shards while others still run."""
    times = np.zeros(iters)
    for i in range(warmup + iters):
        if i == warmup + iters - 1 and before_last is not None:
            before_last()
        world.barrier("barrier between iterations")
        start = time.perf_counter()
        out = reshard()
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - start
    world.barrier("barrier after the timed reshards")
    return out, times


def run_plan(plan: Plan, comm, world: Collectives, options: dict, iters: int, warmup: int, check: bool,
             source: Callable[[Tensor], Any], wrong: Callable[[Tensor, Any], tuple[int, str]],
             report: Callable[[str], None]) -> Outcome:
    """Prepare, fill, run, check and gather one plan (see the module docstring). `source(tensor)`: its source shard on
    this rank in the engine's array type; `wrong(tensor, shard)`: (wrong elements of a destination shard, a note naming
    the first), each reported through `report` on this rank."""
    ex, tensors, reshard = prepare(plan, comm, options)
    shards = {t.name: source(t) for t in tensors if t.src_block is not None}

    def poison() -> None:
        ex.engine.poison()

    out, times = timed(lambda: reshard(shards), world, iters, warmup, poison if check else None)
    bad = bad_shards = 0
    for t in tensors if check else ():
        if t.name in out:
            count, note = wrong(t, out[t.name])
            if count:
                report(f"device {t.device}: {f'tensor {t.name}: ' if is_multi(plan) else ''}{count} elements differ{note}")
            bad, bad_shards = bad + count, bad_shards + bool(count)
    staging = ex.stage_bytes if is_multi(plan) else ex.program.stage_bytes
    slowest = world.max(times)
    failures = world.sum(np.array([bad, bad_shards], np.int64))
    staging = int(world.max(np.array([staging], np.int64))[0])
    order = ex.order
    ex.close()
    return Outcome(slowest, int(failures[0]), int(failures[1]), staging, order)


MAX_ITERS = 1_000_000  # iteration times are kept in memory, 8 bytes each
MAX_MB = 2**30  # 1 PiB: far above any tensor, far below float overflow


def flag_error(iters: int, warmup: int, max_mb: float, timeout_s: float) -> str | None:
    """The demos' shared flags in their ranges: None, or one line naming the flag and a valid value."""
    if not 1 <= iters <= MAX_ITERS:
        return f"--iters {iters}: give 1 to {MAX_ITERS:,} timed iterations, e.g. --iters 5"
    if not 0 <= warmup <= MAX_ITERS:
        return f"--warmup {warmup}: give 0 to {MAX_ITERS:,} untimed iterations, e.g. --warmup 1"
    if not (math.isfinite(max_mb) and 0 < max_mb <= MAX_MB):
        return f"--max-mb {max_mb:g}: give a positive size in MiB up to {MAX_MB:,}, e.g. --max-mb 64"
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        return f"--timeout {timeout_s:g}: give a positive number of seconds up to {MAX_TIMEOUT_S:g}, e.g. --timeout 60"
    return None


def refused_input(world: Collectives, rank: int, error: str | None, report: Callable[[str], None]) -> bool:
    """Whether any rank refused its input (`error`: this rank's one-line reason, None when its input is fine), agreed
    by every rank in one reduction before any byte moves, so no rank waits out a timeout for a peer that stopped.
    The reason is printed once, by rank 0, when every rank gave the same one; else each refusing rank prints its own
    (`rank R: error: ...`) and rank 0, when its own input was fine, says why it stops too."""
    mine = -1 if error is None else zlib.crc32(error.encode())
    high, low = (int(v) for v in world.max(np.array([mine, -mine], np.int64)))
    low = -low
    if high == -1:
        return False
    if low == high:
        if rank == 0:
            report(f"error: {error}")
    elif error is not None:
        report(f"rank {rank}: error: {error}")
    elif rank == 0:
        report(f"rank {rank}: stopped: another rank refused its input (its own line above or below says why)")
    return True


def bytes_moved(plan: Plan) -> int:
    """Bytes that cross from one device to another in one reshard (local copies excluded), all tensors together."""
    from xmesh_plan.schemas.op_kinds import pair_bytes

    if is_multi(plan):
        return sum(map(bytes_moved, tensor_plans(plan)))
    size = plan.problem.itemsize
    return sum(nbytes for op in plan.operations for nbytes in pair_bytes(op, size).values())
