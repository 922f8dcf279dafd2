"""Which tensors of a plan a device converts at the sender, and how (`schemas.convert`): plain data for the lowering,
read by the engines that convert (`engines.EngineEntry.converts`); the arithmetic is `executor.convert`'s.

A converting tensor's messages, staging and destination shards are in its destination dtype (the lowering sizes
them with `ReshardingProblem.itemsize`); only the caller's source shard is in the source dtype. An engine that
converts casts each source shard once per run into a shard of the destination dtype (`Conversion`) before any
step reads it, and every step that reads the source shard reads that one instead. A plan's scale tensor
`<t>.scale` has no caller's shard: its source shard on each sender is the scales that sender computed for t.

>>> from xmesh_plan.planner.compile import compile_plan
>>> from xmesh_plan.planner.transfer_io import build_transfer
>>> plan = compile_plan(build_transfer({"src_mesh": {"shape": [2], "devices": [0, 1]}, "dst_mesh": {"shape": [1], "devices": [2]},
...     "tensors": [{"name": "w", "shape": [4, 4], "src": "S0 R", "dst": "R R", "dst_dtype": "fp8", "scale": "tensor"}]}))
>>> conversions(plan.problem, 0)
[Conversion(dst_dtype='float8_e4m3fn', scale='tensor', scales=1, peers=(1,)), None]
>>> scale_owners(plan.problem)
[None, 0]
>>> from xmesh_plan.executor.lower import lower
>>> cast_tensors(lower(plan, 1)), cast_tensors(lower(plan, 2))
([0, 1], [])
"""

from __future__ import annotations

from dataclasses import dataclass

from xmesh_plan.schemas.convert import scale_name


@dataclass(frozen=True, slots=True)
class Conversion:
    """What a sender does to its source shard of one tensor: cast it to `dst_dtype`, for FP8 divided by its `scale`s
    ("tensor": one, the max over every source device's amax; "block": one per 128x128 block, its own), which are
    the source shard of the plan's tensor `scales` on this device; `peers`: the other source devices holding part
    of the tensor, whose amax a per-tensor scale takes (empty otherwise)."""

    dst_dtype: str
    scale: str | None = None
    scales: int | None = None
    peers: tuple[int, ...] = ()


def _nonempty(region) -> bool:
    return all(b > a for a, b in region)


def conversions(problem, device: int) -> list[Conversion | None]:
    """Per tensor of a plan's `problem`, how `device` converts it at the sender (None: no conversion, also where
    `dst_dtype` is the source's own dtype: the bytes move as they are)."""
    tensors = getattr(problem, "tensors", None)
    if tensors is None:  # a one-tensor problem: plain casts only (its files refuse FP8, which needs scale tensors)
        return [None if problem.dst_dtype in (None, problem.dtype) else Conversion(problem.dst_dtype)]
    out: list[Conversion | None] = []
    index = _index(problem)
    peers_of: dict[tuple | int, tuple[int, ...]] = {}  # (shape, source spec) -> peers: the same for tensors laid out alike
    for t, tensor in enumerate(tensors):
        if tensor.dst_dtype in (None, tensor.dtype) and tensor.scale is None:
            out.append(None)
            continue
        scales = index(scale_name(tensor.name)) if tensor.scale is not None else None
        peers: tuple[int, ...] = ()
        if tensor.scale == "tensor":  # the senders that swap their amax with this one, when it holds a part
            key = (tuple(tensor.shape), tensor.src) if tensor.src_boxes is None else t  # boxes given: its own
            if key not in peers_of:
                src = problem.tensor_problem(t).blocks("src")
                held = device in src and _nonempty(src[device])
                peers_of[key] = tuple(d for d, box in src.items() if d != device and _nonempty(box)) if held else ()
            peers = peers_of[key]
        out.append(Conversion(tensor.dst_dtype, tensor.scale, scales, peers))
    return out


def _index(problem):
    """`problem.index_of`, through a dict of the tensors' names (made once: a model has thousands of tensors)."""
    where: dict[str, int] = {}
    for i, tensor in enumerate(problem.tensors):
        where.setdefault(tensor.name, i)
    return lambda name: where[name] if name in where else problem.index_of(name)


