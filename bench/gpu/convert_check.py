"""One rank of the MPI + CuPy `nccl` engine converting at the sender and receiving into the caller's tensors on a real
GPU, every rank on GPU 0 (`executor.run.fake_hosts`); run by bench/gpu/convert_check.sh under mpiexec on 4 ranks.

    mpiexec -n 4 python3 bench/gpu/convert_check.py FOLDER
    python3 bench/gpu/convert_check.py --expected 4   # the `ok` lines a passing run on 4 ranks prints

Rank 0 compiles the plans of tests/test_executor_gpu_convert.py into FOLDER (the converting plans of
tests/workers/convert_worker.py: fp16, bf16, FP8 with block and per-tensor scales; a one-tensor bf16 cast; three
tensors in bundles); every rank reads them. Per plan: sources handed in as CUDA torch tensors, every destination
element and scale compared bit for bit with torch's own cast of the whole tensor on the CPU (`cast_reference`), twice
with new values; then (`into`) each destination shard handed in as a view of a larger CUDA parent (rows, columns,
every other element) must hold the bytes of a run into the engine's own buffers, with the parent's other bytes
untouched. Each rank prints `rank R: <check>: ok` or what was wrong, one line each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from xmesh_plan.executor import TransferExecutor
from xmesh_plan.executor.run import fake_hosts
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.schemas.plan_io import read_plan_file, write_plan_file
from xmesh_plan.weight_sync_demo import cast_reference
from tests.support.torch_views import SENTINEL, parent_and_view
from tests.workers.convert_worker import HOOKS, REPLICATED4, bits, cut, say, whole
from tests.workers.into_mpi_worker import THREE

LAYOUTS = ("rows", "columns", "every_other")
SINGLE = {"shape": [8, 6], "dtype": "float32", "dst_dtype": "bf16", "src": {"mesh": {"shape": [4], "devices": [0, 1, 2, 3]}, "spec": "S0 R"},
          "dst": {"mesh": {"shape": [4], "devices": [0, 1, 2, 3]}, "spec": "R S0"}}
CHECKS = [("hooks", "device", True), ("hooks", "posted", False), ("replicated", "device", False), ("single", "device", True),
          ("three bundles", "device", True)]



def expected_oks(ranks: int) -> int:
    """The `ok` lines a passing run prints: per rank, two runs of each check and an into run after those with `into`."""
    return ranks * sum(2 + into for _, _, into in CHECKS)


PLANS = {"hooks": lambda: compile_plan(build_transfer(HOOKS)), "replicated": lambda: compile_plan(build_transfer(REPLICATED4)),
         "single": lambda: compile_plan(build_problem(SINGLE)), "three bundles": lambda: compile_plan(build_transfer(THREE))}


def plans(comm, folder: Path) -> dict:
    """The plans, compiled once by rank 0 (a solver may not give every rank the same plan) and read by every rank."""
    if comm.Get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for name, make in PLANS.items():
            write_plan_file(folder / f"{name.replace(' ', '_')}.plan.json", make())
    comm.Barrier()
    return {name: read_plan_file(folder / f"{name.replace(' ', '_')}.plan.json") for name in PLANS}


def host_bytes(cupy, array) -> np.ndarray:
    return np.ascontiguousarray(cupy.asnumpy(array)).view(np.uint8).reshape(-1)


def given(ex, step: int) -> tuple[dict, dict, dict]:
    """Every tensor the caller passes: its whole values at `step` (CPU), this rank's source shards (CUDA), and its
    destination values and scales by torch's own cast (`cast_reference`), by name."""
    fulls, shards, wants = {}, {}, {}
    for name, problem, t in zip(ex.names, ex.problems, ex.program.tensors):
        if t.scale_of is not None:
            continue
        full = fulls[name] = whole(name, problem.shape, problem.dtype, step)
        if t.src_block is not None:
            shards[name] = to_gpu(cut(full, t.src_block))
        values, scales = (full, None) if t.convert is None else cast_reference(full, t.convert.dst_dtype, t.convert.scale)
        wants[name] = values
        if scales is not None:
            wants[name + ".scale"] = scales
    return fulls, shards, wants


