"""One gloo rank of tests/test_redistribute_misuse.py: `xmesh_plan.redistribute` called the wrong way.

`python tests/workers/redistribute_misuse_worker.py MODE` on 4 ranks. MODE `main` runs the scenarios below one after
another and prints `rank R: <scenario> ...` lines for the test to compare across ranks; `die` kills
rank 0 in the middle of an asynchronous move; `exit` leaves asynchronous moves unwaited at exit.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import xmesh_plan.redistribute as rd
from xmesh_plan.executor.torch_engine import TorchEngine
from xmesh_plan.redistribute import redistribute


def mesh(ranks) -> DeviceMesh:
    return DeviceMesh("cpu", ranks)


def full_of(shape, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel()).reshape(shape) * 7 % 101 - 50).to(dtype)


def expected(full: torch.Tensor, dst: DeviceMesh, placements) -> torch.Tensor | None:
    """This rank's shard by DTensor's own rule; None outside the mesh."""
    if dst.get_coordinate() is None:
        return None
    shape, offset = compute_local_shape_and_global_offset(full.shape, dst, placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def check(y: DTensor, full: torch.Tensor, dst: DeviceMesh, placements, what: str) -> None:
    want = expected(full, dst, placements)
    if want is not None:
        assert torch.equal(y.to_local(), want), (what, dist.get_rank(), y.to_local(), want)


def wait(y: DTensor) -> None:
    """What a user calls to wait for an asynchronous result (a rank outside both meshes holds a plain placeholder)."""
    local = y.to_local()
    if isinstance(local, AsyncCollectiveTensor):
        local.wait()


class SlowStart:
    """On the ranks given, every engine waits `seconds` before posting its messages (a slow peer)."""

    def __init__(self, ranks, seconds: float = 0.5):
        self.slow, self.seconds, self.original = dist.get_rank() in ranks, seconds, TorchEngine.start

    def __enter__(self):
        if self.slow:
            original, seconds = self.original, self.seconds
            TorchEngine.start = lambda engine, src: (time.sleep(seconds), original(engine, src))[1]

    def __exit__(self, *exc):
        TorchEngine.start = self.original


def back_to_back(rank: int) -> str:
    """Two asynchronous moves over the same ranks, the second started before the first is used, then a synchronous
    one. Ranks 0 and 2 post the float32 moves late, so without a wait in between their messages of the two moves
    would leave in one order there and in the other order on ranks 1 and 3."""
    world, backwards, grid = mesh([0, 1, 2, 3]), mesh([3, 2, 1, 0]), mesh([[0, 1], [2, 3]])
    a_full, b_full = full_of((33, 20)), full_of((21, 18), torch.int64)
    a = distribute_tensor(a_full, world, [Shard(0)])
    b = distribute_tensor(b_full, world, [Shard(1)])
    iterate = TorchEngine._iterate

    def late(engine):
        if rank in (0, 2) and engine.dtype == torch.float32:
            time.sleep(0.2)
        iterate(engine)

    TorchEngine._iterate = late
    try:
        for _ in range(2):
            ya = redistribute(a, backwards, [Shard(1)], async_op=True)
            yb = redistribute(b, world, [Shard(0)], async_op=True)
            yc = redistribute(a, grid, [Shard(1), Shard(0)])
            check(yb, b_full, world, [Shard(0)], "second")
            check(ya, a_full, backwards, [Shard(1)], "first")
            check(yc, a_full, grid, [Shard(1), Shard(0)], "third")
    finally:
        TorchEngine._iterate = iterate
    return "ok"


def sender_waits(rank: int) -> str:
    """A rank that only sends waits on its result, then overwrites its source shard: the receivers (slow to post)
    must still get the original bytes."""
    full = full_of((16, 12))
    src, dst = mesh([0, 1]), mesh([2, 3])
    x = distribute_tensor(full, src, [Shard(0)])
    with SlowStart([2, 3]):
        y = redistribute(x, dst, [Shard(1)], async_op=True)
        if rank in (0, 1):
            y.to_local().wait()
            x.to_local().fill_(-1)
        check(y, full, dst, [Shard(1)], "sender_waits")
    return "ok"


def bad_arguments(rank: int) -> list[str]:
    """Each bad call must raise the same line on every rank, and make no process group on the way."""
    x = distribute_tensor(full_of((8, 6)), mesh([0, 1]), [Shard(0)])
    scalar = distribute_tensor(torch.tensor(1.5), mesh([0, 1]), [Replicate()])
    middle, last = mesh([1, 2]), mesh([2, 3])  # a DeviceMesh makes process groups of its own
    calls = {
        "mesh_is_a_list": lambda: redistribute(x, [1, 2], [Shard(0)]),
        "placements_not_a_list": lambda: redistribute(x, middle, Shard(0)),
        "too_many_placements": lambda: redistribute(x, middle, [Shard(0), Shard(1)]),
        "partial": lambda: redistribute(x, middle, [Partial()]),
        "dim_out_of_range": lambda: redistribute(x, middle, [Shard(2)]),
        "cluster_not_a_cluster": lambda: redistribute(x, middle, [Shard(1)], cluster="4 hosts"),
        "async_not_bool": lambda: redistribute(x, middle, [Shard(1)], async_op="yes"),
        "scalar_sharded": lambda: redistribute(scalar, last, [Shard(0)]),
    }
    groups, torch_groups = len(rd._STATE.groups), dist.distributed_c10d._world.group_count
    lines = []
    for name, call in calls.items():
        try:
            call()
            lines.append(f"bad {name}: no error")
        except Exception as err:
            lines.append(f"bad {name}: {type(err).__name__}: {err}")
    lines.append(f"bad groups made: {len(rd._STATE.groups) - groups} {dist.distributed_c10d._world.group_count - torch_groups}")
    y = redistribute(x, middle, [Shard(1)])  # nobody is left inside a collective
    check(y, full_of((8, 6)), middle, [Shard(1)], "after bad arguments")
    return lines


def _refused(call) -> str:
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def wrong_local_shard(rank: int) -> str:
    """Rank 1's local tensor has 2 rows where its Shard(0) of 7 rows over 2 ranks has 3 (after a good call, so every
    rank holds the prepared executor and only the per-call check can see it)."""
    full = full_of((7, 6))
    src, dst = mesh([0, 1]), mesh([2, 3])
    check(redistribute(distribute_tensor(full, src, [Shard(0)]), dst, [Shard(1)]), full, dst, [Shard(1)], "good")
    local = full[:4] if rank == 0 else full[4:6] if rank == 1 else full.new_empty(0, 6)
    x = DTensor.from_local(local.clone(), src, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    return _refused(lambda: redistribute(x, dst, [Shard(1)]))


def grad_on_one_rank(rank: int) -> str:
    """requires_grad on rank 0 only, for a move every rank has made before (its executor is prepared everywhere)."""
    x, dst = distribute_tensor(full_of((6, 4)), mesh([0, 1]), [Shard(0)]), mesh([1, 2, 3])
    redistribute(x, dst, [Shard(1)])
    if rank == 0:
        x.requires_grad_()
    return _refused(lambda: redistribute(x, dst, [Shard(1)]))


def other_layout_on_one_rank(rank: int) -> str:
    """Rank 3 asks for Shard(0) where the others ask for Shard(1), over the same ranks, each layout made before."""
    x, dst = distribute_tensor(full_of((8, 8)), mesh([0, 1, 2, 3]), [Shard(0)]), mesh([0, 1, 2, 3])
    redistribute(x, dst, [Shard(1)])
    redistribute(x, dst, [Shard(0)])
    return _refused(lambda: redistribute(x, dst, [Shard(0) if rank == 3 else Shard(1)]))


def scalar(rank: int) -> str:
    """A 0-dim tensor, replicated on ranks 0 and 1, moved to ranks 2 and 3, and its gradient back."""
    x = distribute_tensor(torch.tensor(2.5), mesh([0, 1]), [Replicate()]).requires_grad_()
    y = redistribute(x, mesh([2, 3]), [Replicate()])
    assert y.shape == torch.Size([]) and (rank < 2 or y.to_local().shape == torch.Size([])), (rank, y.to_local())
    if rank >= 2:
        assert y.to_local().item() == 2.5
    (y.to_local() * 3).sum().backward()
    if rank < 2:
        assert x.grad.to_local().item() == 3.0, x.grad.to_local()
    z = redistribute(x.detach(), mesh([1, 2, 3]), [Replicate()], async_op=True)
    assert rank == 0 or z.to_local().item() == 2.5
    return "ok"


def freed(rank: int) -> str:
    """The cached executor must not keep the caller's source shard alive; clear_cache() drops everything."""
    alive = []
    for async_op in (False, True):
        x = distribute_tensor(full_of((64, 32)), mesh([0, 1]), [Shard(0)])
        ref = weakref.ref(x._local_tensor)
        y = redistribute(x, mesh([1, 2]), [Shard(1)], async_op=async_op)
        wait(y)
        del x, y
        gc.collect()
        alive.append(ref() is not None)
    executors = [weakref.ref(e) for e in rd._STATE.executors.values()]
    rd.clear_cache()
    gc.collect()
    state = (len(rd._STATE.executors), len(rd._STATE.groups), len(rd._STATE.pending), sum(e() is not None for e in executors))
    x = distribute_tensor(full_of((10, 6)), mesh([0, 1]), [Shard(0)])
    check(redistribute(x, mesh([3, 1]), [Shard(1)]), full_of((10, 6)), mesh([3, 1]), [Shard(1)], "after clear_cache")
    return f"source kept alive (sync, async): {alive}; after clear_cache (executors, groups, pending, executors alive): {state}"