def scale_owners(problem) -> list[int | None]:
    """Per tensor of a plan's `problem`, the tensor whose scales it carries (its senders compute its source shards), or None."""
    tensors = getattr(problem, "tensors", None)
    if tensors is None:
        return [None]
    index = _index(problem)
    return [None if t.scale_of is None else index(t.scale_of) for t in tensors]


def cast_tensors(program) -> list[int]:
    """The tensors of a `RankProgram` whose source shard on its device the engine makes itself: each converting tensor
    (the cast shard) and each scale tensor (the scales it computes) of which the device holds a nonempty box."""
    return [t for t, shards in enumerate(program.tensors)
            if (shards.convert is not None or shards.scale_of is not None) and shards.src_block is not None
            and _nonempty(shards.src_block)]


def sender_buffers(program, allocate, reads) -> tuple[dict, list, dict]:
    """What every converting engine makes for a `RankProgram`: `made`, per tensor of `cast_tensors`, a buffer from
    `allocate(t)` (its cast shard, or a scale tensor's scales); `converting`, (tensor, `Conversion`, its cast shard, or
    None where `reads(t)` says this device sends none of it) per converting tensor; and `scale_shards`, per scale tensor
    of a converting one, its buffer (None where this device holds no box of it)."""
    made = {t: allocate(t) for t in cast_tensors(program)}
    converting = [(t, program.tensors[t].convert, made[t] if reads(t) else None)
                  for t in made if program.tensors[t].convert is not None]
    return made, converting, {c.scales: made.get(c.scales) for _, c, _ in converting if c.scales is not None}


def mark_casts(casts_before: list, converting, readers: dict) -> None:
    """Per step, the converting tensors (indices into `converting`) to cast before it: every step in `readers` of a
    converting tensor's cast shard or of its scales casts it first (`casts_before[i]` a tuple, or None)."""
    for k, (t, c, _) in enumerate(converting):
        for i in readers.get(t, []) + readers.get(c.scales, []):
            casts_before[i] = (casts_before[i] or ()) + (k,)


def swap_peers(converting) -> list[tuple[int, list[int]]]:
    """Per peer device, ascending, the tensors whose per-tensor amax this device swaps with it, in tensor order;
    `converting`: (tensor, `Conversion`, ...) rows."""
    peers: dict[int, list[int]] = {}
    for t, conversion, *_ in converting:
        for peer in conversion.peers:
            peers.setdefault(peer, []).append(t)
    return sorted(peers.items())


def cast_once(engine, ks) -> None:
    """Cast the converting tensors `ks` (indices into `engine.converting`) that `engine` has not cast yet in its run
    `engine.run_count` (marked in `engine.cast_run`), and write their scales: an engine calls it just before the first
    step reading a tensor's cast shard or its scales starts, so each is cast once per run, whole, after the messages
    started before it. A per-tensor scale takes `engine.amaxes[t]` (the max over its senders) or, where the engine
    holds none, this sender's own amax, taken now."""
    convert, run, cast_run = engine.convert, engine.run_count, engine.cast_run
    for k in ks:
        if cast_run[k] == run:
            continue
        cast_run[k] = run
        t, conversion, buffer = engine.converting[k]
        shard, amax = engine.shards[t], engine.amaxes.get(t)
        if amax is None and conversion.scale == "tensor":
            amax = convert.amax(shard)
        cast_shard(convert, conversion, shard, amax, engine.scale_shards.get(conversion.scales), buffer)


def cast_shard(convert, conversion: Conversion, shard, amax, scale_shard, buffer) -> None:
    """One sender's conversion of one tensor with `convert` (`executor.convert` on torch, `executor.convert_host` on
    numpy): its scales (block scales of `shard`, or the per-tensor scale of `amax`, the max over its senders) into
    `scale_shard` (its scale tensor's source shard here, or None), and `shard` cast into `buffer` (None: this device
    sends none of it)."""
    scales = None
    if conversion.scale == "block":
        scales = convert.block_scales(shard, conversion.dst_dtype)
    elif conversion.scale == "tensor":
        scales = convert.tensor_scale(amax, conversion.dst_dtype)
    if scale_shard is not None:
        convert.put(scale_shard, scales)
    if buffer is not None:
        convert.convert_shard(buffer, shard, conversion.dst_dtype, conversion.scale, scales)
