"""Pydantic validation errors as the one line a user reads: the field's path, then what to do."""

from __future__ import annotations

from pydantic import ValidationError

from .limits import quoted


def describe_validation_error(err: ValidationError) -> str:
    """First error of a pydantic validation as one line: `src.spec: <message>`.

    >>> from xmesh_plan.schemas import Cluster
    >>> try:
    ...     Cluster.model_validate({"devices_per_host": 0})
    ... except ValidationError as err:
    ...     print(describe_validation_error(err))
    devices_per_host: 0 is too small; give a device count in 1 .. 1048576
    """
    first = err.errors()[0]
    field = ".".join(quoted(p) for p in first["loc"])  # a key with a newline in it stays on the one line
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "is required; add it"
    elif first["type"] == "extra_forbidden":
        message = "is not a known field; remove it or check its spelling"
    return f"{field}: {message}" if field else message