def cycled(rank: int) -> str:
    """20 layouts cycled three times with set_cache_size(20): each compiled once, every move right."""
    rd.set_cache_size(int(os.environ.get("CYCLED_CACHE_SIZE", "20")))
    rd.clear_cache()
    src, dst, compiles, compile_plan = mesh([0, 1]), mesh([2, 3]), [], rd.compile_plan
    rd.compile_plan = lambda problem, *args, **kwargs: compiles.append(problem.shape) or compile_plan(problem, *args, **kwargs)
    try:
        for _ in range(3):
            for rows in range(1, 21):
                full = full_of((rows, 4))
                check(redistribute(distribute_tensor(full, src, [Shard(0)]), dst, [Shard(1)]), full, dst, [Shard(1)], f"rows {rows}")
    finally:
        rd.compile_plan = compile_plan
    kept = len(rd._STATE.executors)
    rd.set_cache_size(16)
    return f"compiles {len(compiles)}, distinct {len(set(compiles))}, kept {kept}"


def bounded(rank: int) -> str:
    """Many layouts: the caches stay bounded, and a move one rank dropped from its cache while others kept it still runs."""
    rd.CACHE_SIZE, rd.PROBLEM_CACHE_SIZE = 3, 5
    rd.clear_cache()
    big = full_of((12, 8))
    b = distribute_tensor(big, mesh([0, 1, 2, 3]), [Shard(0)])
    check(redistribute(b, mesh([0, 1, 2, 3]), [Shard(1)]), big, mesh([0, 1, 2, 3]), [Shard(1)], "b")
    for rows in range(3, 11):  # ranks 0 and 1 only: 2 and 3 keep b's executor while 0 and 1 drop it
        full = full_of((rows, 4))
        x = distribute_tensor(full, mesh([0]), [Replicate()])
        y = redistribute(x, mesh([1]), [Shard(0)], async_op=rows % 2 == 0)
        check(y, full, mesh([1]), [Shard(0)], f"rows {rows}")
    check(redistribute(b, mesh([0, 1, 2, 3]), [Shard(1)]), big, mesh([0, 1, 2, 3]), [Shard(1)], "b again")
    return f"sizes {len(rd._STATE.executors)} {len(rd._STATE.problems)} {len(rd._STATE.pending)}"