def wrong_values(ex, cupy, out: dict, wants: dict) -> list[str]:
    """The names of the destination shards and scales in `out` (a run's) that are not bit-exact against `wants`."""
    def exact(name: str, box) -> bool:
        return np.array_equal(host_bytes(cupy, out[name]), bits(cut(wants[name], box)).numpy().reshape(-1))

    return [name for name, t in zip(ex.names, ex.program.tensors) if t.dst_block is not None and not exact(name, t.dst_block)]


def to_gpu(tensor):
    return tensor.contiguous().cuda()


def cuda_view(t, layout: str):
    """`tests.test_receive_into.parent_and_view` on the GPU: (uint8 parent, the index of the view's bytes in it, the
    view of the destination dtype)."""
    raw, index, view = parent_and_view(t.dst_shape, getattr(torch, t.dst_dtype), layout)
    raw = raw.cuda()
    return raw, index, raw.view(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())


def parents(ex, layout: str) -> dict:
    """Per destination tensor of this rank, a parent and a view of it laid out as `layout` (`cuda_view`)."""
    return {name: cuda_view(t, layout) for name, t in zip(ex.names, ex.program.tensors) if t.dst_shape is not None}


def wrong_into(cupy, layout: str, held: dict, want: dict) -> list[str]:
    """What differs between the views' bytes, read from their parents, and `want` (a run's into the own buffers), and
    which parents were written outside their views."""
    wrong = []
    for name, (raw, index, _) in held.items():
        seen = raw[index].contiguous().cpu().numpy().reshape(-1)
        rest = raw.clone()
        rest[index] = SENTINEL
        if not np.array_equal(seen, want[name]):
            wrong.append(f"{layout} {name}: {int((seen != want[name]).sum())} of {seen.size} bytes differ")
        if not bool((rest == SENTINEL).all()):
            wrong.append(f"{layout} {name}: bytes outside the view written")
    return wrong


def check(ex, cupy, rank: int, label: str, into: bool) -> None:
    """Two converting runs with new values, then (`into`) a run into the own buffers and one into views per layout."""
    for step in range(2):
        _, shards, wants = given(ex, step)
        wrong = wrong_values(ex, cupy, ex.run(shards), wants)
        say(f"rank {rank}: convert {label} step {step}: {'ok' if not wrong else 'wrong ' + ', '.join(wrong)}")
    if not into:
        return
    _, shards, _ = given(ex, 7)
    want = {name: host_bytes(cupy, got) for name, got in ex.run(shards).items()}
    wrong = []
    for layout in LAYOUTS:
        held = parents(ex, layout)
        ex.run(shards, into={name: view for name, (_, _, view) in held.items()})
        torch.cuda.synchronize()
        wrong += wrong_into(cupy, layout, held, want)
    say(f"rank {rank}: into {label}: {'ok' if not wrong else 'wrong: ' + '; '.join(wrong[:4])}")


def main() -> int:
    if sys.argv[1] == "--expected":  # convert_check.sh: how many `ok` lines a passing run on that many ranks prints
        print(expected_oks(int(sys.argv[2])))
        return 0
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    fake_hosts(rank)  # before the first NCCL call
    import cupy

    cupy.cuda.Device(0).use()
    torch.cuda.set_device(0)
    made = plans(comm, Path(sys.argv[1]))
    for label, order, into in CHECKS:
        ex = None
        try:
            ex = TransferExecutor(made[label], comm, backend="nccl", gpu=0, timeout_s=30.0, order=order).prepare()
            check(ex, cupy, rank, f"{label} {order}", into)
        except Exception as err:  # noqa: BLE001 - one line per failed check, then the next check
            say(f"rank {rank}: {label} {order}: error {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        finally:
            if ex is not None:
                try:
                    ex.close()
                except Exception as err:  # noqa: BLE001
                    say(f"rank {rank}: {label} {order}: close failed: {type(err).__name__}")
        comm.Barrier()  # the next check starts together on every rank, also after one failed somewhere
    return 0


if __name__ == "__main__":
    sys.exit(main())
