"""The sender's conversion (`schemas.convert`) as array functions: scales from a source shard, and a shard or box cast
to the destination dtype with them, on torch tensors (numpy has no FP8), on whatever device the shard is.

The torch engine (`engines.EngineEntry.converts`; the MPI engine does the same on numpy, `executor.convert_host`) does,
once per run, before any step reads the cast, for each tensor t it holds a source shard of (`conversions.Conversion`): `block_scales` of its shard
(per block: the shard lies on block bounds, so its blocks are whole), or `tensor_scale` of the max of `amax` over
every source device of t (per tensor: the senders swap their amax, so each computes the same scale); then
`convert_shard` casts the whole shard into a buffer of the destination dtype, which every step that reads the
source shard (a send, a broadcast's first hop, a bundle's gather, a local copy) reads instead. What is forwarded
out of destination shards is converted already. The scales themselves travel as the plan's tensor `<t>.scale`,
whose source shard on that device is exactly these scales. Converting the whole shard once is one pass over it
whatever the number of boxes it is cut into (a device of a replicated source also converts elements it does not send).

>>> import torch
>>> x = torch.tensor([[1.0, -448.0], [2.0, 896.0]])
>>> convert(x, "float8_e4m3fn", torch.full((2, 2), 2.0)).float().tolist()
[[0.5, -224.0], [1.0, 448.0]]
"""

from __future__ import annotations

import functools

import torch

from xmesh_plan.schemas.convert import BLOCK, FP8_MAX, MIN_AMAX, block_sizes
from xmesh_plan.schemas.geometry import Region



def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def amax(shard: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in a source shard, as float32 (0 for an empty one); senders take the max over theirs."""
    return shard.abs().max().float() if shard.numel() else torch.zeros((), dtype=torch.float32)


def tensor_scale(amax_over_sources: torch.Tensor, fp8: str) -> torch.Tensor:
    """The per-tensor scale, shape (1,): the tensor's largest magnitude over the FP8 type's largest value."""
    return over_fp8_max(amax_over_sources.float().clamp(min=MIN_AMAX), fp8).reshape(1)


def block_scales(shard: torch.Tensor, fp8: str) -> torch.Tensor:
    """One float32 scale per 128x128 block of a source shard that lies on block bounds (its last blocks may be short,
    as the tensor's are): amax(|block|) over the FP8 type's largest value. Blocks are of the last two dims, one set
    for each index of the others (stacked experts [E, I, H]: scales [E, ceil(I/128), ceil(H/128)])."""
    *lead, rows, cols = shard.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros((*lead, br * BLOCK, bc * BLOCK), dtype=torch.float32, device=shard.device)
    padded[..., :rows, :cols] = shard.float().abs()
    blocks = padded.reshape(*lead, br, BLOCK, bc, BLOCK).amax(dim=(-3, -1))
    return over_fp8_max(blocks.clamp(min=MIN_AMAX), fp8)


def over_fp8_max(amaxes: torch.Tensor, fp8: str) -> torch.Tensor:
    """`amaxes` / the FP8 type's largest value, correctly rounded on every device: the divisor is a tensor on their
    device, since CUDA divides by a Python number as a multiply by its reciprocal, which is not always the float32
    quotient (one unit off in the last place for some amaxes), and every engine's scales must be bit for bit alike."""
    return amaxes / _fp8_max_on(fp8, amaxes.device)


@functools.lru_cache(maxsize=None)
def _fp8_max_on(fp8: str, device: torch.device) -> torch.Tensor:
    """The FP8 type's largest value as a float32 tensor on `device`, made once per device (not a copy per run)."""
    return torch.tensor(FP8_MAX[fp8], dtype=torch.float32, device=device)


def expand_scales(scales: torch.Tensor, box: Region, origin: tuple[int, ...] | None = None) -> torch.Tensor:
    """Each element of `box` (global coordinates) with its block's scale; `scales` holds the blocks from block
    `origin` on (a source shard's own scales start at its first block; default: block 0 in every dim)."""
    sizes = block_sizes(len(box))
    index = [torch.arange(a, b, device=scales.device) // size - o for (a, b), size, o in zip(box, sizes, origin or (0,) * len(box))]
    return scales[torch.meshgrid(*index, indexing="ij")]


def convert(values: torch.Tensor, dst_dtype: str, scales: torch.Tensor | None = None) -> torch.Tensor:
    """`values` in `dst_dtype`: a plain cast (round to nearest), or for FP8 x / scale (elementwise, `scales` of
    `values`' shape or one per tensor) clamped to the FP8 range, then cast."""
    target = torch_dtype(dst_dtype)
    if dst_dtype not in FP8_MAX:
        return values.to(target)
    limit = FP8_MAX[dst_dtype]
    return (values.float() / scales).clamp(-limit, limit).to(target)


def shard_block_scales(scales: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element of a shard of `shape` lying on block bounds with its block's scale (`scales`: the shard's own)."""
    return scales.repeat_interleave(BLOCK, -2)[..., :shape[-2], :].repeat_interleave(BLOCK, -1)[..., :shape[-1]]


def put(target: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` (as many elements) into `target` in its shape: scales into a scale tensor's source shard."""
    target.copy_(values.reshape(target.shape))


def convert_shard(out: torch.Tensor, shard: torch.Tensor, dst_dtype: str, scale: str | None, scales: torch.Tensor | None) -> None:
    """Write `shard` converted to `out` (of `dst_dtype`, the shard's shape): `convert` with the scales of `scale`
    kind ("block": the shard's own `block_scales`; "tensor": one), elementwise the same values."""
    if dst_dtype not in FP8_MAX:
        out.copy_(shard)  # the cast `.to()` makes
        return
    each = shard_block_scales(scales, tuple(shard.shape)) if scale == "block" else scales
    limit = FP8_MAX[dst_dtype]
    out.copy_((shard.float() / each).clamp_(-limit, limit))