def no_grad(rank: int) -> str:
    """Under torch.no_grad() the result does not require grad (no backward will run), and a result still being
    moved can be the source of the next move."""
    full, src, dst, world = full_of((12, 8)), mesh([0, 1]), mesh([2, 3]), mesh([0, 1, 2, 3])
    with torch.no_grad():
        y = redistribute(distribute_tensor(full, src, [Shard(0)]).requires_grad_(), dst, [Shard(1)], async_op=True)
    z = redistribute(y, world, [Shard(0)])
    check(z, full, world, [Shard(0)], "chained")
    return f"requires_grad {y.requires_grad}"


def broken(rank: int) -> str:
    """An executor that broke on rank 2 only (as after a peer timeout there): the next call of that move fails on
    every rank before anything moves, and works again after clear_cache()."""
    full, src, dst = full_of((9, 4)), mesh([0, 1]), mesh([1, 2])
    x = distribute_tensor(full, src, [Shard(0)])
    check(redistribute(x, dst, [Shard(1)]), full, dst, [Shard(1)], "before")
    if rank == 2:
        next(e for e in rd._STATE.executors.values() if e.engine.program.dst_shape == (9, 2)).engine.abandon("simulated peer timeout")
    refused = _refused(lambda: redistribute(x, dst, [Shard(1)]))
    rd.clear_cache()
    check(redistribute(x, dst, [Shard(1)]), full, dst, [Shard(1)], "after clear_cache")
    return refused


