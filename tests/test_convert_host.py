"""The MPI engine's conversion on numpy (`executor.convert_host`) against torch's own: every bit of every non-NaN
destination element equal to torch's `.to()` (for FP8 after torch divides by the same scales and clamps), and a NaN
exactly where torch writes one, on random values, random bit patterns, subnormals, values beyond the destination's
range, infinities, NaNs of every sign and payload and negative zeros; the scales equal to `executor.convert`'s (the
torch engine's) bit for bit where the data has no NaN. A NaN's own bits are not compared: torch's differ between its
vectorised body and its tail; the host's NaNs are quiet."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xmesh_plan.executor import convert
from xmesh_plan.executor import convert_host as host
from xmesh_plan.schemas.convert import FP8_MAX

SOURCES = ("float32", "float64", "float16", "bfloat16")
TARGETS = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
SPECIAL = [0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1e-40, -3e-39, 2**-9, 2**-10, 3 * 2**-10, 2**-17, 448, 449, 464, 465, 480,
           -480, 57344, 61440, 65504, 65520, -65520, 1e30, -1e30, 1 + 2**-8, 1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40]
NAN_BITS32 = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000, 0xFFA12345]
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def source(dtype: str, n: int, seed: int) -> torch.Tensor:
    """`n` values of every kind in `dtype` (torch): specials, NaNs, normal values over 24 decades, random bit patterns."""
    rng = np.random.default_rng(seed)
    nans = torch.from_numpy(np.array(NAN_BITS32, np.uint32).view(np.float32))
    normal = torch.from_numpy(rng.standard_normal(n) * 10.0 ** rng.integers(-12, 12, n))
    patterns = torch.from_numpy(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32))
    parts = [torch.tensor(SPECIAL, dtype=torch.float64), nans.double(), normal, patterns.double()]
    if dtype == "float64":  # values only float64 holds, and its own NaN payloads
        parts += [torch.tensor([1 + 2**-30, 3e-320, -1e300, 1e-300]), torch.tensor([0x7FF0000000000001, -1], dtype=torch.int64).view(torch.float64)]
    x = torch.cat(parts).to(getattr(torch, dtype)) if dtype != "float32" else torch.cat([torch.tensor(SPECIAL), nans, normal.float(), patterns])
    return x[torch.from_numpy(rng.permutation(len(x)))]  # NaNs and specials in the vectorised body and the tail alike


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """The same bits as a numpy array of the host dtype (bfloat16 from ml_dtypes)."""
    return t.view(INTS[t.element_size()]).numpy().view(host.host_dtype(str(t.dtype).removeprefix("torch.")))


def bits(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        array = array.contiguous().view(INTS[array.element_size()]).numpy()
    return array.view(f"uint{8 * array.dtype.itemsize}")


def is_nan(raw: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isnan(raw.view(host.host_dtype(dtype)).astype(np.float32))


def mismatches(out: np.ndarray, want: torch.Tensor, dst: str) -> np.ndarray:
    """Indices where `out` (raw) and torch's `want` differ: a bit of a non-NaN, or a NaN on one side only (a NaN's
    sign and payload are unspecified)."""
    got, expected = bits(out).ravel(), bits(want).ravel()
    return np.flatnonzero((got != expected) & ~(is_nan(got, dst) & is_nan(expected, dst)))


def torch_fp8(x: torch.Tensor, scales: torch.Tensor, dst: str) -> torch.Tensor:
    """Torch's own: x / scale in float32, clamped to the FP8 range, then `.to()`."""
    return (x.float() / scales).clamp(-FP8_MAX[dst], FP8_MAX[dst]).to(getattr(torch, dst))


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in SOURCES for d in TARGETS if d != s and d not in FP8_MAX])
def test_a_plain_cast_has_torchs_bits(src, dst):
    x = source(src, 20000, 1)
    out = np.empty(x.shape, f"uint{8 * host.host_dtype(dst).itemsize}")
    host.convert_shard(out, as_numpy(x), dst, None, None)
    want = x.to(getattr(torch, dst))
    wrong = mismatches(out, want, dst)
    assert not len(wrong), [(float(x[i]), hex(int(bits(want)[i])), hex(int(bits(out)[i]))) for i in wrong[:5]]


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("dst", sorted(FP8_MAX))
@pytest.mark.parametrize("scale", [0.37, 3e-3, 1e-30, 2.0**-126, np.inf])
def test_fp8_with_a_per_tensor_scale_has_torchs_bits(src, dst, scale):
    x = source(src, 20000, 2)
    s = np.array([scale], np.float32)
    out = np.empty(x.shape, np.uint8)
    host.convert_shard(out, as_numpy(x), dst, "tensor", s)
    want = torch_fp8(x, torch.from_numpy(s), dst)
    wrong = mismatches(out, want, dst)
    assert not len(wrong), [(float(x[i]), hex(int(bits(want)[i])), hex(int(out[i]))) for i in wrong[:5]]


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("dst", sorted(FP8_MAX))
def test_fp8_with_block_scales_has_torchs_bits_block_by_block(src, dst):
    """A 300 x 260 shard (short last blocks), one block all zero and one holding NaN: its scales by each library, then
    every element against torch's cast of its block with that block's scale."""
    x = source(src, 300 * 260, 3)[:300 * 260].reshape(300, 260).clone()
    x[~torch.isfinite(x[:, :].double())] = 1.5  # block scales of finite data first
    x[:128, :128] = 0
    x[130, 5] = float("nan")
    x[140, 200] = -0.0
    x[260, 259] = float("-inf")
    xs = as_numpy(x)
    scales = host.block_scales(xs, dst)
    torch_scales = convert.block_scales(x, dst)
    finite = ~np.isnan(scales)
    assert np.array_equal(np.isnan(scales), torch.isnan(torch_scales).numpy())
    assert np.array_equal(bits(scales)[finite], bits(torch_scales)[finite])
    out = np.empty(x.shape, np.uint8)
    host.convert_shard(out, xs, dst, "block", scales)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            box = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            want = torch_fp8(x[box], torch.from_numpy(scales[i:i + 1, j]), dst)
            assert not len(mismatches(np.ascontiguousarray(out[box]), want, dst)), (i, j)


