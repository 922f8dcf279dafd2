"""The MPI + CuPy `nccl` engine's conversion at the sender (`executor.conversions`), on its CUDA stream.

The casts are torch's own (`executor.convert`: `.to()`, and for FP8 x / scale clamped first, the functions the torch
engine runs), so every element has the bits of torch's `.to()`, the reference every engine is tested against: CuPy
has float16 but no bfloat16 or FP8 type, `ml_dtypes`' types are host-only numpy types, and a hand-written rounding
kernel would have to match torch bit for bit where the same torch cast does by construction. torch sees CuPy memory
through DLPack (no copy) and runs with `torch.cuda.ExternalStream` over the engine's stream current (`TorchOnStream`),
so its kernels queue between the NCCL calls like CuPy's copy kernels and nothing waits on the host. Each converting
tensor is cast once, whole, into a buffer of the destination dtype just before the stream's first call of it or of
its scales; its scales go into the scale tensor's source shard. A per-tensor scale's amax is the max over the
tensor's senders: each writes its amax into a float32 buffer that the program's first calls all-reduce
(`nccl_plan.AmaxMax`). Torch is imported only on a device that casts (`requires`).
"""

from __future__ import annotations

import numpy as np

from .arrays import storage_dtype
from .conversions import cast_shard, cast_tensors, sender_buffers
from .errors import BackendUnavailableError
from .lower import RankProgram, StagedCall
from .nccl_plan import AmaxMax, Bcast, Copy

DLPACK_VIEW = {np.dtype(np.uint16): np.dtype(np.int16)}
"""Storage dtypes handed to torch as another of the same size (bfloat16 bits as int16: torch imports int16 from
DLPack in every version, uint16 only in recent ones)."""


def import_torch():
    """torch, or BackendUnavailableError saying what to install (a device that casts needs it)."""
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError("the plan converts at the sender, which the nccl backend does with torch's own casts "
                                      "(bit for bit as the other engines); pip install torch, or compile the plan without "
                                      "dst_dtype") from None
    return torch


def requires(program: RankProgram) -> None:
    """BackendUnavailableError where this device's part of `program` casts (`conversions.cast_tensors`) and torch is
    missing; checked in `prepare()` before the ranks agree, so every rank learns of it before any communicator is
    made. A device that casts nothing (it only receives converted bytes) needs no torch."""
    if cast_tensors(program):
        import_torch()


class TorchOnStream:
    """torch's ops on the engine's CuPy stream: `run(fn)` calls `fn` with that stream current in torch (its kernels
    queue behind the calls enqueued before, ahead of those after), and `tensor()` is a CuPy array as a torch tensor
    of a plan dtype, through DLPack, without a copy."""

    def __init__(self, stream, gpu: int):
        self.torch = torch = import_torch()
        self.stream = torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", gpu))

    def tensor(self, array, dtype_name: str):
        raw = self.torch.from_dlpack(array.view(DLPACK_VIEW.get(array.dtype, array.dtype)))
        return raw.view(getattr(self.torch, dtype_name))

    def run(self, fn) -> None:
        with self.torch.cuda.stream(self.stream):
            fn()


def torch_on_stream(stream, gpu: int) -> TorchOnStream:
    """How the engine runs torch on its stream (tests put a fake CuPy's in its place)."""
    return TorchOnStream(stream, gpu)


class StreamCasts:
    """One device's conversion at the sender, enqueued on the engine's stream: the buffers the calls read instead of the
    caller's source shards (`made`: cast shards and scales), the amax buffers of per-tensor scales (`amax_at`: one
    per all-reduce, or per tensor of a single sender), and the casts to enqueue before each call (`before`)."""

    def __init__(self, program: RankProgram, actions, call_tensors: list[int | None], cupy, stream, gpu: int):
        self.on_stream = torch_on_stream(stream, gpu)  # first: it names what to install when torch is missing
        from . import convert  # torch's casts, imported only for a converting plan

        self.convert, self.tensors = convert, program.tensors
        reads = {t for call, t in zip(actions, call_tensors) if _reads_src(call)}
        self.made, self.converting, self.scale_shards = sender_buffers(
            program, lambda t: cupy.empty(program.tensors[t].src_shape, storage_dtype(program.tensors[t].dst_dtype)),
            reads.__contains__)
        self.amax_at: dict[int, tuple] = {}  # tensor -> (amax buffer, index in it)
        for call in actions:
            if isinstance(call, AmaxMax):
                buffer = cupy.empty(len(call.tensors), np.float32)
                self.amax_at.update({t: (buffer, k) for k, t in enumerate(call.tensors)})
        for t, c, _ in self.converting:
            if c.scale == "tensor" and t not in self.amax_at:
                self.amax_at[t] = (cupy.empty(1, np.float32), 0)
        self.before: list[tuple[int, ...]] = [()] * len(actions)
        for k, (t, c, _) in enumerate(self.converting):  # before the first call of the tensor or of its scales
            first = next((i for i, u in enumerate(call_tensors) if u is not None and u in (t, c.scales)), None)
            if first is not None:
                self.before[first] += (k,)

    def amaxes(self, srcs) -> None:
        """Enqueue each per-tensor scaled tensor's amax of its source shard in `srcs` into its buffer
        (`executor.convert.amax`); the all-reduces follow as the program's first calls."""
        convert, on, tensors = self.convert, self.on_stream, self.tensors
        scaled = [(t, srcs[t]) for t, c, _ in self.converting if c.scale == "tensor"]

        def write() -> None:
            for t, shard in scaled:
                buffer, k = self.amax_at[t]
                on.tensor(buffer, "float32")[k].copy_(convert.amax(on.tensor(shard, tensors[t].dtype)))
        if scaled:
            on.run(write)

    def cast(self, ks: tuple[int, ...], srcs) -> None:
        """Enqueue the conversion of the converting tensors `ks` (indices into `converting`) from their source shards in
        `srcs`: their scales into the scale tensors' source shards and each shard cast whole into its buffer
        (`conversions.cast_shard`, torch's casts)."""
        convert, on, tensors = self.convert, self.on_stream, self.tensors
        jobs = [(self.converting[k], srcs[self.converting[k][0]]) for k in ks]

        def cast() -> None:
            for (t, conversion, buffer), shard in jobs:
                amax = None
                if t in self.amax_at:
                    amax_buffer, k = self.amax_at[t]
                    amax = on.tensor(amax_buffer, "float32")[k]
                scale_shard = self.scale_shards.get(conversion.scales)
                cast_shard(convert, conversion, on.tensor(shard, tensors[t].dtype), amax,
                           None if scale_shard is None else on.tensor(scale_shard, "float32"),
                           None if buffer is None else on.tensor(buffer, conversion.dst_dtype))
        on.run(cast)


def _reads_src(call) -> bool:
    """Whether an NCCL call reads its tensor's source shard: a local copy, a broadcast from its root's source shard, a
    bundle's pack of a source box."""
    if isinstance(call, Copy):
        return True
    if isinstance(call, Bcast):
        return call.is_root and call.box.side == "src"
    return isinstance(call, StagedCall) and call.action == "pack" and call.box.side == "src"
