"""GSPMD-style sharding specs: one entry per tensor dim, `R` or `S` with the mesh axes it is split over.

>>> spec = ShardingSpec.parse("R S01 R")
>>> str(spec)
'R S01 R'
>>> ShardingSpec.parse("S^0,R,R") == ShardingSpec.parse("S0RR")
True
>>> spec.shard_counts((2, 4))
(1, 8, 1)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_TOKEN = re.compile(r"\s*(?:(R)|S\^?(?:\{([0-9]+)\}|([0-9]+)))\s*,?", re.ASCII)
EXAMPLE_SPECS = "'S0 R R', 'R S01 R', 'S^0RR' or 'S1,R,R'"


class SpecError(ValueError):
    """A sharding spec that cannot be parsed or does not fit its tensor or mesh."""


@dataclass(frozen=True, slots=True)
class DimSharding:
    """How one tensor dim is laid out: replicated (no axes) or split over mesh axes, major first."""

    mesh_axes: tuple[int, ...] = ()

    @property
    def is_replicated(self) -> bool:
        return not self.mesh_axes

    def __str__(self) -> str:
        return "R" if self.is_replicated else "S" + "".join(str(a) for a in self.mesh_axes)

    def __repr__(self) -> str:
        return f"DimSharding({self.mesh_axes!r})"


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """A sharding spec such as `R S01 R`; `parse(str(spec)) == spec`."""

    dims: tuple[DimSharding, ...]

    @classmethod
    def parse(cls, text: str) -> "ShardingSpec":
        """Parse `S0RR`, `R S01 R`, `S^0 R R` or `S1,R,R`; the error names the bad token."""
        if not isinstance(text, str):
            from .limits import shown

            raise SpecError(f"{shown(text)} is not a sharding spec (a {type(text).__name__}); write it as text with one entry per "
                            f"tensor dim, e.g. {EXAMPLE_SPECS}")
        if not text.strip():
            raise SpecError(f"empty sharding spec; write one entry per tensor dim, e.g. {EXAMPLE_SPECS}")
        dims, pos = [], 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                bad = text[pos:].strip().split()[0] if text[pos:].strip() else text[pos:]
                raise SpecError(
                    f"bad token {bad!r} at position {pos} in sharding spec {text!r}; "
                    f"use R or S<axes>, e.g. {EXAMPLE_SPECS}"
                )
            axes = () if match.group(1) else tuple(int(c) for c in (match.group(2) or match.group(3)))
            dims.append(DimSharding(axes))
            pos = match.end()
        spec = cls(tuple(dims))
        spec._check_axes_unique(text)
        return spec

    def _check_axes_unique(self, text: str) -> None:
        used = [a for d in self.dims for a in d.mesh_axes]
        repeated = sorted({a for a in used if used.count(a) > 1})
        if repeated:
            raise SpecError(f"mesh axis {repeated[0]} is used more than once in sharding spec {text!r}; each mesh axis may shard one dim once")

    def check_fits(self, tensor_rank: int, mesh_shape: tuple[int, ...], field: str = "spec") -> None:
        """Raise SpecError unless the spec has one entry per tensor dim and names only existing mesh axes."""
        if len(self.dims) != tensor_rank:
            raise SpecError(f"{field} {str(self)!r} has {len(self.dims)} entries but the tensor has {tensor_rank} dims; give one entry per dim")
        for axis in (a for d in self.dims for a in d.mesh_axes):
            if axis >= len(mesh_shape):
                raise SpecError(
                    f"{field} {str(self)!r} uses mesh axis {axis} but the mesh {'x'.join(map(str, mesh_shape))} has axes 0..{len(mesh_shape) - 1}"
                )

    def shard_counts(self, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Number of shards of each tensor dim on a mesh of this shape."""
        return tuple(math.prod(mesh_shape[a] for a in d.mesh_axes) for d in self.dims)

    def __str__(self) -> str:
        return " ".join(str(d) for d in self.dims)

    def __repr__(self) -> str:
        return f"ShardingSpec.parse({str(self)!r})"
