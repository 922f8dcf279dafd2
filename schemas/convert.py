"""Conversion at the sender: a destination dtype other than the source's, so fewer bytes cross.

A tensor of a `TransferProblem` may give `dst_dtype` (float16, bfloat16, float32, or FP8 `float8_e4m3fn` /
`float8_e5m2`); every sender casts what it sends (and what it copies locally), so messages carry the converted
bytes, and the plan's bound and prediction count those. An FP8 destination needs scales (`scale`):
- `tensor`: one float32 scale, amax(|tensor|) / FP8 max, which the source devices agree on (a max over their
  shards) before they send;
- `block`: one float32 scale per 128x128 block of a 2-d tensor, amax(|block|) / FP8 max, which the source
  device holding the block computes alone: every source box must lie on block bounds. A tensor of more dims
  (stacked experts [E, I, H]) has 128x128 blocks of its last two dims for each index of the others, so its
  scales are [E, ceil(I/128), ceil(H/128)] (DeepSeek-V3's and vLLM's `weight_scale_inv` of stacked experts).
The scales are delivered as a tensor of the plan of their own, `<name>.scale` (`scale_of` names the tensor),
float32, each source device holding the scales it computes, each destination device the scales of every
block its box touches (`scale_tensor` makes it; the problem checks that a scale tensor is exactly that).
A fused FP8 destination (`schemas.fused`) takes block scales only: its parts' scale tensors are fused in turn
into `<fused>.scale` (`fused_block_scales`), which needs its parts on block bounds.
The element conversion: x -> float(x) / scale, clamped to +-FP8 max, rounded to the nearest FP8 value
(`executor.convert`); other conversions round to the nearest value of the destination type.

>>> scale_shape((300, 128), "block"), scale_shape((300, 128), "tensor"), scale_shape((8, 300, 128), "block")
((3, 1), (1,), (8, 3, 1))
>>> block_box(((128, 300), (0, 128))), block_box(((2, 4), (128, 300), (0, 128)))
(((1, 3), (0, 1)), ((2, 4), (1, 3), (0, 1)))
"""

from __future__ import annotations

from .boxes import made_boxes
from .geometry import Region

BLOCK = 128
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
MIN_AMAX = 1e-12  # an all-zero block still gets a finite, non-zero scale (every engine alike)
FLOATS = ("float16", "bfloat16", "float32", "float64")
CONVERTIBLE_TO = ("float16", "bfloat16", "float32", *FP8_MAX)
SCALE_KINDS = ("tensor", "block")
SCALE_SUFFIX = ".scale"


def check_cast(dtype: str, dst_dtype: str) -> None:
    """ValueError naming dst_dtype unless the senders can convert `dtype` to `dst_dtype`."""
    if dtype not in FLOATS or dst_dtype not in CONVERTIBLE_TO:
        raise ValueError(f"dst_dtype: {dtype} -> {dst_dtype} is not a conversion made at the sender; convert a floating "
                         f"type ({', '.join(FLOATS)}) to one of {', '.join(CONVERTIBLE_TO)}")


def check_conversion(dtype: str, dst_dtype: str | None, scale: str | None, ndim: int) -> None:
    """ValueError naming the field and the fix unless `dtype` -> `dst_dtype` with `scale` is a conversion we make."""
    if dst_dtype is None:
        if scale is not None:
            raise ValueError(f"scale: {scale!r} without dst_dtype; scales belong to an FP8 destination (dst_dtype = \"float8_e4m3fn\")")
        return
    check_cast(dtype, dst_dtype)
    if dst_dtype in FP8_MAX and scale not in SCALE_KINDS:
        raise ValueError(f"scale: an FP8 destination ({dst_dtype}) needs scales; give scale = \"tensor\" or \"block\" (128x128)")
    if dst_dtype not in FP8_MAX and scale is not None:
        raise ValueError(f"scale: {dst_dtype} takes no scales; drop scale (it is for FP8 destinations)")
    if scale == "block" and ndim < 2:
        raise ValueError(f"scale: block scales are for tensors of 2 dims or more (128x128 blocks of the last two), this one "
                         f"has {ndim}; use scale = \"tensor\"")


