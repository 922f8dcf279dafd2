"""One rank of a torch engine test, started by test_executor_torch.py with env:// variables (or torchrun).

    python tests/workers/torch_worker.py check PLAN...      every destination shard, 3 iterations, bit-exact vs numpy slicing
                                                    of the box DTensor gives this rank (where DTensor can express the layout)
    python tests/workers/torch_worker.py check_by_order PLAN...   the same with every tag 0: gloo then matches by order, as NCCL
    python tests/workers/torch_worker.py check_in_device_order PLAN...   check_by_order with order="device"
    python tests/workers/torch_worker.py check_in_device_order_mixed_receipts PLAN...   the same, the engine's receipts
                                                    (TransportOptions.receipt_bytes) on messages of 16 B or more
    python tests/workers/torch_worker.py check_in_device_order_with_receipts PLAN...   order="device", gloo's own tags,
                                                    a receipt for every message
    python tests/workers/torch_worker.py check_transfer_by_order PLAN...   multi-tensor plans through TransferExecutor, every
                                                    tag 0, order="device", receipts from 16 B (check_transfer_posted_by_order: "posted")
    python tests/workers/torch_worker.py disagree A B       rank 1 loads B, the others A: prepare() must fail on every rank
    python tests/workers/torch_worker.py die PLAN           the last rank exits after prepare(): the others must fail in time
    python tests/workers/torch_worker.py batch JOBS.json    several of the modes above (not die) in one launch: a JSON list of
                                                    {"mode", "plans", "ranks", "name"}, each run by the first `ranks`
                                                    ranks (a process group of its own; the world where absent), its
                                                    lines `rank R: name: ...` (the mode where no name)

Each rank prints result lines starting with `rank R:`; the test reads them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from xmesh_plan.executor import ExecutorError, PlanMismatchError, ReshardingExecutor, TransferExecutor, TransportOptions
from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.pattern import fill
from xmesh_plan.schemas.plan_tensors import tensor_plans
from xmesh_plan.schemas import Plan, read_plan_file
from xmesh_plan.schemas.geometry import local_slices

TIMEOUT_S = 20.0
BATCH_TIMEOUT_S = 300  # a batch's ranks outside a job wait at a barrier while the others run it


def pattern(plan: Plan, salt: int) -> np.ndarray:
    """The whole tensor's pattern (raw storage dtype), different bits for each salt."""
    shape = plan.problem.shape
    return fill(tuple((0, n) for n in shape), shape, storage_dtype(plan.problem.dtype), salt)


def shard_of(whole: np.ndarray, block, plan: Plan) -> torch.Tensor:
    """A source shard as a torch tensor of the plan's dtype, sliced from the whole tensor."""
    full = tuple((0, n) for n in plan.problem.shape)
    raw = np.ascontiguousarray(whole[local_slices(block, full)])
    return torch.from_numpy(raw).view(getattr(torch, plan.problem.dtype))


