"""Multi-tensor plans on the fake MPI: a three-tensor problem, random ones, one TransferExecutor per rank,
and the check of every destination shard against numpy slicing of each full tensor."""

from __future__ import annotations

import numpy as np
import pytest

from xmesh_plan.executor import TransferExecutor
from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.mpi_engine import MpiEngine
from xmesh_plan.executor.passes import rank_program
from xmesh_plan.executor.ranks import plan_devices, rank_of_devices
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.schemas import Plan
from tests.support.fake_mpi import FakeComm, FakeMPI, FakeWorld, WorldComm


def three_tensors(dst_devices=(3, 4, 5)):
    """Three tensors of three dtypes on overlapping meshes (device 3 is in both), so copies, sends and broadcasts all occur."""
    return build_transfer({
        "name": "three", "src_mesh": {"shape": [2, 2], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [3], "devices": list(dst_devices)},
        "cluster": {"devices_per_host": 2},
        "tensors": [{"name": "w", "shape": [12, 6], "src": "S0 R", "dst": "R S0"},
                    {"name": "bias", "shape": [9], "dtype": "int16", "src": "S01", "dst": "R"},
                    {"name": "emb", "shape": [6, 4, 3], "dtype": "bfloat16", "src": "R S1 R", "dst": "S0 R R"}]})


def many_bundles(tensors: int = 12, first: int = 4, per_host: int = 4):
    """`tensors` small tensors from host 0's four devices to devices first..first+3 (one other host: `first` a
    multiple of `per_host`, devices per host): every box is bundled, a bundle gathers from three holders and scatters
    to three needers."""
    return build_transfer({
        "name": "bundles", "src_mesh": {"shape": [4], "devices": [0, 1, 2, 3]},
        "dst_mesh": {"shape": [4], "devices": list(range(first, first + 4))}, "cluster": {"devices_per_host": per_host},
        "tensors": [{"name": f"t{i}", "shape": [64, 16], "dtype": "float32", "src": "S0 R", "dst": "R S0"} for i in range(tensors)]})


def full_tensors(plan: Plan, seed: int) -> dict[str, np.ndarray]:
    """Random contents of every whole tensor, as the executor stores them (raw 16-bit for bfloat16)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in plan.problem.tensors:
        dtype = storage_dtype(t.dtype)
        out[t.name] = rng.integers(0, 2**(8 * dtype.itemsize) - 1, size=t.shape, dtype=np.uint64).astype(
            f"u{dtype.itemsize}").view(dtype)
    return out


def slice_box(array: np.ndarray, box) -> np.ndarray:
    return array[tuple(slice(a, b) for a, b in box)]


def fake_executors(plan: Plan, concurrent: bool = True, order: str = "device") -> list[TransferExecutor]:
    """One TransferExecutor per rank over one fake MPI world, each set up as prepare() sets it up (without the
    ranks' agreement round): its device's program (`passes.rank_program`, tags unique across tensors on the one
    communicator, so a collision would deliver bytes to the wrong tensor) replayed by one MpiEngine for every
    tensor. `concurrent=False` (posted): one tensor after another, as on an engine that runs one reshard at a time."""
    devices, rank_of = plan_devices(plan), rank_of_devices(plan)
    world = FakeWorld()
    out = []
    for rank, device in enumerate(devices):
        ex = TransferExecutor(plan, WorldComm(world, rank, len(devices)), order=order)
        ex.program = rank_program(plan, device, order, concurrent, tag_limit=2**20, collectives=ex.entry.collectives)
        ex.engine = MpiEngine(ex.program, FakeComm(world, rank), rank_of, 5.0, (1e-5, 1e-4))
        ex.engine.setup(mpi=FakeMPI)
        out.append(ex)
    return out


def run_everywhere(plan: Plan, executors: list[TransferExecutor], full: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    for ex in executors:
        shards = {name: slice_box(full[name], shards.src_block)
                  for name, shards in zip(ex.names, ex.program.tensors) if shards.src_block is not None}
        ex.start(shards or None)
    for _ in range(10_000):
        if all([ex.test() for ex in executors]):
            break
    else:
        pytest.fail("stalled")
    return {ex.device: {k: v.copy() for k, v in ex.wait().items()} for ex in executors}


def assert_every_shard(plan: Plan, out: dict[int, dict[str, np.ndarray]], full: dict[str, np.ndarray]) -> None:
    """Every destination shard of every tensor, and nothing else, bit for bit against numpy slicing."""
    problems = plan.problem.tensor_problems()
    assert sum(len(s) for s in out.values()) == sum(len(p.blocks("dst")) for p in problems)
    for device, shards in out.items():
        for name, got in shards.items():
            want = slice_box(full[name], problems[plan.problem.index_of(name)].blocks("dst")[device])
            assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8)), (device, name)


def random_transfer(seed: int, max_devices: int, exact: bool = False):
    """A seeded random multi-tensor problem: one to four tensors of random shapes, dtypes and specs on the
    meshes of a random single-tensor problem (overlapping or not; with `exact`, on exactly `max_devices`)."""
    from tests.support.cases import _spec, random_problem

    base = random_problem(seed, max_devices=max_devices, exact=exact)
    rng = np.random.default_rng(seed + 1)
    tensors = []
    for k in range(int(rng.integers(1, 5))):
        ndim = int(rng.integers(1, 4))
        tensors.append({"name": f"t{k}", "shape": [int(n) for n in rng.integers(1, 10, size=ndim)],
                        "dtype": str(rng.choice(["int8", "float16", "bfloat16", "float32", "int64"])),
                        "src": _spec(rng, ndim, len(base.src.mesh.shape)), "dst": _spec(rng, ndim, len(base.dst.mesh.shape))})
    mesh = lambda m: {"shape": list(m.shape), "devices": list(m.devices)}  # noqa: E731
    return build_transfer({"name": f"random{seed}", "src_mesh": mesh(base.src.mesh), "dst_mesh": mesh(base.dst.mesh),
                           "cluster": {"devices_per_host": base.cluster.devices_per_host}, "tensors": tensors})
