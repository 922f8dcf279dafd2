"""Check and adapt the arrays handed to `run()`: numpy as is, anything with DLPack without a copy.

The plan's dtype names the element kind; numpy lacks bfloat16 and float8, so for those an array of the
`ml_dtypes` type or of a same-size integer (the bits) is accepted and moved as raw bytes; another float
kind of that size (float16 for bfloat16, one FP8 kind for another) has other bits and is refused.
"""

from __future__ import annotations

import sys

import numpy as np

from xmesh_plan.schemas.dtypes import numpy_dtype_name

from .errors import PlanMismatchError

RAW_KINDS = ("bfloat16", "float8")


def storage_dtype(dtype_name: str) -> np.dtype:
    """The numpy dtype buffers of this plan dtype are allocated with (raw uint for bfloat16/float8)."""
    return np.dtype(numpy_dtype_name(dtype_name))


def is_device_array(array: object) -> bool:
    """True for CuPy arrays and other arrays whose DLPack device is not the CPU."""
    if type(array).__module__.split(".")[0] == "cupy":
        return True
    device = getattr(array, "__dlpack_device__", None)
    return device is not None and device()[0] != 1  # 1 = kDLCPU


def as_host_array(array: object, device: int) -> np.ndarray:
    """A numpy view of `array` (numpy, or a CPU tensor through DLPack); refuses device arrays."""
    if isinstance(array, np.ndarray):
        return array
    if is_device_array(array):
        raise PlanMismatchError(f"run(): device {device} got a GPU array ({type(array).__name__}); the mpi backend "
                                "moves host memory, so pass a numpy array or use backend='nccl'")
    if hasattr(array, "__dlpack__"):
        return import_dlpack(np.from_dlpack, array, "numpy", device)
    raise PlanMismatchError(f"run(): device {device} got a {type(array).__name__}; pass a numpy array or an object with __dlpack__")


_TORCH_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def raw_torch_view(tensor: object) -> object | None:
    """A torch tensor of a float kind DLPack importers lack (bfloat16, float8) as a same-size integer
    tensor over the same memory; None for anything else. Needs no torch import: a torch tensor's
    module is loaded already."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        return None
    if tensor.dtype in (torch.float16, torch.float32, torch.float64):
        return None
    return tensor.view(getattr(torch, _TORCH_INT_OF_SIZE[tensor.element_size()]))


def import_dlpack(importer, array: object, library: str, device: int):
    """`importer(array)` (numpy's or CuPy's from_dlpack), retried on a same-size integer view for
    bfloat16/float8 torch tensors; an import the library refuses becomes a one-line PlanMismatchError."""
    try:
        return importer(array)
    except (TypeError, BufferError, RuntimeError, ValueError) as err:
        raw = raw_torch_view(array)
        if raw is not None:
            return importer(raw)
        raise PlanMismatchError(f"run(): device {device}: {library} cannot import this {type(array).__name__} through "
                                f"DLPack ({err}); pass a {library} array or a tensor {library} can import") from None


def _kind_ok(got: np.dtype, want: np.dtype, dtype_name: str) -> bool:
    """`got` holds `dtype_name`'s elements: its storage dtype, or for bfloat16/float8 the `ml_dtypes` type of that
    name or an integer of its item size (as the torch engine takes them)."""
    if got == want:
        return True
    if not dtype_name.startswith(RAW_KINDS):
        return False
    return got.name == dtype_name or (got.kind in "iu" and got.itemsize == want.itemsize)


def _what_to_pass(want: np.dtype, dtype_name: str) -> str:
    if not dtype_name.startswith(RAW_KINDS):
        return f"a {want} array"
    return f"a {dtype_name} array (ml_dtypes) or its bits as {want} or int{8 * want.itemsize}"


def check_into(array: np.ndarray, shape: tuple[int, ...], dtype_name: str, device: int, name: str) -> None:
    """Refuse (PlanMismatchError) a caller's destination array of another shape or element type than its shard."""
    if array.shape != shape:
        raise PlanMismatchError(f"run(): into[{name!r}] on device {device} has shape {tuple(array.shape)} but the plan gives "
                                f"this device's destination shard {shape}; pass an array (or a view) of that shape")
    got, want = np.dtype(array.dtype), storage_dtype(dtype_name)
    if not _kind_ok(got, want, dtype_name):
        raise PlanMismatchError(f"run(): into[{name!r}] on device {device} is {got} but the plan delivers {dtype_name}; "
                                f"pass {_what_to_pass(want, dtype_name)}")
    if not getattr(array.flags, "writeable", True):  # CuPy arrays have no such flag
        raise PlanMismatchError(f"run(): into[{name!r}] on device {device} is read-only; pass a writeable array")


def check_shard(array: np.ndarray, shape: tuple[int, ...], dtype_name: str, device: int, spec: object) -> None:
    """Refuse a source shard of the wrong shape or element type, naming what the plan expects.

    Called on every run(): builds no objects unless it refuses (`spec` is turned into text only then).
    """
    if array.shape != shape:
        raise PlanMismatchError(f"run(): device {device}'s source shard has shape {tuple(array.shape)} but the source "
                                f"spec {str(spec)!r} gives it {shape}; pass this rank's shard under the source spec")
    got, want = np.dtype(array.dtype), storage_dtype(dtype_name)
    if not _kind_ok(got, want, dtype_name):
        if got.newbyteorder("=") == want:
            raise PlanMismatchError(f"run(): device {device}'s source shard is {got} in non-native byte order; "
                                    "pass a native-order array, e.g. a.astype(a.dtype.newbyteorder('='))")
        raise PlanMismatchError(f"run(): device {device}'s source shard is {got} but the plan moves {dtype_name}; "
                                f"pass {_what_to_pass(want, dtype_name)} (or recompile the plan with dtype {got})")
