"""One rank of the MPI engine writing the caller's arrays in place (`run(shards, into=...)`), run under mpiexec by
tests/test_receive_into_mpi.py on 4 ranks; holds no tests itself.

    mpiexec -n 4 python tests/workers/into_mpi_worker.py

Per plan (three tensors by broadcasts, by local all-gathers, by bundles; the converting plan of
tests/workers/convert_worker.py; a one-tensor plan) and order (device, posted): a run into the engine's own buffers
gives the bytes every later run must deliver; then each destination shard is handed in as a view into a larger
numpy parent filled with a sentinel, laid out as rows of a taller parent (contiguous, at an offset), columns of a
wider one (each row one run of memory) or every other element (no two adjacent), twice with the same parent and
once with a new one. Each time: the view's bytes (read from the parent) equal the own run's, the parent's other
bytes are untouched, the engine's own buffer (poisoned before) is not written, and once the call has returned and
the caller drops the parent, nothing keeps it alive. Then a new executor of the same plan is only ever handed views
(each layout once): the same bytes, and it makes no destination buffer of its own. Each rank prints
`rank R: <plan> <order>: ok` and `rank R: <plan> <order> into only: ok`, or what was wrong.
"""

from __future__ import annotations

import os
import sys
import weakref

import numpy as np
from mpi4py import MPI

from xmesh_plan.executor import ReshardingExecutor, TransferExecutor
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.transfer_io import build_transfer

SENTINEL = 0x5A
LAYOUTS = ("rows", "columns", "every_other")
THREE = {"src_mesh": {"shape": [2, 2], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [3], "devices": [1, 2, 3]},
         "cluster": {"devices_per_host": 2},
         "tensors": [{"name": "w", "shape": [12, 6], "src": "S0 R", "dst": "R S0"},
                     {"name": "bias", "shape": [9], "dtype": "int16", "src": "S01", "dst": "R"},
                     {"name": "emb", "shape": [6, 4, 3], "dtype": "bfloat16", "src": "R S1 R", "dst": "S0 R R"}]}


def say(line: str) -> None:
    os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: ranks' lines never interleave


def parent_and_view(shape: tuple[int, ...], dtype: np.dtype, layout: str) -> tuple[np.ndarray, tuple, np.ndarray]:
    """(uint8 parent, the index of the view's bytes in it, the typed view of `shape`)."""
    size = dtype.itemsize
    if 0 in shape:
        return np.empty(0, np.uint8), (slice(0, 0),), np.empty(shape, dtype)
    if layout == "rows":
        raw = np.full((shape[0] + 3,) + tuple(shape[1:-1]) + (shape[-1] * size,), SENTINEL, np.uint8) if len(shape) > 1 else \
            np.full(((shape[0] + 3) * size,), SENTINEL, np.uint8)
        index = (slice(2, 2 + shape[0]),) if len(shape) > 1 else (slice(2 * size, (2 + shape[0]) * size),)
        return raw, index, raw.view(dtype)[2:2 + shape[0]]
    if layout == "columns":
        raw = np.full(tuple(shape[:-1]) + ((shape[-1] + 2) * size,), SENTINEL, np.uint8)
        return raw, (..., slice(size, (1 + shape[-1]) * size)), raw.view(dtype)[..., 1:1 + shape[-1]]
    raw = np.full(tuple(shape) + (2 * size,), SENTINEL, np.uint8)
    return raw, (..., slice(size, 2 * size)), raw.view(dtype)[..., 1]