@pytest.mark.parametrize("src", SOURCES)
def test_per_tensor_amax_and_scale_equal_the_torch_engines(src):
    x = source(src, 5000, 4)
    x = x[torch.isfinite(x.double())]
    xs = as_numpy(x)
    assert bits(host.amax(xs)) == bits(convert.amax(x))
    for fp8 in FP8_MAX:
        assert np.array_equal(bits(host.tensor_scale(host.amax(xs), fp8)), bits(convert.tensor_scale(convert.amax(x), fp8)))
    assert host.amax(xs[:0]) == 0 and host.tensor_scale(host.amax(xs[:0]), "float8_e4m3fn")[0] == np.float32(1e-12) / np.float32(448)
    with_nan = xs.copy()
    with_nan[7] = np.nan
    assert np.isnan(host.amax(with_nan)) and np.isnan(host.tensor_scale(host.amax(with_nan), "float8_e4m3fn")[0])


@pytest.mark.parametrize("src", ["float32", "bfloat16"])
def test_block_scales_of_stacked_experts_have_torchs_bits(src):
    """A 3-d shard [E, I, H] has 128x128 blocks of its last two dims per expert: scales and values as the torch engine's."""
    x = source(src, 3 * 200 * 130, 5)[:3 * 200 * 130].reshape(3, 200, 130).clone()
    x[~torch.isfinite(x.double())] = -2.5
    x[1, :128, :128] = 0
    xs = as_numpy(x)
    scales, torch_scales = host.block_scales(xs, "float8_e4m3fn"), convert.block_scales(x, "float8_e4m3fn")
    assert scales.shape == (3, 2, 2) and np.array_equal(bits(scales), bits(torch_scales))
    out, want = np.empty(x.shape, np.uint8), torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    host.convert_shard(out, xs, "float8_e4m3fn", "block", scales)
    convert.convert_shard(want, x, "float8_e4m3fn", "block", torch_scales)
    assert np.array_equal(out, bits(want))


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dst", ["float16", "float32", "float8_e4m3fn"])
def test_a_signalling_nan_casts_without_a_warning(dst):
    """numpy warns (an exception under -W error) on a signalling NaN it tests outside np.errstate; the cast must not."""
    x = np.array([0x7F81, 0x3F80], np.uint16).view(host.host_dtype("bfloat16"))
    out = np.empty(2, host.host_dtype(dst))
    fp8 = dst in FP8_MAX
    host.convert_shard(out, x, dst, "tensor" if fp8 else None, np.array([1.0], np.float32) if fp8 else None)
    assert np.isnan(out[0]) and out[1] == 1.0


NANS = {"float16": [0x7C01, 0xFD00, 0x7D55, 0x7E00], "bfloat16": [0x7F81, 0xFF85, 0x7FC0],  # signalling, then quiet
        "float32": [0x7F800001, 0xFF812345, 0x7FC00000], "float64": [0x7FF0000000000001, 0xFFF0000000000001, 0x7FF8 << 48]}
QUIET_BIT = {"float16": 0x0200, "bfloat16": 0x0040, "float32": 0x00400000}


@pytest.mark.parametrize(("src", "dst"), [(s, d) for s in SOURCES for d in QUIET_BIT if d != s])
def test_every_nan_written_is_quiet(src, dst):
    """Signalling NaNs of each source (short shards and long) arrive as quiet NaNs, as torch writes them."""
    size = host.host_dtype(src).itemsize
    for n in (5, 67):
        x = np.resize(np.array(NANS[src], f"uint{8 * size}"), n).view(host.host_dtype(src))
        out = np.empty(n, f"uint{8 * host.host_dtype(dst).itemsize}")
        host.convert_shard(out, x, dst, None, None)
        assert is_nan(out, dst).all() and (out & QUIET_BIT[dst]).all(), [hex(int(v)) for v in out]
