"""Run under `mpiexec` by tests/test_executor_mpi.py; holds no tests itself.

    mpiexec -n 8 python tests/test_executor_worker.py check PLAN...    # run(), start()/test()/wait(), DLPack input
    mpiexec -n 8 python tests/test_executor_worker.py torch PLAN...    # CPU torch tensors in (bfloat16 included)
    mpiexec -n 8 python tests/test_executor_worker.py iterations PLAN...  # new data every iteration, checked every time
    mpiexec -n 4 python tests/test_executor_worker.py die PLAN         # rank 1 exits before iteration 2
    mpiexec -n 2 python tests/test_executor_worker.py other-plan A B   # rank 1 loads plan B, the others A

Prints `ok <plan name>` on rank 0 per checked plan; errors go to stderr as `rank R: <type>: <message>`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `executor` and `schemas`


class DLPackOnly:
    """An array that numpy can reach only through DLPack (stands in for a CPU torch tensor)."""

    def __init__(self, array):
        self._array = array
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def as_torch(shard, plan_dtype: str):
    """The shard as a CPU torch tensor over the same memory, of the plan's own dtype (bfloat16 as bfloat16)."""
    import torch

    tensor = torch.from_numpy(shard)
    if plan_dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        tensor = tensor.view(getattr(torch, plan_dtype))
    return tensor


def check(comm, paths: list[str], modes: tuple[str, ...] = ("run", "overlap", "dlpack")) -> None:
    from executor import ReshardingExecutor
    from executor.pattern import fill, mismatches
    from schemas import load_plan

    for path in paths:
        plan = load_plan(path)
        ex = ReshardingExecutor(plan, comm, timeout_s=30).prepare()
        p = ex.program
        shard = fill(p.src_block, plan.problem.shape, ex.engine.dtype) if p.src_block else None
        for mode in modes:
            if ex.engine.dst is not None:
                ex.engine.poison()
            if mode == "run":
                out = ex.run(shard)
            elif mode == "overlap":
                ex.start(shard)
                busy = sum(i * i for i in range(20_000))  # compute overlapped with the transfer
                while not ex.test():
                    time.sleep(1e-4)
                out = ex.wait()
                assert busy > 0
            elif mode == "dlpack":
                out = ex.run(DLPackOnly(shard) if shard is not None else None)
            else:
                out = ex.run(as_torch(shard, plan.problem.dtype) if shard is not None else None)
            if p.dst_block is None:
                assert out is None, "a rank outside the destination mesh must get None"
                continue
            bad, first = mismatches(out, p.dst_block, plan.problem.shape)
            if bad:
                raise AssertionError(f"{plan.problem.name} ({mode}): device {p.device}: {bad} elements differ, first at {first}")
        comm.Barrier()
        if comm.Get_rank() == 0:
            print(f"ok {plan.problem.name} {plan.strategy}", flush=True)


def next_source(shard, data, iteration: int):
    """This iteration's source shard, handed in three ways: a new array at a new address, a new array
    object over the previous one's memory, the previous array itself rewritten (persistent sends must
    read the bytes as they are at each start, wherever the shard lives)."""
    if shard is None or iteration % 3 == 0:
        return data
    shard.reshape(-1).view("uint8")[:] = data.reshape(-1).view("uint8")
    return shard.view() if iteration % 3 == 1 else shard


def iterations(comm, paths: list[str], count: int = 7) -> None:
    """Each iteration moves different bits (run() and start/test/wait alternately); every destination shard is checked every time."""
    from executor import ReshardingExecutor
    from executor.pattern import fill, mismatches
    from schemas import load_plan

    for path in paths:
        plan = load_plan(path)
        ex = ReshardingExecutor(plan, comm, timeout_s=30).prepare()
        p, shard = ex.program, None
        for it in range(count):
            salt = 37 * it + 1
            if p.src_block is not None:
                shard = next_source(shard, fill(p.src_block, plan.problem.shape, ex.engine.dtype, salt), it)
            if ex.engine.dst is not None:
                ex.engine.poison()
            if it % 2:
                ex.start(shard)
                while not ex.test():
                    time.sleep(1e-4)
                out = ex.wait()
            else:
                out = ex.run(shard)
            if p.dst_block is not None:
                bad, first = mismatches(out, p.dst_block, plan.problem.shape, salt)
                if bad:
                    raise AssertionError(f"{plan.problem.name} iteration {it}: device {p.device}: {bad} elements differ, first at {first}")
        ex.close()
        comm.Barrier()
        if comm.Get_rank() == 0:
            print(f"ok {plan.problem.name} {plan.strategy}", flush=True)


def die(comm, path: str) -> None:
    """Rank 1 leaves after two good iterations; the others must time out naming it."""
    from executor import ReshardingExecutor
    from executor.pattern import fill
    from schemas import load_plan

    plan = load_plan(path)
    ex = ReshardingExecutor(plan, comm, timeout_s=3).prepare()
    shard = fill(ex.program.src_block, plan.problem.shape, ex.engine.dtype) if ex.program.src_block else None
    for i in range(4):
        if i == 2 and comm.Get_rank() == 1:
            print("rank 1: exiting on purpose", file=sys.stderr, flush=True)
            os._exit(0)
        ex.run(shard)
    from executor.executor import DEFAULT_POLL_S, poll

    poll(comm.Ibarrier(), 3, DEFAULT_POLL_S, "the final barrier")  # ranks that never talked to rank 1 notice here


def other_plan(comm, paths: list[str]) -> None:
    from executor import ReshardingExecutor
    from schemas import load_plan

    plan = load_plan(paths[1] if comm.Get_rank() == 1 else paths[0])
    ReshardingExecutor(plan, comm, timeout_s=10).prepare()


def main() -> int:
    from mpi4py import MPI

    from executor import ExecutorError

    comm = MPI.COMM_WORLD
    mode, paths = sys.argv[1], sys.argv[2:]
    try:
        {"check": lambda: check(comm, paths), "torch": lambda: check(comm, paths, ("torch",)), "iterations": lambda: iterations(comm, paths), "die": lambda: die(comm, paths[0]),
         "other-plan": lambda: other_plan(comm, paths)}[mode]()
    except (ExecutorError, AssertionError) as err:
        print(f"rank {comm.Get_rank()}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
