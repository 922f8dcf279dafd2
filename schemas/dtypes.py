"""Element types by name with their size in bytes; float8 kinds and bfloat16 included.

>>> DTYPE_SIZES["bfloat16"], DTYPE_SIZES["float8_e4m3fn"]
(2, 1)
"""

from __future__ import annotations

DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
           "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}


def canonical_dtype(name: str) -> str:
    """Resolve an alias such as `bf16` to its canonical name; unknown names pass through to be checked."""
    return ALIASES.get(name.lower(), name.lower())


def check_dtype(name: str) -> None:
    if name not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_SIZES)}")


def numpy_dtype_name(name: str) -> str:
    """A numpy dtype with the same item size, for moving raw bytes of kinds numpy lacks (bfloat16, float8)."""
    if name.startswith("float8"):
        return "uint8"
    if name == "bfloat16":
        return "uint16"
    return name
