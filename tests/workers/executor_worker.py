"""Run under `mpiexec` by tests/test_executor_mpi.py; holds no tests itself.

    mpiexec -n 8 python tests/workers/executor_worker.py check PLAN...    # run(), start()/test()/wait(), DLPack input
    mpiexec -n 8 python tests/workers/executor_worker.py torch PLAN...    # CPU torch tensors in (bfloat16 included)
    mpiexec -n 8 python tests/workers/executor_worker.py iterations PLAN...  # new data every iteration, checked every time
    mpiexec -n 4 python tests/workers/executor_worker.py die PLAN         # rank 1 exits before iteration 2
    mpiexec -n 4 python tests/workers/executor_worker.py demo-die PLAN    # the demo, with rank 1 exiting in its 3rd run()
    mpiexec -n 4 python tests/workers/executor_worker.py demo-fail-late PLAN  # the demo, rank 1's close() failing after its last collective
    mpiexec -n 4 python tests/workers/executor_worker.py demo-bug PLAN    # the demo, rank 1's 3rd run() raising an unexpected error
    mpiexec -n 4 python tests/workers/executor_worker.py interrupt PLAN   # an exception escapes wait() on rank 0
    mpiexec -n 8 python tests/workers/executor_worker.py cross-wait A B   # two reshards in flight, waited in rank-dependent order
    mpiexec -n 8 python tests/workers/executor_worker.py threads PLAN     # two executors, each run in a loop by its own thread
    mpiexec -n 2 python tests/workers/executor_worker.py other-plan A B [R]  # rank R (default 1) loads plan B, the others A
    mpiexec -n 8 python tests/workers/executor_worker.py batch JOBS.json  # several of check, torch, iterations, cross-wait,
                                                    # threads in one launch: a JSON list of {"name", "mode", "plans"}

Prints `ok <plan name>` on rank 0 per checked plan (`<job name>: ok ...` in a batch); errors go to stderr as
`rank R: <type>: <message>`.
"""

from __future__ import annotations

import json
import os
import sys
import time

PREFIX = ""  # put before each `ok` line: a batch job's `name: `


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
    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor.pattern import fill, mismatches
    from xmesh_plan.schemas import load_plan

    for path in paths:
        plan = load_plan(path)
        ex = ReshardingExecutor(plan, comm, timeout_s=30).prepare()
        p = ex.program
        shard = fill(p.src_block, plan.problem.shape, ex.engine.dtype) if p.src_block else None
        for mode in modes:
            if p.dst_block is not None:  # the MPI engine makes its own shard on the first run: poison() makes it first
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
            print(f"{PREFIX}ok {plan.problem.name} {plan.strategy}", flush=True)


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
    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor.pattern import fill, mismatches
    from xmesh_plan.schemas import load_plan

    for path in paths:
        plan = load_plan(path)
        ex = ReshardingExecutor(plan, comm, timeout_s=30).prepare()
        p, shard = ex.program, None
        for it in range(count):
            salt = 37 * it + 1
            if p.src_block is not None:
                shard = next_source(shard, fill(p.src_block, plan.problem.shape, ex.engine.dtype, salt), it)
            if p.dst_block is not None:  # the MPI engine makes its own shard on the first run: poison() makes it first
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
            print(f"{PREFIX}ok {plan.problem.name} {plan.strategy}", flush=True)


def die(comm, path: str) -> None:
    """Rank 1 leaves after two good iterations; the others must time out naming it."""
    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor.pattern import fill
    from xmesh_plan.schemas import load_plan

    plan = load_plan(path)
    ex = ReshardingExecutor(plan, comm, timeout_s=3).prepare()
    shard = fill(ex.program.src_block, plan.problem.shape, ex.engine.dtype) if ex.program.src_block else None
    for i in range(4):
        if i == 2 and comm.Get_rank() == 1:
            print("rank 1: exiting on purpose", file=sys.stderr, flush=True)
            os._exit(0)
        ex.run(shard)
    from xmesh_plan.executor.executor import DEFAULT_POLL_S, poll

    poll(comm.Ibarrier(), 3, DEFAULT_POLL_S, "the final barrier")  # ranks that never talked to rank 1 notice here


