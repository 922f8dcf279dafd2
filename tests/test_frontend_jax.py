"""The JAX front end against JAX itself: every device's box equals `NamedSharding.devices_indices_map(shape)`.

conftest.py gives jax 16 CPU devices (XLA_FLAGS, set before jax is imported).
"""

from __future__ import annotations

import math
import random

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from tests.support.builders import compile_fast
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan import FrontendError, problem_from_shardings

CASES = 300
AXIS_NAMES = ("data", "model", "pipe")
MESH = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
EXPLICIT = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)


def test_jax_sees_sixteen_cpu_devices():
    assert len(jax.devices()) >= 16, "XLA_FLAGS=--xla_force_host_platform_device_count=16 must be set before jax is imported (tests/conftest.py)"


def jax_boxes(sharding: NamedSharding, shape) -> dict[int, tuple]:
    """Device id -> its box, from JAX's own index map."""
    return {device.id: tuple(s.indices(n)[:2] for s, n in zip(index, shape))
            for device, index in sharding.devices_indices_map(tuple(shape)).items()}


def random_sharding(rng: random.Random, ndim: int) -> NamedSharding:
    """A random mesh of 1-3 axes over a random subset of the 16 devices, and a random PartitionSpec for `ndim` dims."""
    sizes = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
    while math.prod(sizes) > 16:
        sizes[rng.randrange(len(sizes))] = 1
    names = tuple(rng.sample(AXIS_NAMES, len(sizes)))
    devices = np.array(rng.sample(jax.devices()[:16], math.prod(sizes))).reshape(sizes)
    free = list(names)
    rng.shuffle(free)
    entries = []
    for _ in range(ndim):
        take = min(rng.choice([0, 0, 1, 1, 2]), len(free))
        axes, free = tuple(free[:take]), free[take:]
        entries.append(None if not axes else axes[0] if take == 1 and rng.random() < 0.5 else axes)
    while entries and entries[-1] is None and rng.random() < 0.5:
        entries.pop()  # JAX pads a short spec with None
    return NamedSharding(Mesh(devices, names), P(*entries))


def shard_counts(sharding: NamedSharding, ndim: int) -> list[int]:
    entries = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
    return [math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in entries]


def random_shape(rng: random.Random, src: NamedSharding, dst: NamedSharding, ndim: int) -> tuple[int, ...]:
    """Mostly even for both shardings (JAX needs that), one dim in ten off by one."""
    counts = [math.lcm(a, b) for a, b in zip(shard_counts(src, ndim), shard_counts(dst, ndim))]
    return tuple(c * rng.randint(1, 3) + (rng.random() < 0.1) for c in counts)


def test_every_box_matches_jax_for_random_shardings():
    rng = random.Random(20261010)
    accepted = refused = 0
    for case in range(CASES):
        ndim = rng.randint(1, 3)
        src, dst = random_sharding(rng, ndim), random_sharding(rng, ndim)
        shape = random_shape(rng, src, dst, ndim)
        where = f"case {case}: shape {shape}, src {src.mesh.shape} {src.spec}, dst {dst.mesh.shape} {dst.spec}"
        try:
            problem = problem_from_shardings(shape, "float32", src, dst)
        except FrontendError as err:
            assert "divide evenly" in str(err), where
            with pytest.raises(ValueError):  # JAX refuses the same layout
                for sharding in (src, dst):
                    sharding.devices_indices_map(shape)
            refused += 1
            continue
        accepted += 1
        assert problem.blocks("src") == jax_boxes(src, shape), where
        assert problem.blocks("dst") == jax_boxes(dst, shape), where
    assert accepted >= CASES // 2 and refused >= 5, (accepted, refused)


def test_tuple_axes_keep_jax_order_major_first():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    src, dst = NamedSharding(mesh, P(("y", "x"))), NamedSharding(mesh, P())
    problem = problem_from_shardings((16,), "float32", src, dst)
    assert str(problem.src.spec) == "S10" and str(problem.dst.spec) == "R"
    assert problem.blocks("src") == jax_boxes(src, (16,))


def test_plan_from_two_named_shardings_verifies():
    devices = np.array(jax.devices()[:16])
    src = NamedSharding(Mesh(devices[:8].reshape(2, 4), ("data", "model")), P(None, "model"))
    dst = NamedSharding(Mesh(devices[8:].reshape(4, 2), ("data", "model")), P(("data", "model"), None))
    problem = problem_from_shardings((64, 32), jax.numpy.bfloat16, src, dst)
    assert (problem.dtype, problem.src.mesh.devices, problem.dst.mesh.devices) == ("bfloat16", tuple(range(8)), tuple(range(8, 16)))
    verify_plan(compile_fast(problem))


def test_reduced_axes_hold_full_copies_and_plan_as_replicated():
    src = NamedSharding(EXPLICIT, P("x", reduced={"y"}))
    problem = problem_from_shardings((8, 4), "float32", src, NamedSharding(EXPLICIT, P()))
    assert str(problem.src.spec) == "S0 R" and problem.blocks("src") == jax_boxes(src, (8, 4))


def test_abstract_meshes_are_placed_like_shorthand():
    mesh = AbstractMesh((2, 4), ("x", "y"))
    problem = problem_from_shardings((8, 8), "float32", NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "y")))
    assert problem.src.mesh.devices == tuple(range(8)) and problem.dst.mesh.devices == tuple(range(8, 16))


@pytest.mark.parametrize("args, message", [
    (dict(dst=NamedSharding(MESH, P(P.UNCONSTRAINED))), "dst: .* UNCONSTRAINED; give the concrete layout"),
    (dict(src=NamedSharding(EXPLICIT, P("x", unreduced={"y"}))), "src: .* partial sums over y; reduce them on the source mesh first"),
    (dict(dst=NamedSharding(MESH, P("x", None, None))), "dst: .* has 3 entries but the array has 2 dims"),
    (dict(dst=SingleDeviceSharding(jax.devices()[0])), "dst: SingleDeviceSharding is not a NamedSharding"),
    (dict(shape=(6, 3)), "src: .* splits dim 1 \\(length 3\\) into 2 shards, which JAX requires to divide evenly"),
    (dict(dst=NamedSharding(AbstractMesh((2,), ("x",)), P())), "one sharding has an AbstractMesh"),
    (dict(dtype=np.dtype("U3")), "dtype: .* has no xmesh-plan equivalent"),
    (dict(dtype=None), "dtype: None is not a dtype"),
    (dict(shape=(8.5, 8)), r"shape: \(8.5, 8\) is not a sequence of integers"),
    (dict(shape=(8, np.True_)), "shape: .* is not a sequence of integers"),
])
def test_bad_input_gets_one_line_naming_the_argument(args, message):
    kwargs = dict(shape=(8, 8), dtype="float32", src=NamedSharding(MESH, P("x", "y")), dst=NamedSharding(MESH, P())) | args
    with pytest.raises(FrontendError, match=message) as info:
        problem_from_shardings(**kwargs)
    assert "\n" not in str(info.value)
