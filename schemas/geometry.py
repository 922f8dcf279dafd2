"""Which elements of a tensor a device holds under a sharding spec, with GSPMD's ceil-division padding.

A dim of length n split into d shards uses chunk c = ceil(n / d); shard k covers
[k*c, min((k+1)*c, n)), so the last shards may be shorter or empty.

>>> shard_interval(10, 4, 3)
(9, 10)
>>> shard_interval(3, 4, 3)
(3, 3)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .spec import ShardingSpec

Region = tuple[tuple[int, int], ...]
"""A box in global tensor coordinates: one half-open (start, stop) per dim."""


def shard_interval(length: int, num_shards: int, index: int) -> tuple[int, int]:
    """Half-open interval of shard `index` of a dim of `length` split into `num_shards`."""
    chunk = -(-length // num_shards)
    return min(index * chunk, length), min((index + 1) * chunk, length)


def shard_boundaries(length: int, num_shards: int) -> list[int]:
    """All cut points of a dim split into `num_shards` shards, 0 and length included."""
    return sorted({shard_interval(length, num_shards, k)[0] for k in range(num_shards)} | {length})


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in region)


def region_size(region: Region) -> int:
    """Elements in a box (1 for a box of no dims): a loop, not `math.prod(region_shape(...))`, as every staging figure
    and route asks it of every part."""
    n = 1
    for start, stop in region:
        n *= stop - start
    return n


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two boxes, or None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def split_region(region: Region, parts: int) -> list[Region]:
    """Cut a box into `parts` pieces along its longest dim (ceil division; empty pieces dropped)."""
    shape = region_shape(region)
    dim = max(range(len(shape)), key=lambda d: (shape[d], -d))
    start = region[dim][0]
    pieces = []
    for k in range(parts):
        lo, hi = shard_interval(shape[dim], parts, k)
        if hi > lo:
            pieces.append(region[:dim] + ((start + lo, start + hi),) + region[dim + 1 :])
    return pieces


def local_slices(region: Region, block: Region) -> tuple[slice, ...]:
    """Index of `region` inside a buffer that holds `block` (region must lie inside block)."""
    return tuple(slice(r0 - b0, r1 - b0) for (r0, r1), (b0, _) in zip(region, block))


@dataclass(frozen=True, slots=True)
class Layout:
    """A tensor shape sharded by a spec over a mesh shape: answers which box each mesh position holds."""

    tensor_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    spec: ShardingSpec

    def shard_index(self, mesh_coord: tuple[int, ...]) -> tuple[int, ...]:
        """Shard number along each tensor dim for the device at `mesh_coord` (major axis first)."""
        out = []
        for dim in self.spec.dims:
            index = 0
            for axis in dim.mesh_axes:
                index = index * self.mesh_shape[axis] + mesh_coord[axis]
            out.append(index)
        return tuple(out)

    def block_of_shard(self, shard: tuple[int, ...]) -> Region:
        counts = self.spec.shard_counts(self.mesh_shape)
        return tuple(shard_interval(n, c, k) for n, c, k in zip(self.tensor_shape, counts, shard))

    def block(self, mesh_coord: tuple[int, ...]) -> Region:
        """The box of the tensor held by the device at `mesh_coord`."""
        return self.block_of_shard(self.shard_index(mesh_coord))

    def cut_points(self) -> list[list[int]]:
        """Shard boundaries along every tensor dim."""
        counts = self.spec.shard_counts(self.mesh_shape)
        return [shard_boundaries(n, c) for n, c in zip(self.tensor_shape, counts)]

    def shard_of_points(self, dim: int, starts: np.ndarray) -> np.ndarray:
        """Shard number along `dim` holding each element index in `starts` (vectorized)."""
        counts = self.spec.shard_counts(self.mesh_shape)
        chunk = max(1, -(-self.tensor_shape[dim] // counts[dim]))
        return np.minimum(np.asarray(starts) // chunk, counts[dim] - 1)
