"""Destination shards as views of larger torch parents, as an inference engine's parameters or slices of fused ones
are (used by tests/test_receive_into.py, tests/test_executor_gpu_convert.py and bench/gpu/convert_check.py)."""

from __future__ import annotations

import torch

SENTINEL = 0x5A
"""The byte a parent holds outside its view: a reshard writing through the view must leave it there."""


def parent_and_view(shape: tuple[int, ...], dtype, layout: str):
    """(raw uint8 parent, the index of the view's bytes in it, the typed view of `shape`) for `layout`."""
    size = torch.empty((), dtype=dtype).element_size()
    if 0 in shape:  # an empty shard (an uneven split): nothing to lay out
        return torch.empty(0, dtype=torch.uint8), (slice(0, 0),), torch.empty(shape, dtype=dtype)
    if layout == "rows":  # two rows before, one after: a contiguous view at an offset, as a slice of a fused parameter
        rows = (shape[0] + 3,) + tuple(shape[1:])
        raw = torch.full(rows[:-1] + (rows[-1] * size,), SENTINEL, dtype=torch.uint8)
        index = (slice(2, 2 + shape[0]),) if len(shape) > 1 else (slice(2 * size, (2 + shape[0]) * size),)
        return raw, index, raw.view(dtype)[2:2 + shape[0]]
    if layout == "columns":  # one column before, one after: each row one run of memory
        raw = torch.full(tuple(shape[:-1]) + ((shape[-1] + 2) * size,), SENTINEL, dtype=torch.uint8)
        return raw, (..., slice(size, (1 + shape[-1]) * size)), raw.view(dtype)[..., 1:1 + shape[-1]]
    raw = torch.full(tuple(shape) + (2 * size,), SENTINEL, dtype=torch.uint8)  # every other element
    return raw, (..., slice(size, 2 * size)), raw.view(dtype)[..., 1]
