"""How inference engines lay out their parameters: a small catalogue of rules, each a sharding spec or per-device boxes.

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
(qkv, gate_up) take a rule too, with `weight_sync.Fused` naming their parts.

Two rules no spec says are lowered to one box per device (`schemas.boxes`) once the trainer's global shape
is known (`boxes`), each a `BoxRule`:

| rule                  | what it is (vLLM's rule)                                                                 |
|-----------------------|------------------------------------------------------------------------------------------|
| `PADDED_VOCAB`        | `VocabParallelEmbedding` / `ParallelLMHead`: the vocabulary (dim 0) padded to a multiple of 64 (`padded_vocab(n)` for another), then split in equal shares over the TP ranks; rank t's tensor has s = padded / T rows, its real rows `[min(t*s, V), min((t+1)*s, V))` at the top, the padding rows below them (the sync leaves those alone) |
| `kv_heads(n)`         | `QKVParallelLinear`'s k and v of `n` KV heads (dim 0, `n * head_dim` rows): with T <= n each TP rank holds n / T heads; with T > n each head is replicated on T / n consecutive ranks, rank t holding head t // (T / n) |

In a fused qkv, `kv_heads(n)` is a part's rule: `Fused((q, k, v), rules=(None, kv_heads(n), kv_heads(n)))`.
A rule whose tensor has more rows than the plan writes (padding) says so by `local_shape`; the plan's box lies
at the start of the engine's tensor, so the sync writes `tensor[:rows]` (`weight_sync_layouts.engine_view`).

>>> COLUMN.spec(2, 2), ROW.spec(2, 2), VOCAB.spec(2, 1), REPLICATED.spec(1, 2), EXPERT.spec(3, 2)
('S1 R', 'R S1', 'S0 R', 'R', 'S1 R R')
>>> layout_spec("R S1", 2, 2, "w")
'R S1'
>>> PADDED_VOCAB.boxes((100, 8), (1, 2)), PADDED_VOCAB.local_shape((100, 8), (1, 2))
((((0, 64), (0, 8)), ((64, 100), (0, 8))), (64, 8))
>>> kv_heads(2).boxes((8, 3), (4,))
(((0, 4), (0, 3)), ((0, 4), (0, 3)), ((4, 8), (0, 3)), ((4, 8), (0, 3)))
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import product
from typing import Any, ClassVar

from xmesh_plan.schemas.geometry import Region
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


@dataclass(frozen=True, slots=True)
class BoxRule:
    """A rule no spec says: one box per mesh position (`boxes`) of dim 0 over the TP ranks, for 1- or 2-d tensors; its
    fields travel in the rank's row (`row`, read back by `rule_of_row`)."""

    name: ClassVar[str]

    def row(self) -> dict[str, Any]:
        return {"rule": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def check(self, ndim: int) -> None:
        if ndim not in (1, 2):
            raise ValueError(f"{self} lays out tensors of 1 or 2 dims, not {ndim}")


@dataclass(frozen=True, slots=True)
class PaddedVocab(BoxRule):
    """vLLM's vocab-parallel rule: dim 0 (the vocabulary, V rows) padded to a multiple of `pad_to`, split in equal
    shares of `s` rows over the T TP ranks (vLLM refuses a padded length T does not divide); rank t's real rows are
    [min(t*s, V), min((t+1)*s, V)), the first rows of its tensor of `s` rows."""

    pad_to: int = 64
    name: ClassVar[str] = "PADDED_VOCAB"

    def share(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
        """Rows per TP rank: the padded vocabulary over the TP ranks."""
        padded, tp = -(-shape[0] // self.pad_to) * self.pad_to, mesh_shape[-1]
        if padded % tp:
            raise ValueError(f"the vocabulary of {shape[0]} rows padded to a multiple of {self.pad_to} is {padded} rows, which "
                             f"{tp} TP ranks cannot share equally (vLLM refuses it too); use padded_vocab(n) with n a multiple of {tp}")
        return padded // tp

    def boxes(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Region, ...]:
        self.check(len(shape))
        s = self.share(shape, mesh_shape)
        return tuple(((min(c[-1] * s, shape[0]), min((c[-1] + 1) * s, shape[0])),) + tuple((0, n) for n in shape[1:])
                     for c in _coords(mesh_shape))

    def local_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.share(shape, mesh_shape),) + tuple(shape[1:])

    def __str__(self) -> str:
        return self.name if self.pad_to == 64 else f"padded_vocab({self.pad_to})"


@dataclass(frozen=True, slots=True)
class KvHeads(BoxRule):
    """vLLM's k and v of `heads` KV heads (dim 0 of `heads * head_dim` rows) over T TP ranks: T <= heads, each rank
    holds heads / T of them in order; T > heads, rank t holds head t // (T / heads) (`num_kv_head_replicas`). vLLM
    refuses a T that neither divides nor is a multiple of `heads`."""

    heads: int
    name: ClassVar[str] = "KV_HEADS"

    def boxes(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Region, ...]:
        self.check(len(shape))
        tp, n = mesh_shape[-1], self.heads
        if shape[0] % n:
            raise ValueError(f"{shape[0]} rows are not {n} KV heads of equal size; give kv_heads(n) the model's number of KV heads")
        if (n % tp if tp <= n else tp % n):
            raise ValueError(f"{tp} TP ranks neither divide {n} KV heads nor are a multiple of them (vLLM refuses it too)")
        per, replicas, d = max(1, n // tp), max(1, tp // n), shape[0] // n
        return tuple(((c[-1] // replicas * per * d, (c[-1] // replicas + 1) * per * d),) + tuple((0, m) for m in shape[1:])
                     for c in _coords(mesh_shape))

    def local_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        (lo, hi), *rest = self.boxes(shape, mesh_shape)[0]
        return (hi - lo,) + tuple(b - a for a, b in rest)

    def __str__(self) -> str:
        return f"kv_heads({self.heads})"


def padded_vocab(pad_to: int = 64) -> PaddedVocab:
    """The vocab-parallel rule with the vocabulary padded to a multiple of `pad_to` (vLLM's `padding_size`, 64 by default)."""
    if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < 1:
        raise FrontendError(f"padded_vocab: pad_to is {pad_to!r}; give a positive integer such as 64")
    return PaddedVocab(pad_to)


def kv_heads(heads: int) -> KvHeads:
    """The rule of a k or v projection of `heads` KV heads (the model's `num_key_value_heads`)."""
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise FrontendError(f"kv_heads: heads is {heads!r}; give the model's number of KV heads, a positive integer")
    return KvHeads(heads)


def _coords(mesh_shape: tuple[int, ...]):
    """Mesh positions row-major (the order of a mesh's devices)."""
    return product(*(range(n) for n in mesh_shape))


PADDED_VOCAB = PaddedVocab()
BOX_RULES = {"PADDED_VOCAB": lambda row: padded_vocab(row["pad_to"]), "KV_HEADS": lambda row: kv_heads(row["heads"])}
CATALOGUE = {layout.name: layout for layout in (COLUMN, ROW, VOCAB, REPLICATED, EXPERT, PADDED_VOCAB)}


def rule_of_row(row: dict[str, Any]) -> BoxRule:
    """The box rule a row names (`BoxRule.row()`, as the ranks exchange it)."""
    return BOX_RULES[row["rule"]](row)


def layout_row(layout: object, ndim: int, mesh_ndim: int, name: str) -> str | dict[str, Any]:
    """What a rank says of tensor `name`'s layout: spec text (`layout_spec`), or a box rule's row (lowered to boxes by
    every rank once the trainer's shape is known); one FrontendError line naming the tensor otherwise."""
    if isinstance(layout, BoxRule):
        try:
            layout.check(ndim)
        except ValueError as err:
            raise FrontendError(f"inference[{name!r}]: {err}; pick another rule or give its spec text") from None
        return layout.row()
    return layout_spec(layout, ndim, mesh_ndim, name)


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
                        f"{', '.join(CATALOGUE)}, kv_heads(n) (xmesh_plan.engine_layouts) or spec text such as \"R S1\"")
