"""Run under `mpiexec` by tests/test_staging_transfer.py; holds no tests itself.

    mpiexec -n 8 python tests/workers/staging_transfer_worker.py [--order ORDER] PLAN...   # TransferExecutor in its default order, or ORDER

A `*.npz` plan is run through `TransferExecutor.from_file` (each rank reads its part of the compact file).

Per plan, three reshards with other bits each time, every destination shard of every tensor checked bit
for bit against its tensor's pattern (`executor.pattern`); and the staging this rank allocated (the
distinct staging buffers of its tensors' engines) must equal `TransferExecutor.stage_bytes` and be at
most the peak the plan states for this rank's device in device order, or the plan's limit posted (`executor.window`). Rank 0 prints
`ok NAME order ORDER staging MAX_ALLOCATED stated MAX_STATED limit LIMIT` per plan (bytes, the largest
over ranks); errors go to stderr as `rank R: <type>: <message>`.
"""

from __future__ import annotations

import os
import sys


def allocated(ex) -> int:
    """Bytes of the distinct staging buffers this rank's engines hold (a buffer shared by tensors counted once)."""
    return ex.engine.stage.nbytes  # one engine, one area for every tensor


def check(comm, path: str, order: str | None = None) -> None:
    from mpi4py import MPI

    from xmesh_plan.executor import TransferExecutor
    from xmesh_plan.executor.pattern import fill, mismatches, tensor_salt
    from xmesh_plan.schemas import load_plan

    if path.endswith(".npz"):  # a compact plan: each rank reads only its part (`TransferExecutor.from_file`)
        ex = TransferExecutor.from_file(path, comm, timeout_s=60, order=order).prepare()
        plan = ex.plan
    else:
        plan = load_plan(path)
        ex = TransferExecutor(plan, comm, timeout_s=60, order=order).prepare()
    stated = plan.staging.peak_bytes.get(ex.device, 0) if plan.staging is not None else None
    allowed = plan.staging.limit_bytes if plan.staging is not None and ex.order == "posted" else stated
    mine = allocated(ex)
    assert mine == ex.stage_bytes, f"device {ex.device}: engines hold {mine} B of staging, stage_bytes says {ex.stage_bytes}"
    assert allowed is None or mine <= allowed, f"device {ex.device}: {mine} B of staging allocated {ex.order}, the plan allows {allowed} B"
    for run in range(3):
        salts = {name: tensor_salt(k) + 101 * run for k, name in enumerate(ex.names)}
        shards = {name: fill(t.src_block, problem.shape, dtype, salts[name])
                  for name, t, problem, dtype in zip(ex.names, ex.program.tensors, ex.problems, ex.engine.dtypes) if t.src_block is not None}
        ex.engine.poison()
        out = ex.run(shards)
        for name, t, problem in zip(ex.names, ex.program.tensors, ex.problems):
            assert (name in out) == (t.dst_block is not None), (name, ex.device)
            if name in out:
                bad, first = mismatches(out[name], t.dst_block, problem.shape, salts[name])
                assert not bad, f"run {run}: device {ex.device}: tensor {name}: {bad} elements differ, first at {first}"
    order = ex.order
    ex.close()
    import numpy as np

    top = np.zeros(2, np.int64)
    comm.Allreduce(np.array([mine, stated or 0], np.int64), top, op=MPI.MAX)
    if comm.Get_rank() == 0:
        limit = plan.staging.limit_bytes if plan.staging is not None else 0
        print(f"ok {plan.problem.name} order {order} staging {top[0]} stated {top[1]} limit {limit}", flush=True)


def main() -> int:
    from mpi4py import MPI

    from xmesh_plan.executor import ExecutorError

    comm = MPI.COMM_WORLD
    try:
        args = sys.argv[1:]
        order = None
        if args[:1] == ["--order"]:
            order, args = args[1], args[2:]
        for path in args:
            check(comm, path, order)
    except (ExecutorError, AssertionError) as err:
        print(f"rank {comm.Get_rank()}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