def dtensor_box(plan: Plan) -> tuple | str:
    """This rank's destination box by DTensor's own rule (`compute_local_shape_and_global_offset` on a mesh of the
    ranks that play the plan's destination devices), "outside" off that mesh, or "inexpressible" for a layout
    DTensor writes otherwise (a minor mesh axis splitting first, or a nested uneven split unlike our ceil split)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from xmesh_plan.dtensor import ceil_chunks, nested_chunks

    problem = plan.problem
    dst = problem.dst
    devices = sorted(set(problem.src.mesh.devices) | set(dst.mesh.devices))
    ranks = np.array([devices.index(d) for d in dst.mesh.devices]).reshape(dst.mesh.shape)
    placements = [Replicate()] * len(dst.mesh.shape)
    for dim, sharding in enumerate(dst.spec.dims):
        axes = list(sharding.mesh_axes)
        counts = [dst.mesh.shape[a] for a in axes]
        if axes != sorted(axes) or nested_chunks(problem.shape[dim], counts) != ceil_chunks(problem.shape[dim], counts):
            return "inexpressible"
        for axis in axes:
            placements[axis] = Shard(dim)
    mesh = DeviceMesh("cpu", ranks, _init_backend=False)
    if mesh.get_coordinate() is None:
        return "outside"
    shape, offset = compute_local_shape_and_global_offset(problem.shape, mesh, placements)
    return tuple((o, o + n) for o, n in zip(offset, shape))


ORDER = "posted"  # the executor's order; check_in_device_order sets "device"
TRANSPORT = TransportOptions()  # how messages match and are acknowledged; main() sets it per mode
GROUP = None  # the process group the plans run on (None: the default group); a batch job's own group
PREFIX = ""  # put before each result line's plan name: a batch job's `mode: `


def check(paths: list[str]) -> None:
    """Run each plan 3 times (run(), start()+test()+wait(), a non-contiguous source); count wrong elements."""
    rank = dist.get_rank()
    for path in paths:
        plan = read_plan_file(path)
        ex = ReshardingExecutor(plan, GROUP, backend="gloo", timeout_s=TIMEOUT_S, order=ORDER, transport=TRANSPORT).prepare()
        p, bad = ex.program, 0
        full = tuple((0, n) for n in plan.problem.shape)
        theirs = dtensor_box(plan)
        box = p.dst_block if theirs in ("outside", "inexpressible") else theirs
        if theirs == "outside":
            assert p.dst_block is None, (path, p.dst_block)
        for salt in (0, 7, 200):
            whole = pattern(plan, salt)
            src = shard_of(whole, p.src_block, plan) if p.src_block is not None else None
            if src is not None and salt == 200 and src.dim() > 1:  # a transposed copy, transposed back: not contiguous
                src = src.transpose(0, -1).contiguous().transpose(0, -1)
            if ex.engine.dst is not None:
                ex.engine.poison()
            out = _reshard(ex, src, salt)
            if out is not None:
                assert out.dtype == getattr(torch, plan.problem.dtype) and tuple(out.shape) == p.dst_shape
                got, want = ex.engine.host_copy(out), whole[local_slices(box, full)]
                bad += int((got.view(f"V{got.itemsize}") != want.view(f"V{want.itemsize}")).sum())
        ex.close()
        total = torch.tensor([bad, theirs == "inexpressible"])
        dist.all_reduce(total, group=GROUP)
        how = " (our boxes)" if total[1].item() else ""
        print(f"rank {rank}: {PREFIX}{Path(path).name}: {'ok' if total[0].item() == 0 else f'{total[0].item()} wrong elements'}{how}", flush=True)


def _reshard(ex, src, salt: int):
    """One reshard through `ex`: start(), test() until done and wait() for salt 7, run() otherwise."""
    if salt == 7:
        ex.start(src)
        while not ex.test():
            time.sleep(1e-4)
        return ex.wait()
    return ex.run(src)


def check_transfer(paths: list[str]) -> None:
    """Run each multi-tensor plan 3 times through TransferExecutor (run(), then start()+test()+wait(), then a
    non-contiguous source); count wrong elements of every tensor's shards against numpy slicing."""
    rank = dist.get_rank()
    for path in paths:
        plan = read_plan_file(path)
        ex = TransferExecutor(plan, GROUP, backend="gloo", timeout_s=TIMEOUT_S, order=ORDER, transport=TRANSPORT).prepare()
        if plan.staging is not None or ORDER == "posted":  # the staging this rank allocated: distinct buffers of its engines
            stages = {ex.engine.stage.data_ptr(): ex.engine.stage.numel()}  # one engine, one area for every tensor
            shared = "shared"
            stated = plan.staging.peak_bytes.get(ex.device, 0) if plan.staging is not None else None
            print(f"rank {rank}: {PREFIX}{Path(path).name}: device {ex.device} staging {sum(stages.values())} B, stated {stated} B, "
                  f"{shared}", flush=True)
        bad = 0
        singles = tensor_plans(plan)  # each tensor's own plan: its problem's shape and dtype
        for salt in (0, 7, 200):
            wholes = [pattern(single, salt + k) for k, single in enumerate(singles)]
            shards = {}
            for name, single, mine, whole in zip(ex.names, singles, ex.program.tensors, wholes):
                if mine.src_block is not None:
                    src = shard_of(whole, mine.src_block, single)
                    shards[name] = src.transpose(0, -1).contiguous().transpose(0, -1) if salt == 200 and src.dim() > 1 else src
            ex.engine.poison()
            out = _reshard(ex, shards, salt)
            for name, single, mine, whole in zip(ex.names, singles, ex.program.tensors, wholes):
                assert (name in out) == (mine.dst_block is not None), (path, name)
                if name in out:
                    full = tuple((0, n) for n in single.problem.shape)
                    got, want = ex.engine.host_copy(out[name]), whole[local_slices(mine.dst_block, full)]
                    bad += int((got.view(f"V{got.itemsize}") != want.view(f"V{want.itemsize}")).sum())
        ex.close()
        total = torch.tensor([bad])
        dist.all_reduce(total, group=GROUP)
        print(f"rank {rank}: {PREFIX}{Path(path).name}: {'ok' if total[0].item() == 0 else f'{total[0].item()} wrong elements'}", flush=True)


