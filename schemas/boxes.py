"""Layouts as per-device boxes: what a placement lists where a sharding spec cannot say the layout.

DTensor's nested uneven splits, FSDP + TP strided shards, padded vocabularies, KV heads replicated
over more TP ranks than there are heads: any layout in which each device holds one box of the tensor.
A placement gives one box per mesh position (in the order of `mesh.devices`), each one `[start, stop)`
per tensor dim as a plan's `region` is written, or `{offset = [...], size = [...]}` as DTensor says it.
Boxes may overlap (replicas) and may be empty (a device holding nothing).

>>> box_field([[0, 5], [0, 8]]) == box_field({"offset": [0, 0], "size": [5, 8]})
True
>>> uncovered((4,), (((0, 2),), ((2, 4),))) is None
True
>>> uncovered((4,), (((0, 2),), ((3, 4),)))
((2, 3),)
"""

from __future__ import annotations

from functools import lru_cache
from itertools import chain, repeat
from typing import Annotated, Any

import numpy as np
from pydantic import BeforeValidator, ValidatorFunctionWrapHandler, WithJsonSchema, WrapValidator

from .geometry import Region
from .limits import shown

_PAIRS = (list, tuple)
MAX_BOX_CELLS = 2**24  # cells of the grid a box layout's coverage check cuts (a compile refuses far fewer unit tasks)


def _plain_boxes(values: Any) -> tuple[Region, ...] | None:
    """`values` as boxes when each is a list or tuple of [start, stop] lists or tuples of plain ints (what `box_field`
    takes it as), else None: the common case, its types and lengths checked a level at a time by C loops (`map`,
    `set`) and each box made by one (a problem lists 10^5-10^6 boxes); a list equal to one made before, int for int
    (a model's layers' scale tensors repeat a few), is that one's boxes."""
    global _listed_ints
    if not set(map(type, values)) <= _PAIR_TYPES:
        return None
    pairs = list(chain.from_iterable(values))
    if not (set(map(type, pairs)) <= _PAIR_TYPES and set(map(len, pairs)) <= _TWO):
        return None
    flat = tuple(chain.from_iterable(pairs))
    if not set(map(type, flat)) <= _INT:
        return None
    key = (tuple(map(len, values)), flat)
    made = _LISTS.get(key)
    if made is not None:
        return made
    boxes = list(map(tuple, map(map, repeat(tuple), values)))  # each box a tuple of (start, stop) tuples
    held = 1 + len(values) + len(flat)  # the list, its boxes and their ints: boxes of no dims hold no ints, yet each counts
    if len(_KNOWN) > _KNOWN_MOST or _listed_ints + held > _LISTED_MOST:
        _KNOWN.clear()
        _LISTS.clear()
        _listed_ints = 0
    made = _LISTS[key] = tuple(map(_KNOWN.setdefault, boxes, boxes))
    _listed_ints += held
    return made


_PAIR_TYPES, _TWO, _INT = frozenset(_PAIRS), frozenset({2}), frozenset({int})
_KNOWN: dict[Region, Region] = {}  # each distinct box made so far, kept once (a mesh's devices and a model's layers repeat a few)
_KNOWN_MOST = 1 << 16  # distinct boxes `_KNOWN` holds at most before it is let go
_LISTS: dict[tuple, tuple[Region, ...]] = {}  # (each box's dims, its ints in order) -> the boxes made of a list
_LISTED_MOST = 1 << 20  # lists, boxes and ints `_LISTS` holds at most (its keys' and values' references, tens of MiB) before it is let go
_listed_ints = 0


def box_field(value: Any) -> Region:
    """A box as given (`[[start, stop], ...]` or `{"offset": [...], "size": [...]}`) as a tuple of (start, stop) pairs."""
    plain = _plain_boxes((value,))
    if plain is not None:
        return plain[0]
    if isinstance(value, dict):
        if set(value) != {"offset", "size"}:
            raise ValueError(f"{shown(value)} is not a box; write [[start, stop], ...] per dim or {{offset = [...], size = [...]}}")
        offset, size = value["offset"], value["size"]
        if not (_ints(offset) and _ints(size)) or len(offset) != len(size) or min(size, default=0) < 0:
            raise ValueError(f"{shown(value)}: offset and size must be lists of integers of one length, sizes >= 0")
        return tuple((o, o + s) for o, s in zip(offset, size))
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 and _ints(p) for p in value):
        raise ValueError(f"{shown(value)} is not a box; write one [start, stop] per tensor dim, e.g. [[0, 4], [0, 8]]")
    return tuple((p[0], p[1]) for p in value)


