"""A deterministic fill for checking a reshard bit for bit: each element is a hash of its global index.

Values depend only on the element's position in the whole tensor, so any rank can compute what any
box must hold. Floats are filled through their raw bits (NaN patterns included; compare raw bits).

>>> a = fill(((0, 2), (1, 3)), (4, 4), np.dtype("int32"))
>>> bool((a == fill(((0, 4), (0, 4)), (4, 4), np.dtype("int32"))[0:2, 1:3]).all())
True
"""

from __future__ import annotations

import numpy as np

from xmesh_plan.schemas.geometry import Region, region_shape

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _hashed_index(region: Region, tensor_shape: tuple[int, ...]) -> np.ndarray:
    index = np.zeros(region_shape(region), np.uint64)
    stride = 1
    for d in reversed(range(len(tensor_shape))):
        lo, hi = region[d]
        axis = [1] * len(tensor_shape)
        axis[d] = hi - lo
        index += (np.arange(lo, hi, dtype=np.uint64) * np.uint64(stride)).reshape(axis)
        stride *= tensor_shape[d]
    mixed = (index + np.uint64(1)) * _GOLDEN
    return mixed ^ (mixed >> np.uint64(31))


def fill(region: Region, tensor_shape: tuple[int, ...], dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """The pattern's values for `region`, as a C-contiguous array of `dtype` (itemsize 1, 2, 4, 8 or 16).

    A non-zero `salt` XORs every byte with `salt % 256`, so successive iterations can move different bits.
    """
    hashed = _hashed_index(region, tensor_shape)
    if dtype.itemsize == 16:
        pair = np.stack([hashed, hashed ^ _GOLDEN], axis=-1)
        array = np.ascontiguousarray(pair).view(dtype).reshape(hashed.shape)
    else:
        array = hashed.astype(_RAW[dtype.itemsize]).view(dtype)
    if salt % 256:
        array.reshape(-1).view(np.uint8)[:] ^= np.uint8(salt % 256)
    return array


def tensor_salt(index: int) -> int:
    """The pattern salt of tensor `index` of a multi-tensor plan (1..255, never 0), so that tensors of
    one shape hold different bits and a shard delivered to the wrong tensor is caught."""
    return index % 255 + 1


def mismatches(shard: np.ndarray, region: Region, tensor_shape: tuple[int, ...], salt: int = 0) -> tuple[int, tuple[int, ...] | None]:
    """(number of elements of `shard` whose bits differ from the pattern with `salt`, global index of the first)."""
    want = fill(region, tensor_shape, shard.dtype, salt)
    raw = np.dtype(f"V{shard.dtype.itemsize}")
    bad = shard.view(raw) != want.view(raw)
    if not bad.any():
        return 0, None
    first = np.argwhere(bad)[0]
    return int(bad.sum()), tuple(int(i) + lo for i, (lo, _) in zip(first, region))