def demo_die(path: str) -> int:
    """The demo (`python -m xmesh_plan.executor.run --timeout 2`) with rank 1 leaving during its third run()."""
    from mpi4py import MPI

    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor import run as demo

    original, calls = ReshardingExecutor.run, [0]

    def run(self, shard=None):
        calls[0] += 1
        if calls[0] == 3 and MPI.COMM_WORLD.Get_rank() == 1:
            os._exit(0)
        return original(self, shard)

    ReshardingExecutor.run = run
    return demo.main([path, "--iters", "5", "--warmup", "0", "--timeout", "2", "--max-mb", "1"])


def demo_failing(path: str, method: str, call: int, error: Exception) -> int:
    """The demo (`--timeout 2`) with rank 1's `call`-th ReshardingExecutor.`method` raising `error`."""
    from mpi4py import MPI

    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor import run as demo

    original, calls = getattr(ReshardingExecutor, method), [0]

    def failing(self, *args):
        calls[0] += 1
        if calls[0] == call and MPI.COMM_WORLD.Get_rank() == 1:
            raise error
        return original(self, *args)

    setattr(ReshardingExecutor, method, failing)
    return demo.main([path, "--iters", "3", "--warmup", "0", "--timeout", "2", "--max-mb", "1"])


class Interrupted(Exception):
    """Stands in for KeyboardInterrupt or an exception raised by a signal handler during wait()."""


def interrupt(comm, path: str) -> None:
    """An exception escapes rank 0's wait() while its peers have not started the reshard (they start it only after
    a barrier on the world communicator that rank 0 joins once wait() has raised); the executor must then refuse
    to run with a one-line ExecutorError (not start active MPI requests again), and close() must work."""
    from mpi4py import MPI

    from xmesh_plan.executor import ExecutorError, ReshardingExecutor
    from xmesh_plan.executor.pattern import fill
    from xmesh_plan.schemas import load_plan

    plan = load_plan(path)
    # posted: rank 0's sends are all on the wire after start(), so the peers finish the reshard it abandons
    # (in device order they wait for rank 0 to drive its later operations, and time out)
    ex = ReshardingExecutor(plan, comm, timeout_s=20, order="posted").prepare()
    shard = fill(ex.program.src_block, plan.problem.shape, ex.engine.dtype) if ex.program.src_block else None
    ex.run(shard)
    rank = comm.Get_rank()
    if rank == 0:
        ex.start(shard)
        ex.engine.test = lambda: (_ for _ in ()).throw(Interrupted("interrupted"))  # the next poll raises
        try:
            ex.wait()
        except Interrupted:
            pass
        comm.Barrier()  # now the peers start: the reshard rank 0 abandoned is still in flight on the wire
        del ex.engine.test
        try:
            ex.run(shard)
        except ExecutorError as err:
            assert "stopped after an error (Interrupted in wait())" in str(err) and "\n" not in str(err), err
            print(f"refused: {err}", flush=True)
        else:
            raise AssertionError("run() after an interrupted wait() must be refused")
        assert not ex.in_flight
        try:
            ex.test()
        except ExecutorError:
            pass
        else:
            raise AssertionError("test() after a failed reshard must raise, not report it done")
    else:
        comm.Barrier()  # until rank 0's wait() has raised
        ex.run(shard)  # the reshard rank 0 abandoned still completes on the wire
    duplicate = ex.comm
    ex.close()
    assert duplicate == MPI.COMM_NULL, "close() must free the communicator prepare() duplicated"
    comm.Barrier()
    if rank == 0:
        print("ok interrupt", flush=True)