def _ints(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


Box = Annotated[Region, BeforeValidator(box_field), WithJsonSchema({
    "type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
    "description": "one [start, stop) per tensor dim (input also takes {offset, size})"})]


_MADE: dict[int, tuple[Region, ...]] = {}  # id -> a list of boxes `_boxes` made (kept alive here, so the id is its own)
_MADE_MOST = 4096  # lists held at most, and boxes in them at most (about 50 MiB), before the lot is let go
_MADE_MOST_BOXES = 1 << 20
_made_boxes = 0


def _boxes(value: Any, handler: ValidatorFunctionWrapHandler) -> tuple[Region, ...]:
    """A list of boxes: each box as `box_field` gives it, in one call where every box is a plain one (`_plain_boxes`);
    otherwise each validated on its own (`handler`), whose errors name the box. A tuple this made before (a problem's
    tensor's boxes, passed on to its single-tensor problem's placement) is its own result: it is not walked again."""
    if _MADE.get(id(value)) is value:
        return value
    plain = _plain_boxes(value) if type(value) in _PAIRS else None
    if plain is None:
        return handler(value)
    return made_boxes(plain)


def made_boxes(boxes: tuple[Region, ...]) -> tuple[Region, ...]:
    """`boxes`, a tuple of boxes that are tuples of (int, int) pairs (what `_plain_boxes` makes, or code of this package
    computes), kept so that validating it as `Boxes` returns it without walking it (`_boxes`): a problem's scale
    tensors' boxes are computed, then checked as a model's fields."""
    global _made_boxes
    if len(_MADE) >= _MADE_MOST or _made_boxes + len(boxes) > _MADE_MOST_BOXES:
        _MADE.clear()
        _made_boxes = 0
    if _MADE.get(id(boxes)) is not boxes:  # a list held already is not counted again
        _MADE[id(boxes)] = boxes
        _made_boxes += len(boxes)
    return boxes


Boxes = Annotated[tuple[Box, ...], WrapValidator(_boxes)]


def is_empty(box: Region) -> bool:
    return any(hi <= lo for lo, hi in box)


def box_cut_points(shape: tuple[int, ...], boxes: Boxes) -> list[list[int]]:
    """Per dim, 0, the length and every start and stop of a non-empty box, sorted."""
    kept = [b for b in boxes if not is_empty(b)]
    return [sorted({0, n} | {b[d][i] for b in kept for i in (0, 1)}) for d, n in enumerate(shape)]


def box_index(cuts: list[np.ndarray], box: Region) -> tuple[slice, ...]:
    """The cells of a grid cut at `cuts` that `box` covers (its bounds are among the cuts)."""
    return tuple(slice(int(np.searchsorted(c, lo)), int(np.searchsorted(c, hi))) for c, (lo, hi) in zip(cuts, box))


@lru_cache(maxsize=256)
def check_boxes(boxes: Boxes, shape: tuple[int, ...], devices: int, field: str) -> None:
    """Raise ValueError naming `field` unless there is one box per device, each inside the tensor (once per distinct
    layout: a model's layers, and their scale tensors, repeat theirs)."""
    if len(boxes) != devices:
        raise ValueError(f"{field}: {len(boxes)} boxes for a mesh of {devices} devices; give one box per device, in the order of the mesh's devices")
    for i, box in enumerate(boxes):
        if len(box) != len(shape):
            raise ValueError(f"{field}[{i}]: {len(box)} [start, stop] pairs but the tensor has {len(shape)} dims; give one per dim")
        for d, ((lo, hi), n) in enumerate(zip(box, shape)):
            if not 0 <= lo <= hi <= n:
                raise ValueError(f"{field}[{i}]: dim {d} is [{lo}, {hi}), not inside [0, {n}); give 0 <= start <= stop <= {n}")


@lru_cache(maxsize=256)
def uncovered(shape: tuple[int, ...], boxes: Boxes) -> Region | None:
    """The first cell of the tensor (on the grid the boxes cut) that no box covers, or None when they cover it all
    (once per distinct layout: a model's layers, and their scale tensors, repeat theirs)."""
    if 0 in shape:
        return None
    cuts = [np.asarray(c) for c in box_cut_points(shape, boxes)]
    cells = int(np.prod([len(c) - 1 for c in cuts], dtype=object))
    if cells > MAX_BOX_CELLS:
        raise ValueError(f"the boxes cut the tensor into {cells:,} cells, more than the {MAX_BOX_CELLS:,} a layout may; "
                         "give fewer distinct box bounds (a sharding spec, or coarser boxes)")
    covered = np.zeros(tuple(len(c) - 1 for c in cuts), dtype=bool)
    for box in set(boxes):
        if not is_empty(box):
            covered[box_index(cuts, box)] = True
    if covered.all():
        return None
    first = np.argwhere(~covered)[0]
    return tuple((int(c[i]), int(c[i + 1])) for c, i in zip(cuts, first))
