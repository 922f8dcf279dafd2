"""Refuse arrays of one call that would be written while they share memory: a caller's destination array whose
elements overlap each other, or that overlaps another destination array or a source shard of the same call (the MPI
and nccl engines receive straight into the caller's memory, so such a reshard's result would depend on the order bytes
land).

Any array the engines take: numpy, CuPy (`data.ptr`) or torch (`data_ptr()`, strides in elements), each read as its
`Layout` (address, shape, byte strides, item size); the memory itself is never touched. Cheap on the common path: an
array whose dims, by increasing stride, each step past the span of the ones before cannot overlap itself, and arrays
whose byte ranges are apart cannot overlap each other; only otherwise are the elements' offsets (`overlaps_itself`) or
`numpy.shares_memory` over address-only stand-ins consulted.

>>> import numpy as np
>>> overlaps_itself(np.zeros((4, 6))[:, ::2]), overlaps_itself(np.lib.stride_tricks.as_strided(np.zeros(4), (3, 2), (8, 8)))
(False, True)
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np

from .errors import PlanMismatchError


class Layout(NamedTuple):
    """Where an array's elements lie: the address of its first element, its shape, its strides in bytes, its item size."""
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def layout(array) -> Layout:
    """The `Layout` of a numpy or CuPy array or a torch tensor."""
    if hasattr(array, "data_ptr"):  # torch: strides in elements
        size = array.element_size()
        return Layout(array.data_ptr(), tuple(array.shape), tuple(s * size for s in array.stride()), size)
    ptr = array.__array_interface__["data"][0] if isinstance(array, np.ndarray) else array.data.ptr
    return Layout(ptr, tuple(array.shape), tuple(array.strides), array.itemsize)


def byte_bounds(array) -> tuple[int, int]:
    """The addresses of the first byte `array` touches and one past its last, from its shape and strides (what NumPy 2's
    `numpy.lib.array_utils.byte_bounds` gives for numpy; NumPy 1.26, which the project supports, has no such module)."""
    at = layout(array)
    low = high = at.ptr
    if not at.size:
        return low, high
    for n, stride in zip(at.shape, at.strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + at.itemsize


OFFSETS_CHECKED = 1 << 22  # elements whose offsets `overlaps_itself` sorts at most (32 MiB of them)


def overlaps_itself(array) -> bool:
    """Whether two elements of `array` share a byte (a zero stride, or strides that interleave too tightly). Strides
    that interleave over more than OFFSETS_CHECKED elements are not checked element by element: True, conservatively
    (such a view is refused even where its elements happen to be distinct)."""
    at = layout(array)
    if at.size <= 1:
        return False
    dims = sorted((abs(stride), n) for n, stride in zip(at.shape, at.strides) if n > 1)
    if dims[0][0] == 0:  # a zero stride over two or more elements
        return True
    reach = at.itemsize
    for stride, n in dims:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:
        return False
    if at.size > OFFSETS_CHECKED:
        return True
    offsets = np.zeros(1, np.int64)  # strides that interleave (rare): every element's offset, sorted, checked for gaps
    for stride, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    offsets.sort()
    return bool((np.diff(offsets) < at.itemsize).any())


class _AddressOnly:
    """A numpy array interface over an array's addresses, for `numpy.shares_memory`, which reads only the addresses,
    shape and strides (never the memory, which may be a GPU's)."""

    def __init__(self, at: Layout):
        self.__array_interface__ = {"version": 3, "shape": at.shape, "strides": at.strides, "typestr": f"|V{at.itemsize}",
                                    "data": (at.ptr, False)}


def shares_memory(a, b) -> bool:
    """Whether two arrays (numpy, CuPy or torch) have an element's byte in common: `numpy.shares_memory` over their
    addresses."""
    return bool(np.shares_memory(np.asarray(_AddressOnly(layout(a))), np.asarray(_AddressOnly(layout(b)))))


def refuse_overlapping_into(array, device: int, name: str) -> None:
    """PlanMismatchError for a caller's destination array whose elements share memory."""
    if overlaps_itself(array):
        at = layout(array)
        raise PlanMismatchError(f"run(): into[{name!r}] on device {device} has elements sharing memory (shape {at.shape}, "
                                f"byte strides {at.strides}); pass an array or view whose elements are distinct")


def refuse_shared(targets: Mapping[str, object], sources: Mapping[str, object], device: int) -> None:
    """PlanMismatchError for a caller's destination array of one call sharing memory with another one's or with a source
    shard of the call (sources may share memory with each other: they are only read). Byte ranges sorted by their start;
    `shares_memory` only for pairs whose ranges meet (arrays of numpy, CuPy or torch, as `layout` reads them)."""
    spans = [(*byte_bounds(a), True, name, a) for name, a in targets.items() if layout(a).size]
    spans += [(*byte_bounds(a), False, name, a) for name, a in sources.items() if a is not None and layout(a).size]
    spans.sort(key=lambda span: span[0])
    open_: list = []
    for low, high, written, name, array in spans:
        open_ = [span for span in open_ if span[1] > low]
        for _, _, other_written, other, seen in open_:
            if (written or other_written) and shares_memory(array, seen):
                target, what = (name, f"into[{other!r}]" if other_written else f"the source shard of {other!r}") if written \
                    else (other, f"the source shard of {name!r}")
                raise PlanMismatchError(f"run(): into[{target!r}] on device {device} shares memory with {what}, which the "
                                        "same call writes or reads; pass separate arrays")
        open_.append((low, high, written, name, array))
