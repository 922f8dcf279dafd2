"""The destination shards a torch engine's steps write: its own, or the caller's tensors written in place.

A caller may pass, per call, the tensor each destination shard belongs in (`TransferExecutor.run(shards, into=...)`):
an inference engine's parameter, or a view into a fused one (a slice of `qkv_proj.weight`). The steps are then bound
to that tensor for the one reshard. A message's bytes are a run of the shard in C order (`lower.Box.span`); where
that run is one run of the tensor's memory too (a contiguous tensor, or a row of a strided view) the message is
received straight into it (or sent from it). Otherwise it lands in a shadow buffer the size of the message, unpacked
into the tensor once it has arrived (`after`), and a send out of such a run is packed from the tensor first (`before`),
except a relay forwarding what it has just received there. Shadows are kept across calls, keyed by their bytes, so a
strided destination allocates them once; the views of the caller's tensor are dropped when the reshard ends
(`TorchEngine._release`), so the engine keeps no reference to it.
"""

from __future__ import annotations

from .lower import Action, flat_pieces


class Destinations:
    """Per tensor, the destination shard a torch engine's steps are bound to (`typed`; `flat`, its bytes when it is
    contiguous), which of them are the caller's (`callers`), and the shadow buffers and copies of the messages whose
    bytes are not one run of the caller's tensor (`span`)."""

    def __init__(self, tensors: int):
        self.typed: list = [None] * tensors
        self.flat: list = [None] * tensors
        self.callers: set[int] = set()
        self.own_bound = False  # every tensor's steps are bound to the engine's own shards: a call passing none rebinds nothing
        self.shadows: dict[tuple[int, int, int], object] = {}  # (tensor, start, stop) -> uint8 buffer
        self.after: dict[int, list] = {}  # receive step -> (piece of the caller's tensor, its bytes in the shadow), to copy once arrived
        self.before: dict[int, list] = {}  # send step -> (shadow bytes, piece of the caller's tensor), to copy before posting

    def bind(self, t: int, typed, caller: bool) -> None:
        """Tensor t's steps write `typed` (the caller's tensor when `caller`, else the engine's own shard)."""
        self.typed[t] = typed
        self.flat[t] = bytes_of(typed) if typed.is_contiguous() else None
        if caller:
            self.callers.add(t)
        else:
            self.callers.discard(t)

    def unbind(self, t: int) -> None:
        self.typed[t] = self.flat[t] = None

    def drop(self, i: int) -> None:
        """Forget step i's copies to and from a shadow."""
        self.after.pop(i, None)
        self.before.pop(i, None)

    def span(self, engine, i: int):
        """The uint8 buffer message step i of `engine` moves its destination bytes through: a view of the bound shard
        when they are one run of its memory, else a shadow, with the copies `after` or `before` it (None: unbound)."""
        s = engine.steps[i]
        data = s.data
        self.drop(i)
        typed = self.typed[data.tensor]
        if typed is None:
            return None
        whole = self.flat[data.tensor]
        if whole is not None:
            return whole[data.start:data.stop]
        size = typed.element_size()
        pieces = [typed[tuple(slice(a, b) for a, b in piece)]
                  for piece in flat_pieces(tuple(typed.shape), data.start // size, data.stop // size)]
        if len(pieces) == 1 and pieces[0].is_contiguous():
            return bytes_of(pieces[0])
        key = (data.tensor, data.start, data.stop)
        shadow = self.shadows.get(key)
        if shadow is None:
            shadow = self.shadows[key] = engine.torch.empty(data.nbytes, dtype=engine.torch.uint8, device=engine.device)
        copies, at = [], 0
        for piece in pieces:
            nbytes = piece.numel() * size
            copies.append((piece, shadow[at:at + nbytes].view(typed.dtype).view(piece.shape)))
            at += nbytes
        if s.action is Action.RECV:
            self.after[i] = copies
        elif not any(engine.steps[d].action is Action.RECV and engine.steps[d].data == data for d in s.deps):
            self.before[i] = [(staged, piece) for piece, staged in copies]  # a relay's bytes are in the shadow already
        return shadow


def bytes_of(tensor):
    """A flat uint8 view of a contiguous tensor (None for None), whatever the strides of its dims of length 1."""
    if tensor is None:
        return None
    import torch

    flat = tensor.as_strided((tensor.numel(),), (1,))  # reshape(-1) keeps the stride of a dim of 1, which view() refuses
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
