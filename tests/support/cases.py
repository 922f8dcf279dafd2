"""Resharding problems and plans shared by the executor tests (no tests here; a helper module).

Every case uses exactly `DEVICES` distinct devices so one `mpiexec -n 8` launch can run them all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Cluster, DeviceMesh, Placement, Plan, ReshardingProblem

DEVICES = 8
STRATEGIES = ("broadcast", "send_recv", "local_allgather", "global_allgather")


def problem(name: str, shape, src_mesh, src_devices, src_spec, dst_mesh, dst_devices, dst_spec,
            dtype: str = "int32", devices_per_host: int = 2) -> ReshardingProblem:
    return ReshardingProblem(
        name=name, shape=tuple(shape), dtype=dtype,
        src=Placement(mesh=DeviceMesh(shape=tuple(src_mesh), devices=tuple(src_devices)), spec=src_spec),
        dst=Placement(mesh=DeviceMesh(shape=tuple(dst_mesh), devices=tuple(dst_devices)), spec=dst_spec),
        cluster=Cluster(devices_per_host=devices_per_host))


def fixed_problems() -> list[ReshardingProblem]:
    """Disjoint and overlapping meshes, even and uneven shards, several dtypes; 8 devices each."""
    return [
        problem("even_disjoint", (8, 6, 4), (2, 2), range(4), "S0 S1 R", (2, 2), range(4, 8), "R S0 S1"),
        problem("uneven_disjoint", (7, 5, 3), (2, 2), range(4), "S1 R S0", (1, 4), range(4, 8), "S01 R R", dtype="float16"),
        problem("to_replicated_rows", (9, 5), (1, 2), (0, 1), "S1 R", (2, 3), range(2, 8), "R S1", dtype="bfloat16"),
        problem("to_fully_replicated", (13, 4), (2,), (0, 1), "S0 R", (2, 3), range(2, 8), "R R", dtype="float32", devices_per_host=3),
        problem("overlap_same_devices", (6, 7, 2), (2, 4), range(8), "S0 S1 R", (4, 2), range(8), "S1 R S0"),
        problem("overlap_shifted", (10, 3), (2, 2), range(4), "S0 R", (2, 3), range(2, 8), "S1 R", dtype="complex128"),
        problem("one_to_many_uneven", (5, 11), (1, 1), (0,), "R R", (7,), range(1, 8), "R S0", dtype="int8"),
    ]


def random_problem(seed: int, max_devices: int = DEVICES, exact: bool = True) -> ReshardingProblem:
    """A seeded random resharding; with `exact`, it uses exactly `max_devices` distinct devices."""
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(n) for n in rng.integers(1, 10, size=ndim))
    while True:
        src_n = int(rng.integers(1, max_devices + 1))
        dst_n = int(rng.integers(1, max_devices + 1))
        overlap = int(rng.integers(max(0, src_n + dst_n - max_devices), min(src_n, dst_n) + 1))
        if not exact or src_n + dst_n - overlap == max_devices:
            break
    pool = [int(d) for d in rng.permutation(max_devices)]
    src_devices = pool[:src_n]
    dst_devices = src_devices[src_n - overlap:] + pool[src_n:src_n + dst_n - overlap]
    dst_devices = [dst_devices[i] for i in rng.permutation(len(dst_devices))]
    src_mesh, dst_mesh = _mesh_shape(rng, src_n), _mesh_shape(rng, dst_n)
    dtype = str(rng.choice(["int8", "float16", "bfloat16", "float32", "int64", "complex128"]))
    return problem(f"random{seed}", shape, src_mesh, src_devices, _spec(rng, ndim, len(src_mesh)), dst_mesh, dst_devices,
                   _spec(rng, ndim, len(dst_mesh)), dtype=dtype, devices_per_host=int(rng.integers(1, 5)))


def _mesh_shape(rng, n: int) -> tuple[int, ...]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    first = int(rng.choice(divisors))
    return (first, n // first) if n // first > 1 or rng.random() < 0.5 else (n,)


def _spec(rng, ndim: int, mesh_axes: int) -> str:
    """Each mesh axis goes to at most one tensor dim (or none); axes in a dim keep a random order."""
    dims: list[list[int]] = [[] for _ in range(ndim)]
    for axis in rng.permutation(mesh_axes):
        target = int(rng.integers(0, ndim + 1))
        if target < ndim:
            dims[target].append(int(axis))
    return " ".join("S" + "".join(map(str, d)) if d else "R" for d in dims)


def compiled(problem: ReshardingProblem, strategy: str) -> Plan:
    return compile_plan(problem, strategy=strategy, solver="greedy", seed=0)


def write_plans(folder: Path, plans: list[Plan]) -> list[str]:
    paths = []
    for i, plan in enumerate(plans):
        path = folder / f"{i:02d}_{plan.problem.name}_{plan.strategy}.plan.json"
        path.write_text(plan.to_json())
        paths.append(str(path))
    return paths


def with_chunks(plan: Plan, chunks: int) -> Plan:
    """The same plan with every broadcast cut into `chunks` pieces (the planner picks 1 for tiny boxes)."""
    ops = tuple(op.model_copy(update={"chunks": chunks}) if op.kind == "broadcast" else op for op in plan.operations)
    return plan.model_copy(update={"operations": ops, "strategy": f"{plan.strategy}_k{chunks}"})


def all_fixed_plans() -> list[Plan]:
    """Every fixed problem under every strategy, plus chunked broadcasts of two of them."""
    plans = [compiled(p, s) for p in fixed_problems() for s in STRATEGIES]
    plans += [with_chunks(compiled(p, "broadcast"), 3) for p in fixed_problems()[1:3]]
    return plans


def two_chunked_broadcasts_from_one_device():
    """Case 9 in small (strided boxes), every broadcast cut into 4 chunks: (problem, plan, a device that sends two of
    them, that device's device-order program), for the engines' step-order tests."""
    from xmesh_plan.executor.lower import in_device_order, lower
    from xmesh_plan.executor.ranks import plan_devices
    from xmesh_plan.planner.problem_io import build_problem

    problem = build_problem({"name": "case9_small", "shape": [8, 8, 16], "dtype": "int32",
                             "src": {"mesh": "2x4", "spec": "R S0 R"}, "dst": {"mesh": "2x4", "spec": "R R S0"}})
    plan = compile_plan(problem, strategy="broadcast", solver="naive")
    plan = plan.model_copy(update={"operations": tuple(op.model_copy(update={"chunks": 4}) for op in plan.operations)})
    sender = next(d for d in plan_devices(plan) if sum(op.src == d for op in plan.operations) == 2)
    return problem, plan, sender, in_device_order(lower(plan, sender, tag_limit=2**20))


CELL_ELEMENTS = 16 * 4 * 2  # one cell of the all-to-all below
CELL_BYTES = CELL_ELEMENTS * 4
BUCKET = 8 * CELL_BYTES  # 16 cells per host pair: two bundles each


def all_to_all(dtype: str = "int32"):
    """4 hosts of 8 devices; 16 source devices (4 per host) -> 16 destination devices (4 per host), every pair talks."""
    src = [8 * h + k for h in range(4) for k in range(4)]
    dst = [8 * h + 4 + k for h in range(4) for k in range(4)]
    return problem("a2a", (64, 64, 8), (4, 4), src, "S0 R S1", (4, 4), dst, "R S01 R", dtype=dtype, devices_per_host=8)


def coalesced(prob, bucket: int = BUCKET, **kw):
    return compile_plan(prob, solver="greedy", seed=0, coalesce=True, bucket_bytes=bucket, **kw)