def sources(ex, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random source shards: float32 values, int16 and raw bfloat16 bits."""
    out = {}
    for name, t in zip(ex.names, ex.program.tensors):
        if t.given_shape is not None:
            out[name] = (rng.standard_normal(t.given_shape) * 100).astype(np.float32) if t.dtype == "float32" else \
                rng.integers(0, 2**15, t.given_shape).astype(np.int16 if t.dtype == "int16" else np.uint16)
    return out


def runner(ex, one: bool):
    """A function running `ex` once on this rank's random source shards (the same each time), into the views given."""
    shards = sources(ex, np.random.default_rng(MPI.COMM_WORLD.Get_rank()))
    return (lambda into: {ex.names[0]: ex.run(shards.get(ex.names[0]), into=into and into[ex.names[0]])}) if one else \
        (lambda into: ex.run(shards, into=into))


def check(label: str, ex, one: bool) -> dict[str, np.ndarray]:
    """The checks above on `ex`; the bytes of its own run, per tensor."""
    rank = MPI.COMM_WORLD.Get_rank()
    run = runner(ex, one)
    want = {name: np.array(got, copy=True).view(np.uint8) for name, got in run(None).items() if got is not None}
    wrong = []
    for layout in LAYOUTS:
        parents = {}
        for attempt in range(3):
            if attempt != 1:  # the second run reuses the parents of the first: bound once
                parents = {name: parent_and_view(t.dst_shape, ex.engine.dtypes[k], layout)
                           for k, (name, t) in enumerate(zip(ex.names, ex.program.tensors)) if t.dst_shape is not None}
            ex.engine.poison()
            got = run({name: view for name, (_, _, view) in parents.items()} or None)
            for k, (name, (raw, index, view)) in enumerate(parents.items()):
                if got[name] is not view:
                    wrong.append(f"{layout} {name}: run() returned another array")
                seen = np.ascontiguousarray(raw[index]).reshape(-1)
                if not np.array_equal(seen, want[name].reshape(-1)):
                    wrong.append(f"{layout} {name}: {int((seen != want[name].reshape(-1)).sum())} wrong bytes")
                rest = raw.copy()
                rest[index] = SENTINEL
                if not (rest == SENTINEL).all():
                    wrong.append(f"{layout} {name}: bytes outside the view written")
                own = ex.engine.dsts[ex.names.index(name)]
                if own is not None and own.size and not (own.reshape(-1).view(np.uint8) == 0xA5).all():
                    wrong.append(f"{layout} {name}: the engine's own buffer was written")
            refs = [weakref.ref(raw) for raw, _, _ in parents.values()]
            got = view = raw = index = rest = seen = None
            if attempt == 2:
                parents = None
                if any(ref() is not None for ref in refs):
                    wrong.append(f"{layout}: the engine keeps the caller's array alive")
    say(f"rank {rank}: {label}: {'ok' if not wrong else 'wrong: ' + '; '.join(wrong[:4])}")
    return want


def check_into_only(label: str, ex, one: bool, want: dict[str, np.ndarray]) -> None:
    """`ex`, new, run only into views (each layout once): the bytes of `want`, and no destination buffer of its own."""
    run, wrong = runner(ex, one), []
    for layout in LAYOUTS:
        parents = {name: parent_and_view(t.dst_shape, ex.engine.dtypes[k], layout)
                   for k, (name, t) in enumerate(zip(ex.names, ex.program.tensors)) if t.dst_shape is not None}
        got = run({name: view for name, (_, _, view) in parents.items()} or None)
        for name, (raw, index, view) in parents.items():
            if got[name] is not view or not np.array_equal(np.ascontiguousarray(raw[index]).reshape(-1), want[name].reshape(-1)):
                wrong.append(f"{layout} {name}: not the own run's bytes in the view")
        if any(own is not None for own in ex.engine.dsts):
            wrong.append(f"{layout}: the engine made destination buffers of its own")
    say(f"rank {MPI.COMM_WORLD.Get_rank()}: {label} into only: {'ok' if not wrong else 'wrong: ' + '; '.join(wrong[:4])}")


def main() -> int:
    from convert_worker import HOOKS  # the converting plan of tests/workers/convert_worker.py (this script's folder)

    comm = MPI.COMM_WORLD
    plans = {f"three {s}": compile_plan(build_transfer(THREE), strategy=s, solver="greedy", split_hosts=False, coalesce=False)
             for s in ("broadcast", "local_allgather")}
    plans["three bundles"] = compile_plan(build_transfer(THREE), strategy="auto", solver="greedy")
    plans["converting"] = compile_plan(build_transfer(HOOKS))
    for label, plan in plans.items():
        for order in ("device", "posted"):
            ex = TransferExecutor(plan, comm, timeout_s=60.0, order=order).prepare()
            try:
                want = check(f"{label} {order}", ex, one=False)
            finally:
                ex.close()
            ex = TransferExecutor(plan, comm, timeout_s=60.0, order=order).prepare()
            try:
                check_into_only(f"{label} {order}", ex, False, want)
            finally:
                ex.close()
    mesh = {"shape": [4], "devices": [0, 1, 2, 3]}
    problem = build_problem({"shape": [8, 6], "dtype": "float32", "src": {"mesh": mesh, "spec": "S0 R"}, "dst": {"mesh": mesh, "spec": "R S0"}})
    plan = compile_plan(problem)
    ex = ReshardingExecutor(plan, comm, timeout_s=60.0).prepare()
    try:
        want = check("one tensor", ex, one=True)
    finally:
        ex.close()
    ex = ReshardingExecutor(plan, comm, timeout_s=60.0).prepare()
    try:
        check_into_only("one tensor", ex, True, want)
    finally:
        ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
