"""JAX front end: two `NamedSharding`s -> a `ReshardingProblem` (planning only; JAX moves the data or our engines do).

Device ids are JAX's `device.id`. A `PartitionSpec` entry `None` is `R`, `'x'` is `S` over axis x,
`('x', 'y')` is `S` over x then y (x major), as JAX orders them; missing trailing entries are `None`.
JAX refuses a dim its shard count does not divide, so we refuse it too. Two `AbstractMesh`es (no
devices) are placed like the CLI's mesh shorthand: the source from host 0, the destination after it.

>>> from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
>>> mesh = AbstractMesh((2, 4), ("x", "y"))
>>> problem = problem_from_shardings((8, 16), "bfloat16", NamedSharding(mesh, P("x", ("y",))),
...                                  NamedSharding(mesh, P(None, ("y", "x"))))
>>> str(problem.src.spec), str(problem.dst.spec), problem.dst.mesh.devices[:2]
('S0 S1', 'R S10', (8, 9))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from xmesh_plan.planner.problem_io import InputError, hosts_used, place_mesh
from xmesh_plan.schemas import Cluster, ReshardingProblem

from .sides import FrontendError, Side, build_problem, global_shape


def problem_from_shardings(shape: Sequence[int], dtype: object, src: NamedSharding, dst: NamedSharding,
                           cluster: Cluster | None = None) -> ReshardingProblem:
    """The problem of moving an array of global `shape` and `dtype` from sharding `src` to sharding `dst`."""
    shape = global_shape(shape)
    cluster = cluster or Cluster()
    src_side, dst_side = (_side(shape, sharding, name) for sharding, name in ((src, "src"), (dst, "dst")))
    if _is_abstract(src) != _is_abstract(dst):
        raise FrontendError("dst: one sharding has an AbstractMesh and the other concrete devices; give both concrete meshes or both abstract")
    if _is_abstract(src):
        src_side, dst_side = _placed_on_hosts(src_side, dst_side, cluster.devices_per_host)
    return build_problem(shape, dtype, src_side, dst_side, cluster)


def _is_abstract(sharding: NamedSharding) -> bool:
    return isinstance(sharding.mesh, AbstractMesh)


def _side(shape: tuple[int, ...], sharding: object, field: str) -> Side:
    if not isinstance(sharding, NamedSharding):
        raise FrontendError(f"{field}: {type(sharding).__name__} is not a NamedSharding; pass NamedSharding(mesh, PartitionSpec(...))")
    mesh, spec = sharding.mesh, sharding.spec
    _check_unreduced(spec, field)
    # `partitions`, not iteration: JAX refuses to iterate a spec that has reduced axes
    entries = tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)
    if len(entries) > len(shape):
        raise FrontendError(f"{field}: {spec} has {len(entries)} entries but the array has {len(shape)} dims; give at most one per dim")
    names = tuple(mesh.axis_names)
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    entries += (None,) * (len(shape) - len(entries))
    dim_axes = tuple(_axes(entry, names, spec, field) for entry in entries)
    _check_even(shape, sizes, dim_axes, spec, field)
    devices = () if isinstance(mesh, AbstractMesh) else tuple(int(d.id) for d in mesh.devices.flat)
    return Side(sizes, devices, dim_axes)


def _check_unreduced(spec: PartitionSpec, field: str) -> None:
    """Refuse pending partial sums (`unreduced`); `reduced` axes hold full copies (replicated), so they plan as R."""
    pending = getattr(spec, "unreduced", frozenset())
    if pending:
        raise FrontendError(f"{field}: {spec} holds partial sums over {', '.join(sorted(map(str, pending)))}; "
                            "reduce them on the source mesh first (e.g. reshard to a spec without unreduced axes)")


def _axes(entry: object, names: tuple[str, ...], spec: PartitionSpec, field: str) -> tuple[int, ...]:
    """Mesh axis indices of one PartitionSpec entry, major first (NamedSharding has checked the names exist, once each)."""
    if entry is None:
        return ()
    if entry is PartitionSpec.UNCONSTRAINED:
        raise FrontendError(f"{field}: {spec} leaves a dim UNCONSTRAINED; give the concrete layout (None or mesh axes)")
    return tuple(names.index(name) for name in (entry if isinstance(entry, tuple) else (entry,)))


def _check_even(shape: tuple[int, ...], sizes: tuple[int, ...], dim_axes: tuple[tuple[int, ...], ...],
                spec: PartitionSpec, field: str) -> None:
    for dim, axes in enumerate(dim_axes):
        count = math.prod(sizes[a] for a in axes)
        if shape[dim] % count:
            raise FrontendError(f"{field}: {spec} splits dim {dim} (length {shape[dim]}) into {count} shards, which JAX requires "
                                f"to divide evenly; pad dim {dim} to a multiple of {count} or shard it over fewer devices")


def _placed_on_hosts(src: Side, dst: Side, devices_per_host: int) -> tuple[Side, Side]:
    """Device ids for two abstract meshes, as the CLI places shorthand meshes: source from host 0, destination after it."""
    try:
        src_mesh = place_mesh(src.mesh_shape, 0, devices_per_host, "src.mesh")
        dst_mesh = place_mesh(dst.mesh_shape, hosts_used(src_mesh, devices_per_host), devices_per_host, "dst.mesh")
    except InputError as err:
        raise FrontendError(str(err)) from None
    return (Side(src.mesh_shape, src_mesh.devices, src.dim_axes), Side(dst.mesh_shape, dst_mesh.devices, dst.dim_axes))