def block_sizes(ndim: int) -> tuple[int, ...]:
    """The extent of a scale block in each dim of a tensor of `ndim` dims: 128 in the last two, 1 in the others."""
    return (1,) * (ndim - 2) + (BLOCK, BLOCK)


def scale_shape(shape: tuple[int, ...], scale: str) -> tuple[int, ...]:
    """The shape of a tensor's scales: (1,) per tensor, one per 128x128 block (ceil) per block."""
    return (1,) if scale == "tensor" else tuple(-(-n // b) for n, b in zip(shape, block_sizes(len(shape))))


def block_box(box: Region) -> Region:
    """The blocks a box touches, as a box of the scale tensor (empty for an empty box)."""
    if any(b <= a for a, b in box):
        return tuple((0, 0) for _ in box)
    return tuple((a // size, -(-b // size)) for (a, b), size in zip(box, block_sizes(len(box))))


def on_block_bounds(box: Region, shape: tuple[int, ...]) -> bool:
    """Whether a box starts on a block bound in every dim and ends on one or at the tensor's end (or is empty)."""
    return any(b <= a for a, b in box) or all(a % size == 0 and (b % size == 0 or b == n)
                                              for (a, b), n, size in zip(box, shape, block_sizes(len(shape))))


def scale_boxes(shape: tuple[int, ...], scale: str, blocks: dict[int, Region], devices: tuple[int, ...], side: str) -> tuple[Region, ...]:
    """Each device's box of the scale tensor on `side`: per tensor, the one scale wherever the device holds part of
    the tensor; per block, the blocks its box touches (a source box must lie on block bounds: ValueError naming it). Kept
    as made (`boxes.made_boxes`): the scale tensor made of them does not validate them box by box again."""
    if scale == "tensor":  # each distinct box once: a mesh's devices repeat a few boxes
        seen: dict[Region, Region] = {}
        for box in map(blocks.__getitem__, devices):
            if box not in seen:
                seen[box] = ((0, 0),) if any(b <= a for a, b in box) else ((0, 1),)
        return made_boxes(tuple(seen[blocks[device]] for device in devices))
    out, seen = [], {}
    for device in devices:
        box = blocks[device]
        scaled = seen.get(box)
        if scaled is None:  # each distinct box once, its first device named when it is off the block bounds
            if side == "src" and not on_block_bounds(box, shape):
                from .plan import format_region  # plan imports this module's users

                raise ValueError(f"source device {device} holds {format_region(box)}, not whole 128x128 blocks; block scales need "
                                 "every source box on block bounds: use scale = \"tensor\" or a source layout on multiples of 128")
            scaled = seen[box] = block_box(box)
        out.append(scaled)
    return made_boxes(tuple(out))


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def fused_block_scales(fused, shapes: dict[str, tuple[int, ...]], mesh):
    """The fused tensor of block scales an FP8 fused tensor's destinations keep (`schemas.fused`): its parts' scale
    tensors, each range counted in blocks, each destination device holding the scales of the blocks its fused box
    touches. ValueError naming the part unless every part lies on block bounds in its tensor and in the fused
    tensor (each range starts on a bound and ends on one or at its tensor's end; every part but the last is a
    whole number of blocks long), so that each fused block is one block of one part."""
    from .fused import FusedTensor  # fused imports problem, which imports this module

    lengths = fused.lengths(shapes)
    parts = []
    for k, ((name, span), length) in enumerate(zip(fused.refs(), lengths)):
        full, size = shapes[name][fused.dim], block_sizes(len(shapes[name]))[fused.dim]  # size 1: stacked experts' dim
        start, stop = span or (0, full)
        if start % size or (stop % size and stop != full) or (k < len(lengths) - 1 and length % size):
            raise ValueError(f"parts[{k}]: {fused.parts[k]!r} is not whole 128-blocks of {name!r} along dim {fused.dim}, so "
                             "block scales of the fused tensor would mix parts; give parts on multiples of 128 (the last may "
                             "end with its tensor), or convert to float16/bfloat16")
        parts.append(scale_name(name) if span is None else f"{scale_name(name)}[{start // size}:{-(-stop // size)}]")
    blocks = fused.blocks(shapes, mesh)
    return FusedTensor(name=scale_name(fused.name), parts=tuple(parts), dim=fused.dim,
                       dst_boxes=tuple(block_box(blocks[d]) for d in mesh.devices))
