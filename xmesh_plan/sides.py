"""What both front ends share: a framework-neutral side (mesh + per-dim axes), dtype names, the problem builder.

A front end reads its framework's mesh and placements into two `Side`s, then `build_problem`
turns them into a `ReshardingProblem`; any bad input becomes one `FrontendError` line naming the
argument and the fix.

>>> side = Side(mesh_shape=(2, 2), devices=(4, 5, 6, 7), dim_axes=((0, 1), ()))
>>> problem = build_problem((8, 3), "bf16", side, Side((4,), (0, 1, 2, 3), ((), (0,))), None)
>>> str(problem.src.spec), str(problem.dst.spec), problem.dtype
('S01 R', 'R S0', 'bfloat16')
>>> problem.blocks("src")[5]
((2, 4), (0, 3))
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from pydantic import ValidationError

from xmesh_plan.planner.problem_io import InputError
from xmesh_plan.schemas import Cluster, DeviceMesh, Placement, ReshardingProblem
from xmesh_plan.schemas.dtypes import DTYPE_SIZES, canonical_dtype
from xmesh_plan.schemas.spec import DimSharding, ShardingSpec
from xmesh_plan.schemas.validation import describe_validation_error


class FrontendError(InputError):
    """A DTensor or JAX layout that cannot become a resharding problem; one line naming the argument and the fix."""


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a resharding in our terms: mesh shape, global device ids row-major, mesh axes per tensor dim (major
    first), or each device's box (row-major, as `devices`) for a layout the spec cannot say."""

    mesh_shape: tuple[int, ...]
    devices: tuple[int, ...]
    dim_axes: tuple[tuple[int, ...], ...]
    boxes: tuple[tuple[tuple[int, int], ...], ...] | None = None  # each device's box where no spec says the layout

    @property
    def spec(self) -> ShardingSpec:
        return ShardingSpec(tuple(DimSharding(axes) for axes in self.dim_axes))


def dtype_name(dtype: object, field: str = "dtype") -> str:
    """Our name for a torch, numpy/JAX or string dtype: `torch.bfloat16`, `jnp.bfloat16`, `"bf16"` -> `"bfloat16"`."""
    if dtype is None:  # numpy reads None as float64: refused, not guessed
        raise FrontendError(f"{field}: None is not a dtype; pass the tensor's dtype, e.g. torch.bfloat16 or \"float32\"")
    if isinstance(dtype, str):
        name = canonical_dtype(dtype)
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        name = _numpy_dtype_name(dtype)
    if name not in DTYPE_SIZES:
        raise FrontendError(f"{field}: {dtype!r} has no xmesh-plan equivalent; use one of {', '.join(DTYPE_SIZES)}")
    return name


def _numpy_dtype_name(dtype: object) -> str | None:
    import numpy as np

    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def build_problem(shape: object, dtype: object, src: Side, dst: Side, cluster: Cluster | None) -> ReshardingProblem:
    """The resharding problem of a tensor of `shape` and `dtype` moving from `src` to `dst` on `cluster` (default: ours)."""
    shape = global_shape(shape)
    sides = {name: _placement(side, name) for name, side in (("src", src), ("dst", dst))}
    try:
        return ReshardingProblem(shape=shape, dtype=dtype_name(dtype), cluster=cluster or Cluster(), **sides)
    except ValidationError as err:
        raise FrontendError(describe_validation_error(err)) from None


def global_shape(shape: object) -> tuple[int, ...]:
    """A tensor's global shape as a tuple of non-negative ints; anything else is one FrontendError line."""
    try:  # operator.index: an int (numpy's too), never a float cut down (8.5 -> 8) or a boolean read as 0 or 1
        dims = tuple(_dim(n) for n in shape)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise FrontendError(f"shape: {shape!r} is not a sequence of integers; pass the global shape, e.g. (1024, 512)") from None
    if not dims or min(dims) < 0:
        raise FrontendError(f"shape: {shape!r} needs at least one dim and no negative lengths; pass the global shape, e.g. (1024, 512)")
    return dims


def _dim(value: object) -> int:
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError("a boolean is not a length")
    return operator.index(value)


def _placement(side: Side, name: str) -> Placement:
    try:
        mesh = DeviceMesh(shape=side.mesh_shape, devices=side.devices)
    except ValidationError as err:
        raise FrontendError(f"{name}_mesh: {describe_validation_error(err)}") from None
    if side.boxes is not None:
        return Placement(mesh=mesh, boxes=side.boxes)
    return Placement(mesh=mesh, spec=side.spec)
