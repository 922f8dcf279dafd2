"""The sender's conversion (`schemas.convert`) on host numpy arrays, for the MPI engine: the same scales and the same
bits as `executor.convert` makes with torch, FP8 and bfloat16 through `ml_dtypes` (numpy has neither type).

The arithmetic is `executor.convert`'s step for step in float32: scales are amax(|x|) (at least `MIN_AMAX`) over the
FP8 type's largest value, per 128x128 block or per tensor; a value is x / scale clamped to the FP8 range, then rounded
to the nearest FP8 value; other conversions round to the nearest value of the destination type. IEEE float32
division, clamping and rounding give the same bits on either library: every element that is not a NaN has the bits of
torch's `.to()`, and a NaN arrives as a NaN, quiet, of unspecified sign and payload (torch's own NaN bits differ
between its vectorised loop and its tail; `NAN_BITS` writes quiet NaNs, most as torch's vectorised loop does).
tests/test_convert_host.py compares with torch on random values, random bit patterns, subnormals, infinities, NaNs
and negative zeros.

>>> import numpy as np
>>> x = np.array([[1.0, -448.0], [2.0, 896.0]], np.float32)
>>> out = np.empty((2, 2), np.uint8)
>>> convert_shard(out, x, "float8_e4m3fn", "tensor", np.array([2.0], np.float32))
>>> out.view(host_dtype("float8_e4m3fn")).astype(np.float32).tolist()
[[0.5, -224.0], [1.0, 448.0]]
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from xmesh_plan.schemas import convert as schemas_convert
from xmesh_plan.schemas.convert import BLOCK, FP8_MAX

from .errors import BackendUnavailableError

MIN_AMAX = np.float32(schemas_convert.MIN_AMAX)  # as float32, the arithmetic's type
_ML_DTYPES = ("bfloat16", *FP8_MAX)


def host_dtype(name: str) -> np.dtype:
    """The numpy dtype of a plan dtype name, bfloat16 and FP8 from `ml_dtypes`."""
    if name not in _ML_DTYPES:
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise BackendUnavailableError(f"converting to or from {name} on the mpi backend needs ml_dtypes; pip install "
                                      "ml_dtypes (or xmesh-plan[mpi])") from None
    return np.dtype(getattr(ml_dtypes, name))


def _sign16(bits32: np.ndarray) -> np.ndarray:
    return (bits32 >> 16).astype(np.uint16) & np.uint16(0x8000)


NAN_BITS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    # the NaN written for a float32 NaN (its bits in, the destination's bits out), always quiet: FP8 keeps the sign with
    # every other bit set and bfloat16 is all ones whatever the sign (from float16 it is 0x7FC0: `HALF_TO_BF16_NAN`),
    # as torch's vectorised CPU casts write them; float16 and float32 keep the sign and the top payload bits, quieted
    # (numpy and ml_dtypes alone would widen a float16 or bfloat16 signalling NaN to a signalling float32 one)
    "float8_e4m3fn": lambda b: ((b >> 24).astype(np.uint8) & np.uint8(0x80)) | np.uint8(0x7F),
    "float8_e5m2": lambda b: ((b >> 24).astype(np.uint8) & np.uint8(0x80)) | np.uint8(0x7F),
    "bfloat16": lambda b: np.full(b.shape, 0xFFFF, np.uint16),
    "float16": lambda b: _sign16(b) | np.uint16(0x7E00) | ((b & np.uint32(0x7FFFFF)) >> 13).astype(np.uint16),
    "float32": lambda b: b | np.uint32(0x400000),
}
HALF_TO_BF16_NAN = 0x7FC0  # torch casts float16 to bfloat16 element by element, not through its float32 kernel


def _bits(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{8 * dtype.itemsize}")


def cast(out: np.ndarray, values: np.ndarray, dst_dtype: str) -> None:
    """Write `values` (typed) rounded to `dst_dtype` into `out` (raw or typed, of `values`' shape), as torch's `.to()`
    rounds: float64 through float32 first (torch rounds twice too), every NaN quiet (`NAN_BITS`)."""
    target = host_dtype(dst_dtype)
    half = values.dtype == np.float16
    with np.errstate(over="ignore", invalid="ignore"):
        if values.dtype == np.float64 and target != values.dtype:
            values = values.astype(np.float32)
        out.view(target)[...] = values
        nans = np.isnan(values)  # a signalling NaN makes numpy warn here too
    if dst_dtype in NAN_BITS and nans.any():
        raw = out.view(_bits(target))
        if half and dst_dtype == "bfloat16":
            raw[nans] = HALF_TO_BF16_NAN
        else:
            raw[nans] = NAN_BITS[dst_dtype](values[nans].astype(np.float32).view(np.uint32))


def amax(shard: np.ndarray) -> np.ndarray:
    """The largest magnitude in a source shard as float32, shape () (0 for an empty one)."""
    if not shard.size:
        return np.zeros((), np.float32)
    wide = shard if shard.dtype.itemsize >= 4 else shard.astype(np.float32)  # 16-bit floats widen exactly
    return np.asarray(np.abs(wide).max(), np.float32)


def tensor_scale(amax_over_sources: np.ndarray, fp8: str) -> np.ndarray:
    """The per-tensor scale, shape (1,), float32: the tensor's largest magnitude over the FP8 type's largest value."""
    return (np.maximum(np.asarray(amax_over_sources, np.float32), MIN_AMAX) / np.float32(FP8_MAX[fp8])).reshape(1)


def block_scales(shard: np.ndarray, fp8: str) -> np.ndarray:
    """One float32 scale per 128x128 block of a source shard lying on block bounds (its last blocks may be short):
    amax(|block|) over the FP8 type's largest value. Blocks are of the last two dims, one set for each index of the
    others (stacked experts [E, I, H]: scales [E, ceil(I/128), ceil(H/128)])."""
    *lead, rows, cols = shard.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = np.zeros((*lead, br * BLOCK, bc * BLOCK), np.float32)
    padded[..., :rows, :cols] = np.abs(shard.astype(np.float32, copy=False))
    blocks = padded.reshape(*lead, br, BLOCK, bc, BLOCK).max(axis=(-3, -1))
    return np.maximum(blocks, MIN_AMAX) / np.float32(FP8_MAX[fp8])


def put(target: np.ndarray, values: np.ndarray) -> None:
    """Write `values` (as many elements) into `target` in its shape: scales into a scale tensor's source shard."""
    target[...] = values.reshape(target.shape)


def convert_shard(out: np.ndarray, shard: np.ndarray, dst_dtype: str, scale: str | None, scales: np.ndarray | None) -> None:
    """Write `shard` (typed) converted into `out` (its shape, raw or of `dst_dtype`): a plain cast, or for FP8 x / its
    scale (`scale`: "block", the shard's own `block_scales`; "tensor", one) clamped to the FP8 range, then cast."""
    if dst_dtype not in FP8_MAX:
        cast(out, shard, dst_dtype)
        return
    each = scales
    if scale == "block":  # each element with its block's scale
        each = np.repeat(np.repeat(scales, BLOCK, -2)[..., :shard.shape[-2], :], BLOCK, -1)[..., :shard.shape[-1]]
    limit = np.float32(FP8_MAX[dst_dtype])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        values = shard.astype(np.float32) / each
    np.clip(values, -limit, limit, out=values)
    cast(out, values, dst_dtype)