def disagree(first: str, second: str) -> None:
    rank = dist.get_rank()
    plan = read_plan_file(second if rank == 1 else first)
    try:
        ReshardingExecutor(plan, GROUP, backend="torch", timeout_s=TIMEOUT_S).prepare()
        print(f"rank {rank}: {PREFIX}prepared", flush=True)
    except PlanMismatchError as err:
        print(f"rank {rank}: {PREFIX}refused: {err}", flush=True)


def die(path: str) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    plan = read_plan_file(path)
    ex = ReshardingExecutor(plan, backend="torch", timeout_s=5.0).prepare()
    if rank == size - 1:
        os._exit(0)
    src = shard_of(pattern(plan, 0), ex.program.src_block, plan) if ex.program.src_block is not None else None
    start = time.monotonic()
    try:
        for _ in range(3):
            ex.run(src)
        print(f"rank {rank}: finished", flush=True)
    except ExecutorError as err:
        print(f"rank {rank}: {type(err).__name__} after {time.monotonic() - start:.1f} s: {err}", flush=True)
    os._exit(0)  # a receive from the dead rank may still be posted: skip the process group's shutdown


def setup(mode: str) -> str:
    """Set ORDER and TRANSPORT for `mode`; the runner (`RUNNERS`) it takes."""
    global ORDER, TRANSPORT
    ORDER, TRANSPORT = "posted", TransportOptions()
    if mode == "check_in_device_order_with_receipts":  # gloo's own tags, every message with a receipt
        ORDER, TRANSPORT, mode = "device", TransportOptions(receipt_bytes=1), "check"
    if mode in ("check_by_order", "check_in_device_order", "check_in_device_order_mixed_receipts", "check_transfer_by_order",
                "check_transfer_posted_by_order"):
        ORDER = "posted" if mode in ("check_by_order", "check_transfer_posted_by_order") else "device"
        # these small plans' messages are 2-192 B: from 16 B some operations end on receipts, others on their sends, as in use
        receipts = 16 if mode in ("check_in_device_order_mixed_receipts", "check_transfer_by_order") else TRANSPORT.receipt_bytes
        TRANSPORT = TransportOptions(match_by_tag=False, receipt_bytes=receipts)
        mode = "check_transfer" if "transfer" in mode else "check"
    return mode


RUNNERS = {"check": check, "check_transfer": check_transfer, "disagree": lambda args: disagree(*args), "die": lambda args: die(*args)}


def batch(jobs_file: str) -> None:
    """Each job of the JSON list in turn: its mode on its plans, run by the first `ranks` ranks in a process group of
    their own (every group made first, by every rank, as torch asks). Every rank waits at a barrier after each job,
    so a job starts only once the one before it has ended on every rank."""
    global GROUP, PREFIX
    jobs, world = json.loads(Path(jobs_file).read_text()), dist.get_world_size()
    groups = {n: dist.new_group(list(range(n))) for n in sorted({job.get("ranks", world) for job in jobs}) if n < world}
    for job in jobs:
        ranks = job.get("ranks", world)
        if dist.get_rank() < ranks:
            GROUP, PREFIX = groups.get(ranks), f"{job.get('name', job['mode'])}: "
            RUNNERS[setup(job["mode"])](job["plans"])
        dist.barrier()  # the ranks outside the job wait here (up to BATCH_TIMEOUT_S)
    GROUP, PREFIX = None, ""


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    mode, args = argv[0], argv[1:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=BATCH_TIMEOUT_S if mode == "batch" else 60))
    if mode == "batch":
        batch(*args)
    else:
        RUNNERS[setup(mode)](args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
