"""Read a resharding problem from a JSON/TOML file or CLI shorthand, placing meshes on hosts.

Mesh shorthand `AxB` is A hosts of B devices each (the paper's (hosts, GPUs per host)); other
shapes (`8`, `2x2x2`) are packed row-major onto whole hosts. Shorthand meshes take fresh hosts:
the source from host 0, the destination after it. A file may instead give `devices` explicitly
or a `first_host`, which is how two meshes share devices or hosts.

>>> parse_shape("1024,1024,512")
(1024, 1024, 512)
>>> place_mesh((2, 3), first_host=1, devices_per_host=4).devices
(4, 5, 6, 8, 9, 10)
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from xmesh_plan.schemas import Cluster, DeviceMesh, PlanFileError, ReshardingProblem
from xmesh_plan.schemas import files as schemas_files
from xmesh_plan.schemas.convert import FP8_MAX
from xmesh_plan.schemas.dtypes import canonical_dtype
from xmesh_plan.schemas.files import DataFileError
from xmesh_plan.schemas.limits import MAX_DEVICE_ID, check_mesh_size, shown
from xmesh_plan.schemas.spec import SpecError
from xmesh_plan.schemas.validation import describe_validation_error


class InputError(ValueError):
    """Bad user input; the message is one line naming the field and the fix."""


def parse_shape(text: str, field: str = "shape") -> tuple[int, ...]:
    """`1024,1024,512`, `1024x1024x512` or `(2, 4)` -> a tuple of non-negative ints."""
    body = str(text).strip().strip("()[]").strip()
    parts = [p.strip() for p in re.split(r"\s*[,x]\s*|\s+", body)] if body else []
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise InputError(f"{field}: {shown(text)} is not a list of non-negative integers; write e.g. 1024,1024,512 or 2x4")
    if any(len(p.lstrip("0")) > 19 for p in parts):  # int() of thousands of digits raises, and no dim is that long
        raise InputError(f"{field}: {shown(text)} has a number above 2^63-1; give smaller integers")
    return tuple(int(p) for p in parts)


def _int_list(value: Any, field: str) -> tuple[int, ...]:
    """A JSON list of integers (or shorthand text) as a tuple; anything else is an InputError naming `field`."""
    if isinstance(value, str):
        return parse_shape(value, field)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InputError(f"{field}: {shown(value)} must be a list of integers, e.g. [2, 4]")
    return tuple(value)


def place_mesh(shape: tuple[int, ...], first_host: int, devices_per_host: int, field: str = "mesh") -> DeviceMesh:
    """Lay a mesh onto hosts from `first_host` on: (A, B) takes A hosts, B devices each (B <= devices per host)."""
    try:
        check_mesh_size(shape, field)
    except ValueError as err:
        raise InputError(str(err)) from None
    last = (first_host + (shape[0] if len(shape) == 2 else -(-math.prod(shape) // devices_per_host))) * devices_per_host - 1
    if last > MAX_DEVICE_ID:
        raise InputError(f"{field}: placed from host {first_host} its device ids reach {last}, above {MAX_DEVICE_ID}; "
                         "use a smaller first_host or fewer devices")
    if len(shape) == 2 and shape[1] > devices_per_host:
        raise InputError(f"{field}: {shape[0]}x{shape[1]} means {shape[0]} hosts of {shape[1]} devices, but hosts have "
                         f"{devices_per_host} (cluster.devices_per_host); raise it or give the mesh's devices explicitly")
    if len(shape) == 2:
        devices = [(first_host + a) * devices_per_host + b for a in range(shape[0]) for b in range(shape[1])]
    else:
        start = first_host * devices_per_host
        devices = list(range(start, start + math.prod(shape)))
    return DeviceMesh(shape=shape, devices=tuple(devices))


def hosts_used(mesh: DeviceMesh, devices_per_host: int) -> int:
    """One past the highest host the mesh touches."""
    return max(mesh.devices) // devices_per_host + 1


def parse_mesh(raw: Any, field: str, first_host: int, devices_per_host: int) -> DeviceMesh:
    """A mesh from shorthand (`"2x4"`, `[2, 4]`) or an object with shape and devices or first_host; errors name `field`."""
    try:
        return _build_mesh(raw, field, first_host, devices_per_host)
    except ValidationError as err:
        raise InputError(f"{field}: {describe_validation_error(err)}") from None


def _build_mesh(raw: Any, field: str, first_host: int, devices_per_host: int) -> DeviceMesh:
    if isinstance(raw, (str, list, tuple)):
        return place_mesh(_int_list(raw, field), first_host, devices_per_host, field)
    if not isinstance(raw, dict) or "shape" not in raw:
        raise InputError(f"{field}: give a shorthand like \"2x4\" or an object with \"shape\" and optionally \"devices\" or \"first_host\"")
    unknown = set(raw) - {"shape", "devices", "first_host"}
    if unknown:
        raise InputError(f"{field}: unknown key {sorted(unknown)[0]!r}; use shape, devices or first_host")
    shape = _int_list(raw["shape"], f"{field}.shape")
    if "devices" in raw and "first_host" in raw:
        raise InputError(f"{field}: give devices or first_host, not both (explicit devices leave nothing to place from a host)")
    if "devices" in raw:
        return DeviceMesh(shape=shape, devices=_int_list(raw["devices"], f"{field}.devices"))
    first = raw.get("first_host", first_host)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise InputError(f"{field}.first_host: {shown(first)} must be a non-negative integer host index")
    return place_mesh(shape, first, devices_per_host, field)


def parse_cluster(raw: Any) -> Cluster:
    """The `cluster` entry of a problem or pipeline file; errors name `cluster.<field>`."""
    try:
        return Cluster.model_validate(raw)
    except ValidationError as err:
        message = describe_validation_error(err)
        raise InputError(f"cluster{'.' if err.errors()[0]['loc'] else ': '}{message}") from None


def build_problem(raw: dict[str, Any]) -> ReshardingProblem:
    """A problem from plain data (a parsed JSON/TOML file), expanding mesh shorthand onto hosts."""
    if not isinstance(raw, dict):
        raise InputError("problem: the file must hold one object with shape, dtype, src, dst (and optionally cluster, name)")
    data = dict(raw)
    cluster = data["cluster"] = parse_cluster(data.get("cluster", {}))
    if isinstance(data.get("shape"), str):
        data["shape"] = parse_shape(data["shape"])
    next_host = 0
    for side in ("src", "dst"):
        placement = data.get(side)
        if not isinstance(placement, dict) or "mesh" not in placement or not ({"spec", "boxes"} & set(placement)):
            raise InputError(f"{side}: give an object with \"mesh\" (e.g. \"2x4\") and \"spec\" (e.g. \"S0 R R\") "
                             "or \"boxes\" (each device's [[start, stop], ...])")
        mesh = parse_mesh(placement["mesh"], f"{side}.mesh", next_host, cluster.devices_per_host)
        data[side] = {**placement, "mesh": mesh}
        next_host = max(next_host, hosts_used(mesh, cluster.devices_per_host))
    if canonical_dtype(str(data.get("dst_dtype"))) in FP8_MAX:
        raise InputError("dst_dtype: an FP8 destination needs scales, which travel as a tensor of their own; give the tensor in "
                         "a multi-tensor problem (a tensors list) with scale = \"tensor\" or \"block\"")
    return ReshardingProblem.model_validate(data)


def read_data_file(path: str | Path, what: str) -> Any:
    """Parse a `.toml` or JSON file; errors name the file and say what to fix."""
    try:
        return schemas_files.read_data_file(path, what)
    except DataFileError as err:
        raise InputError(str(err)) from None


def load_problem(path: str | Path) -> ReshardingProblem:
    """Read a `.json` or `.toml` problem file; errors name the file and field."""
    return build_problem(read_data_file(path, "problem file"))


def user_error_message(err: Exception) -> str | None:
    """One-line message for errors caused by user input, None for anything else (a bug)."""
    if isinstance(err, ValidationError):
        return describe_validation_error(err)
    if isinstance(err, (InputError, SpecError, PlanFileError)):
        return str(err)
    return None
