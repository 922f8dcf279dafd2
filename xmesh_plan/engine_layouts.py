"""How inference engines lay out their parameters: a small catalogue of rules, each a sharding spec.

An inference engine of `R` replicas of tensor parallelism `T` is a mesh of `R x T` ranks (rows: replicas,
the last axis: the TP ranks; one replica is a 1-d mesh of `T`). Its parameters follow a few rules, each
written in the spec language (docs/format.md) once the tensor's number of dims is known:

| rule           | what it is (vLLM's names)                                  | 2-d weight on R x T | 1-d   |
|----------------|------------------------------------------------------------|---------------------|-------|
| `COLUMN`       | column-parallel (`ColumnParallelLinear`: q, k, v, gate, up) | `S1 R`              | `S1`  |
| `ROW`          | row-parallel (`RowParallelLinear`: o, down), input dim split | `R S1`            | -     |
| `VOCAB`        | vocab-parallel embedding / LM head, vocab rows split        | `S1 R`              | -     |
| `REPLICATED`   | every TP rank holds all of it (norms, row-parallel biases)  | `R R`               | `R`   |
| `EXPERT`       | expert-parallel (`FusedMoE`), experts (dim 0) over TP ranks | `S1 R R` (3-d)      | -     |

Any spec text (e.g. `"R S1"`) is a rule too. Splits are ceil-division (`torch.chunk`). Fused parameters
(qkv, gate_up) take a rule too, with `weight_sync.Fused` naming their parts; a vocabulary the engine pads to
a multiple of its TP size and KV heads replicated when TP exceeds their count need per-device boxes, which
this catalogue does not say.

>>> COLUMN.spec(2, 2), ROW.spec(2, 2), VOCAB.spec(2, 1), REPLICATED.spec(1, 2), EXPERT.spec(3, 2)
('S1 R', 'R S1', 'S0 R', 'R', 'S1 R R')
>>> layout_spec("R S1", 2, 2, "w")
'R S1'
"""

from __future__ import annotations

from dataclasses import dataclass

from xmesh_plan.schemas.spec import ShardingSpec

from .sides import FrontendError


@dataclass(frozen=True, slots=True)
class Layout:
    """A rule of the catalogue: which tensor dim the engine splits over its TP ranks (None: none), and the
    number of dims the rule is meant for (None: any)."""

    name: str
    dim: int | None
    ndims: tuple[int, ...] | None = None

    def spec(self, ndim: int, mesh_ndim: int) -> str:
        """The spec of a tensor of `ndim` dims laid out by this rule on a mesh of `mesh_ndim` dims (TP the last)."""
        if self.ndims is not None and ndim not in self.ndims:
            raise ValueError(f"{self.name} lays out tensors of {' or '.join(map(str, self.ndims))} dims, not {ndim}")
        entries = ["R"] * ndim
        if self.dim is not None:
            entries[self.dim] = f"S{mesh_ndim - 1}"
        return " ".join(entries)


COLUMN = Layout("COLUMN", 0, (1, 2))
ROW = Layout("ROW", 1, (2,))
VOCAB = Layout("VOCAB", 0, (2,))
REPLICATED = Layout("REPLICATED", None)
EXPERT = Layout("EXPERT", 0, (2, 3))
CATALOGUE = {layout.name: layout for layout in (COLUMN, ROW, VOCAB, REPLICATED, EXPERT)}


def layout_spec(layout: object, ndim: int, mesh_ndim: int, name: str) -> str:
    """The spec text of tensor `name` (of `ndim` dims) under `layout` (a catalogue rule or spec text) on a mesh of
    `mesh_ndim` dims; one FrontendError line naming the tensor otherwise."""
    if isinstance(layout, Layout):
        try:
            return layout.spec(ndim, mesh_ndim)
        except ValueError as err:
            raise FrontendError(f"inference[{name!r}]: {err}; pick another rule or give its spec text, e.g. \"R S1\"") from None
    if isinstance(layout, str):
        try:
            spec = ShardingSpec.parse(layout)
        except ValueError as err:
            raise FrontendError(f"inference[{name!r}]: layout {layout!r} is not a spec ({err}); write e.g. \"S1 R\"") from None
        if len(spec.dims) != ndim:
            raise FrontendError(f"inference[{name!r}]: layout {layout!r} has {len(spec.dims)} entries for a tensor of {ndim} "
                                "dims; give one entry per dim")
        return str(spec)
    raise FrontendError(f"inference[{name!r}]: layout is a {type(layout).__name__}; use one of "
                        f"{', '.join(CATALOGUE)} (xmesh_plan.engine_layouts) or spec text such as \"R S1\"")