def cross_wait(comm, paths: list[str]) -> None:
    """Two executors in flight whose plans relay in opposite directions; even ranks wait for the first one first,
    odd ranks for the second. Each wait must drive the other reshard's relays, or neighbours wait on each other."""
    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor.pattern import fill, mismatches
    from xmesh_plan.schemas import load_plan

    plans = [load_plan(path) for path in paths]
    executors = [ReshardingExecutor(plan, comm, timeout_s=5).prepare() for plan in plans]
    for salt, (plan, ex) in enumerate(zip(plans, executors), start=1):
        p = ex.program
        ex.start(fill(p.src_block, plan.problem.shape, ex.engine.dtype, salt) if p.src_block else None)
    order = [0, 1] if comm.Get_rank() % 2 == 0 else [1, 0]
    for k in order:
        out, p, shape = executors[k].wait(), executors[k].program, plans[k].problem.shape
        if p.dst_block is not None:
            bad, where = mismatches(out, p.dst_block, shape, k + 1)
            assert not bad, f"plan {k}: device {p.device}: {bad} elements differ, first at {where}"
    first, second = executors
    for ex in (first, second):
        ex.close()
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"{PREFIX}ok cross-wait", flush=True)


def threads(comm, path: str, iterations: int = 100) -> None:
    """Two executors of one plan, each driven by its own thread (MPI_THREAD_MULTIPLE); a waiting engine must
    not progress an engine another thread is testing (a request finished twice corrupts the step counts)."""
    import threading

    from mpi4py import MPI

    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor.pattern import fill, mismatches
    from xmesh_plan.schemas import load_plan

    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE, "mpi4py asks for MPI_THREAD_MULTIPLE by default"
    plan = load_plan(path)
    executors = [ReshardingExecutor(plan, comm, timeout_s=20).prepare() for _ in range(2)]
    outcome: dict[int, str] = {}

    def loop(k: int) -> None:
        ex, p = executors[k], executors[k].program
        try:
            for it in range(iterations):
                salt = 100 * k + it
                out = ex.run(fill(p.src_block, plan.problem.shape, ex.engine.dtype, salt) if p.src_block else None)
                if out is not None:
                    bad, where = mismatches(out, p.dst_block, plan.problem.shape, salt)
                    assert not bad, f"iteration {it}: {bad} elements differ, first at {where}"
            outcome[k] = "ok"
        except Exception as err:  # reported below, from the main thread
            outcome[k] = f"{type(err).__name__}: {err}"

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if outcome != {0: "ok", 1: "ok"}:
        raise AssertionError(f"device {executors[0].program.device}: {outcome}")
    for ex in executors:
        ex.close()
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"{PREFIX}ok threads", flush=True)


def other_plan(comm, paths: list[str]) -> None:
    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.schemas import load_plan

    odd = int(paths[2]) if len(paths) > 2 else 1
    plan = load_plan(paths[1] if comm.Get_rank() == odd else paths[0])
    ReshardingExecutor(plan, comm, timeout_s=10).prepare()


def batch(comm, jobs_file: str) -> None:
    """Each job of the JSON list in turn on every rank: its mode (`RUNNERS`) on its plans, its lines `name: ok ...`."""
    global PREFIX
    for job in json.loads(open(jobs_file).read()):
        PREFIX = f"{job['name']}: "
        RUNNERS[job["mode"]](comm, job["plans"])
        comm.Barrier()
    PREFIX = ""


RUNNERS = {"check": check, "torch": lambda comm, paths: check(comm, paths, ("torch",)), "iterations": iterations,
           "die": lambda comm, paths: die(comm, paths[0]), "interrupt": lambda comm, paths: interrupt(comm, paths[0]),
           "cross-wait": cross_wait, "threads": lambda comm, paths: threads(comm, paths[0]), "other-plan": other_plan,
           "batch": lambda comm, paths: batch(comm, paths[0])}


def main() -> int:
    from mpi4py import MPI

    from xmesh_plan.executor import ExecutorError

    comm = MPI.COMM_WORLD
    mode, paths = sys.argv[1], sys.argv[2:]
    if mode == "demo-die":
        return demo_die(paths[0])
    if mode == "demo-fail-late":  # after the demo's last collective: its peers have nothing left to wait for
        return demo_failing(paths[0], "close", 1, ExecutorError("injected failure in close()"))
    if mode == "demo-bug":
        return demo_failing(paths[0], "run", 3, ZeroDivisionError("injected bug in run()"))
    try:
        RUNNERS[mode](comm, paths)
    except (ExecutorError, AssertionError) as err:
        print(f"rank {comm.Get_rank()}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