def reinit(rank: int) -> str:
    """After destroy_process_group() and a new init_process_group(), moves over old rank sets run again."""
    full = full_of((12, 8))
    for life in range(2):
        src, sub, world = mesh([0, 1]), mesh([1, 2]), mesh([0, 1, 2, 3])
        x = distribute_tensor(full, src, [Shard(0)])
        check(redistribute(x, sub, [Shard(1)]), full, sub, [Shard(1)], "subgroup")
        check(redistribute(x, world, [Shard(1)], async_op=True), full, world, [Shard(1)], "world")
        dist.barrier()  # no rank destroys the group while another still uses it
        dist.destroy_process_group()
        port = int(os.environ["REINIT_PORTS"].split(",")[life])  # a new free port: the old store may live on, stale
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    return "ok"


SCENARIOS = ("bad_arguments", "back_to_back", "sender_waits", "wrong_local_shard", "grad_on_one_rank",
             "other_layout_on_one_rank", "scalar", "freed", "cycled",
             "bounded", "no_grad", "broken", "reinit")


def main_mode(rank: int, names: list[str]) -> None:
    for name in names or SCENARIOS:
        result = globals()[name](rank)
        for line in result if isinstance(result, list) else [f"{name}: {result}"]:
            print(f"rank {rank}: {line}", flush=True)


def die_mode(rank: int) -> None:
    """Rank 0 dies as its part of an asynchronous move starts; ranks 2 and 3, which wait on it, must raise on every use."""
    full, dst = full_of((16, 12)), mesh([2, 3])  # every mesh made up front: making one needs every rank alive
    x = distribute_tensor(full, mesh([0, 1]), [Shard(0)])
    check(redistribute(x, dst, [Shard(1)]), full, dst, [Shard(1)], "warm")
    if rank == 0:
        TorchEngine.start = lambda engine, src: os._exit(0)
    y = redistribute(x, dst, [Shard(1)], async_op=True)
    if rank >= 2:
        uses = [lambda: y.to_local() + 1, lambda: y.to_local().sum(), lambda: y.to_local().wait(), lambda: y.full_tensor()]
        errors = [_refused(use) for use in uses]
        print(f"rank {rank}: uses raised {sum(e != 'no error' for e in errors)} of {len(uses)}: "
              f"{sorted({e.split(':')[0] for e in errors})}", flush=True)
    else:
        _refused(lambda: y.to_local().wait())
        print(f"rank {rank}: sent", flush=True)
    os._exit(0)  # a dead peer can stall the process group's teardown


def exit_mode(rank: int) -> None:
    """Asynchronous moves left unwaited: ranks 0 and 1 only send (the receivers are slow), rank 3 never touches
    its result, rank 2 uses it. The interpreter then exits normally."""
    full, dst = full_of((512, 256)), mesh([2, 3])  # every mesh made up front: making one needs every rank alive
    x = distribute_tensor(full, mesh([0, 1]), [Shard(0)])
    with SlowStart([2, 3]):
        y = redistribute(x, dst, [Shard(1)], async_op=True)
    if rank == 2:
        check(y, full, dst, [Shard(1)], "exit")
    print(f"rank {rank}: exiting", flush=True)


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if sys.argv[1] == "main":
        main_mode(rank, sys.argv[2:])
    else:
        {"die": die_mode, "exit": exit_mode}[sys.argv[1]](rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
