"""The ranges every number a user gives must lie in, so that numpy, the solvers and the OS accept it.

They are checked where input enters (problem and pipeline files, CLI flags), so a bad number is one
line naming its field instead of an overflow deep inside. Bandwidths have a floor as well as a
ceiling: 1e-320 Gbit/s is finite and > 0, yet every transfer time it gives is infinite.

>>> check_int64_product((2**32, 2**31), 4, "shape")
Traceback (most recent call last):
...
ValueError: shape (4294967296, 2147483648) of 4-byte elements is 36893488147419103232 bytes, above 9223372036854775807 (int64, what numpy can index); give a smaller shape
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, Strict

INT64_MAX = 2**63 - 1
MAX_TENSOR_RANK = 16  # a unit-task grid indexes src and dst shard counts together: 2 x 16 = numpy's 32 dims
MAX_MESH_RANK = 16
MAX_MESH_DEVICES = 2**20  # devices in one mesh; device ids are listed one by one
MAX_DEVICE_ID = 2**31 - 1  # MPI ranks and NCCL ranks are C ints
MIN_GBPS, MAX_GBPS = 1e-6, 1e12  # 1 kbit/s .. 1 Zbit/s: every byte count over it stays a finite time
MAX_LATENCY_US = 1e12  # about 11 days per message
MAX_SECONDS = 1e12  # a compute time of one pipeline stage, seconds
MAX_MICRO_BATCHES = 10_000  # a schedule lists every micro-batch's actions of every stage
MAX_STAGES = 1_024


def refuse_bool(value: object) -> object:
    """pydantic reads `true` as 1; a boolean where a number belongs is a mistake, so say so."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean; give a number")
    return value




def shown(value: object, width: int = 40) -> str:
    """`repr(value)` cut to `width` characters (repr of a 5,000-digit int would even raise)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def quoted(text: object) -> str:
    """User text (a name, a key, a path) as a message shows it: as it is when it is plain printable text, else
    quoted as Python's repr quotes it, so a newline or control character in it cannot break the one-line message.

    >>> quoted("plans/case3.plan.json"), quoted("a\\nb")
    ('plans/case3.plan.json', "'a\\\\nb'")
    """
    text = str(text)
    return text if text and text.isprintable() and text.strip() == text else repr(text)


def finite(low: float, high: float, **kwargs) -> object:
    """A float field in [low, high] that refuses booleans, NaN and infinities with a message giving the range."""
    def check(value: object) -> object:
        refuse_bool(value)
        try:
            number = float(value) if isinstance(value, (int, float, str)) else None
        except (ValueError, OverflowError):
            number = math.inf if isinstance(value, int) else None  # an int too big for a float; other text pydantic names
        if number is not None and not (math.isfinite(number) and low <= number <= high):
            raise ValueError(f"{shown(value)} is not a finite number in {low:g} .. {high:g}; give one in that range")
        return value
    return Annotated[float, Strict(), BeforeValidator(check), Field(allow_inf_nan=False, **kwargs)]


def check_int64_product(shape: tuple[int, ...], itemsize: int, field: str) -> None:
    """Raise ValueError unless the tensor's size in bytes fits in int64 (numpy's index type)."""
    nbytes = math.prod(shape) * itemsize
    if nbytes > INT64_MAX:
        raise ValueError(f"{field} {tuple(shape)} of {itemsize}-byte elements is {nbytes} bytes, above {INT64_MAX} "
                         "(int64, what numpy can index); give a smaller shape")


def check_mesh_size(shape: tuple[int, ...], field: str) -> None:
    """Raise ValueError unless a mesh of this shape has 1 .. MAX_MESH_DEVICES devices and few enough axes."""
    if len(shape) > MAX_MESH_RANK:
        raise ValueError(f"{field} has {len(shape)} axes; give at most {MAX_MESH_RANK}")
    if any(s < 1 for s in shape):
        raise ValueError(f"{field} {'x'.join(map(str, shape))} has an axis of size < 1; every axis needs at least one device")
    if math.prod(shape) > MAX_MESH_DEVICES:
        raise ValueError(f"{field} {'x'.join(map(str, shape))} has {math.prod(shape)} devices; give at most {MAX_MESH_DEVICES:,}")


def integer(low: int, high: int, what: str) -> object:
    """An int field in [low, high] that refuses booleans; the message names `what` it is and the range."""
    def check(value: object) -> object:
        refuse_bool(value)
        if isinstance(value, int) and not low <= value <= high:
            raise ValueError(f"{shown(value)} is {'negative' if value < 0 else 'too small' if value < low else 'too large'}; give {what} in {low} .. {high}")
        return value
    return Annotated[int, Strict(), BeforeValidator(check)]


def version_field(*versions: int) -> object:
    """A `schema_version` field: one of the integers `versions` as written (`true` and `1.0` equal 1 in Python, so a
    plain Literal takes them)."""
    def check(value: object) -> object:
        if type(value) is not int:
            raise ValueError(f"{shown(value)} is not an integer; write {' or '.join(map(str, versions))}")
        return value
    return Annotated[Literal[versions], BeforeValidator(check)]  # type: ignore[valid-type]


def _decimal_key(value: object) -> object:
    """A JSON object key naming an integer must be plain decimal: `"0"` and `"00"` (or `" 0"`, `"0.0"`) would name
    one device twice, and one would silently win."""
    if isinstance(value, bool) or (isinstance(value, str) and not re.fullmatch(r"0|[1-9][0-9]*", value)):
        raise ValueError(f"key {quoted(value)} is not a plain decimal integer; write e.g. \"3\"")
    return value


IntKey = Annotated[int, BeforeValidator(_decimal_key)]
"""An integer key of a JSON object (always text in the file): plain decimal only, so no two keys name one number."""
StrictInt = Annotated[int, Strict()]
"""An int field that refuses booleans, floats (8.0 too) and text: what a plan file states is taken as written."""
StrictFloat = Annotated[float, Strict()]
"""A float field that takes ints and floats and refuses booleans and text ("0.9")."""
StrictBool = Annotated[bool, Strict()]
"""A bool field that refuses 0, 1 and text ("true")."""


Length = integer(0, INT64_MAX, "a length")
"""A tensor dim: an integer 0 .. 2^63-1 (not a boolean)."""
