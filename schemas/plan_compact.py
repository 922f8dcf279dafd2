"""The compact plan file (`*.plan.npz`): a plan's tasks, operations and host order as numpy columns, for plans of
10^5-10^6 operations that JSON states in hundreds of megabytes; plus a per-device index, so a rank reads only the
operations it takes part in (`read_plan_ops`).

The container is a zip of `.npy` arrays (what `numpy.savez` writes, readable by `numpy.load(allow_pickle=False)`),
with a fixed timestamp: the same plan gives the same bytes. The members a rank reads are stored uncompressed, each a
contiguous byte range a reader maps (`numpy.memmap`) and indexes row by row; those no rank reads (`DEFLATED`: tasks
and host order) are deflated and read whole. Nothing is pickled: every member is a plain integer, float or byte array.

A model is a few layer types repeated: the operations of one layer type's layers differ in their tensor, ids and
times, not in their kind, devices, boxes or bundles. So each table's `LAYOUTS` fields are stored once per distinct
combination (the table's layouts, in order of first use) and each row names its layout (`<table>.layout`): a
layer's operations are a template, each later layer's its layout indices plus its own ids, tensor and times.

Members:
- `header.npy`: UTF-8 JSON (a uint8 array) with `format`, `format_version`, and `plan`: the plan's JSON object
  less its `tasks`, `operations` and `host_order` (problem, solver, predictions, staging), with its schema_version.
- `<table>.<field>...npy` for the tables `tasks`, `operations`, `host_order`, one column kind per field
  (`COLUMN_KINDS`), a row per layout for the `LAYOUTS` fields and per row for the others: integers in the narrowest
  of int8/16/32/64 that holds them, strings as indices into `<table>.<field>.names` (UTF-8 JSON list), lists of
  integers as `.lengths` + flat `.values`, boxes as indices into the shared box table (`boxes.dims`, `boxes.values`:
  each distinct box once), an optional integer as values + a `.none` mask (left out when nothing is None; values
  only for the rows that have one), times as `.at` indices into the shared `floats` table where that is smaller
  than float64 columns (exact: distinct by bit pattern), else as float64. `<table>.layout`: each row's layout
  (tasks and operations; left out where every row is its own layout, in order).
- `index.devices`, `index.offsets`, `index.first`, `index.rows`: for each device (sorted), the rows of the
  operations it takes part in (src, dsts, holders or needers), in execution order: its first row, then the steps
  between rows (uint8; a step of `WIDE_STEP` or more is `WIDE_STEP` there and its value the next entry of
  `index.rows.wide`); `index.first_tags`: per row, its operation's first message tag (`op_kinds.first_tags`: numbered
  tensor by tensor, as the executor's lowering numbers them), and the plan's total last, so a rank numbers its
  messages as its peers lowering the whole plan do.
"""

from __future__ import annotations

import io
import json
import os
import weakref
import zipfile
import zlib
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, Callable

import numpy as np

from .op_kinds import first_tags, number_tags, tags_used
from .transfer import MAX_TENSORS

FORMAT = "xmesh-plan-compact"
FORMAT_VERSION = 4
ZIP_MAGIC = b"PK\x03\x04"
_DATE = (1980, 1, 1, 0, 0, 0)  # every member's timestamp: the same plan gives the same bytes
TABLES = ("tasks", "operations", "host_order")

# table -> field -> column kind (see _ENCODERS); tests check these cover every field of the plan's records.
COLUMN_KINDS: dict[str, dict[str, str]] = {
    "operations": {"id": "int", "task": "int", "tensor": "int?", "kind": "str", "src": "int?", "dsts": "ints",
                   "region": "box", "parts": "boxes", "chunks": "int", "holders": "ints", "needers": "intss",
                   "carrier": "int?", "start_s": "float", "end_s": "float"},
    "tasks": {"id": "int", "tensor": "int?", "region": "box", "nbytes": "int", "senders": "ints", "receivers": "ints",
              "merged_cells": "int", "sender": "int", "sender_host": "int", "receiver_hosts": "ints", "strategy": "str",
              "chunks": "int", "start_s": "float", "end_s": "float"},
    "host_order": {"host": "int", "side": "str", "tasks": "ints"},
}
# table -> the fields stored once per distinct combination (its layouts, in order of first use), each row naming its
# layout in `<table>.layout`: a model's layers of one type repeat these, up to the tensor index, ids and times.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "operations": ("kind", "src", "dsts", "region", "parts", "chunks", "holders", "needers"),
    "tasks": ("region", "nbytes", "senders", "receivers", "merged_cells", "sender", "sender_host", "receiver_hosts",
              "strategy", "chunks"),
}
DEFLATED = ("tasks.", "host_order.")  # members no rank reads (`read_device_data`), stored compressed
DEVICE_FIELDS = ("src", "dsts", "holders", "needers")  # an operation's devices: who takes part in it
MAX_MEMBER_BYTES = 2**31  # what a member may state it inflates to (a compact file itself may be 2 GiB)
WIDE_STEP = 255  # an `index.rows` entry (uint8) meaning: this step is the next entry of `index.rows.wide`


class CompactPlanError(ValueError):
    """A compact plan file that cannot be read: what is wrong, in one line (the caller adds the file and the fix)."""


# ---------------------------------------------------------------- writing


def _narrow(array: np.ndarray) -> np.ndarray:
    """Integers `array` in the narrowest of int8/16/32/64 that holds them exactly."""
    if array.size == 0:
        return np.zeros(0, dtype=np.int8)
    lo, hi = int(array.min()), int(array.max())
    return array.astype(next(t for t in (np.int8, np.int16, np.int32, np.int64)
                             if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max), copy=False)


def _ints(values, what: str) -> np.ndarray:
    """The narrowest signed integer array that holds `values` (a list of ints, or an iterable of them) exactly."""
    values = values if isinstance(values, list) else list(values)
    try:
        return _narrow(np.fromiter(values, dtype=np.int64, count=len(values)))
    except OverflowError:  # some value outside 64-bit integers: name it
        lo, hi = min(values), max(values)
        raise CompactPlanError(f"{what} holds {lo if lo < np.iinfo(np.int64).min else hi}, outside 64-bit integers") from None


def _lengths_of(rows) -> np.ndarray:
    """The lengths of `rows` (lists), narrowed."""
    return _narrow(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)))


def _first_use(keys, count: int) -> tuple[np.ndarray, dict]:
    """(per key, the index of its first occurrence among the distinct keys, in order of first use; the distinct keys
    -> their index)."""
    seen: dict = {}
    add = seen.setdefault
    return np.fromiter((add(k, len(seen)) for k in keys), dtype=np.int64, count=count), seen


class _Shared:
    """What several columns index into: every distinct box (`boxes.dims`, `boxes.values`, in order of first use) and
    every time value (`floats`, distinct bit patterns, sorted), the latter kept only where it makes the file smaller."""

    def __init__(self):
        self.boxes: dict[tuple, int] = {}
        self.floats: dict[str, np.ndarray] = {}

    def box_indices(self, boxes: list) -> np.ndarray:
        """The shared table's index of each box (a tuple of (start, stop) pairs), each new one added."""
        add, table = self.boxes.setdefault, self.boxes
        return np.fromiter((add(b, len(table)) for b in boxes), dtype=np.int64, count=len(boxes))

    def members(self) -> dict[str, np.ndarray]:
        boxes = list(self.boxes)
        out = {"boxes.dims": _lengths_of(boxes),
               "boxes.values": _ints(chain.from_iterable(chain.from_iterable(boxes)), "boxes").reshape(-1, 2)}
        names, columns = list(self.floats), list(self.floats.values())
        bits = np.concatenate(columns).view(np.int64) if columns else np.zeros(0, np.int64)
        table, at = np.unique(bits, return_inverse=True)
        index = _narrow(at.reshape(-1))
        if table.size * 8 + index.nbytes < bits.size * 8:
            out["floats"] = table.view(np.float64)
            for name, part in zip(names, np.split(index, np.cumsum([len(c) for c in columns])[:-1])):
                out[f"{name}.at"] = part
        else:
            out.update(zip(names, columns))
        return out


def _encode_int(name: str, values: list, out: dict, shared: _Shared) -> None:
    out[name] = _ints(values, name)


def _encode_optional_int(name: str, values: list, out: dict, shared: _Shared) -> None:
    """The values of the rows that have one, and where some row has none, a `.none` flag per row."""
    none = np.fromiter((v is None for v in values), dtype=np.bool_, count=len(values))
    out[name] = _ints([v for v in values if v is not None] if none.any() else values, name)
    if none.any():
        out[f"{name}.none"] = none


def _encode_float(name: str, values: list, out: dict, shared: _Shared) -> None:
    shared.floats[name] = np.array(values, dtype=np.float64).reshape(-1)  # written with the shared tables


def _encode_str(name: str, values: list, out: dict, shared: _Shared) -> None:
    names = sorted(set(values))
    code = {n: i for i, n in enumerate(names)}
    out[name] = _ints(map(code.__getitem__, values), name)
    out[f"{name}.names"] = _text(json.dumps(names))


def _encode_ints(name: str, values: list, out: dict, shared: _Shared) -> None:
    out[f"{name}.lengths"] = _lengths_of(values)
    out[f"{name}.values"] = _ints(chain.from_iterable(values), name)


def _encode_box(name: str, values: list, out: dict, shared: _Shared) -> None:
    """A box as its index in the shared box table."""
    out[name] = _narrow(shared.box_indices(values))


def _encode_boxes(name: str, values: list, out: dict, shared: _Shared) -> None:
    """A list of boxes: lengths count boxes per row, values are indices in the shared box table."""
    out[f"{name}.lengths"] = _lengths_of(values)
    out[f"{name}.values"] = _narrow(shared.box_indices(list(chain.from_iterable(values))))


def _encode_intss(name: str, values: list, out: dict, shared: _Shared) -> None:
    """A list of lists of integers: lengths count lists per row, `.inner` integers per list."""
    inner = list(chain.from_iterable(values))
    out[f"{name}.lengths"] = _lengths_of(values)
    out[f"{name}.inner"] = _lengths_of(inner)
    out[f"{name}.values"] = _ints(chain.from_iterable(inner), name)


_ENCODERS: dict[str, Callable[[str, list, dict, _Shared], None]] = {
    "int": _encode_int, "int?": _encode_optional_int, "float": _encode_float, "str": _encode_str,
    "ints": _encode_ints, "box": _encode_box, "boxes": _encode_boxes, "intss": _encode_intss,
}


def _text(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8)


def _device_pairs(columns: dict[str, np.ndarray], count: int) -> tuple[np.ndarray, np.ndarray]:
    """(devices, rows): every (device, operation row) pair of the device columns (`DEVICE_FIELDS`) of the encoded
    operations table, the columns of the operations' layouts expanded to the rows that use them."""
    layouts = len(columns["operations.dsts.lengths"])  # a row per layout, as every layout field
    layout = np.asarray(columns.get("operations.layout", np.arange(layouts)), dtype=np.int64)
    rows, devices = [], []
    for field in DEVICE_FIELDS:
        name = f"operations.{field}"
        if COLUMN_KINDS["operations"][field] == "int?":  # values only for the layouts that have one
            none = columns.get(f"{name}.none", np.zeros(layouts, dtype=bool))
            has = ~np.asarray(none, dtype=bool)
            rows.append(np.flatnonzero(has)), devices.append(np.asarray(columns[name], dtype=np.int64))
            continue
        owner = np.repeat(np.arange(layouts), np.asarray(columns[f"{name}.lengths"], dtype=np.int64))
        if COLUMN_KINDS["operations"][field] == "intss":  # layouts own inner lists, which own the values
            owner = np.repeat(owner, np.asarray(columns[f"{name}.inner"], dtype=np.int64))
        rows.append(owner), devices.append(np.asarray(columns[f"{name}.values"], dtype=np.int64))
    owner, device = np.concatenate(rows), np.concatenate(devices)
    order = np.lexsort((device, owner))  # by layout, then device: one layout's devices contiguous, each once
    owner, device = owner[order], device[order]
    keep = np.ones(len(owner), dtype=bool)
    keep[1:] = (owner[1:] != owner[:-1]) | (device[1:] != device[:-1])
    owner, device = owner[keep], device[keep]
    offsets = np.searchsorted(owner, np.arange(layouts + 1))
    lengths, flat = row_ranges(offsets, layout)
    return device[flat], np.repeat(np.arange(count), lengths)


def _device_index(columns: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """For each device, the rows of the operations it takes part in, ascending (stored as the first row, then the
    steps between rows); from the encoded device columns."""
    devices, rows = _device_pairs(columns, count) if count else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    devices, rows = _sorted_pairs(devices, rows, count)
    starts = np.flatnonzero(np.concatenate(([True], devices[1:] != devices[:-1]))) if len(devices) else np.zeros(0, np.int64)
    steps = np.diff(rows, prepend=0)
    steps[starts] = 0  # each device's first row is in index.first
    wide = steps >= WIDE_STEP  # few: a device's operations are seldom that far apart
    return {"index.devices": _narrow(devices[starts]),
            "index.offsets": _narrow(np.append(starts, len(rows))),
            "index.first": _narrow(rows[starts]),
            "index.rows": np.where(wide, WIDE_STEP, steps).astype(np.uint8),
            "index.rows.wide": _narrow(steps[wide])}


def _sorted_pairs(devices: np.ndarray, rows: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The (device, row) pairs (each once) sorted by device, then row: through one int64 key per pair where the
    devices' range allows (a 1-D sort, faster than sorting pairs; numpy 2's `np.unique` hashes, 70x slower on 10^7
    pairs), else by both columns."""
    if not len(devices):
        return devices, rows
    low = int(devices.min())
    if (int(devices.max()) - low + 1) * count >= 2**62:  # ids too far apart for one key
        order = np.lexsort((rows, devices))
        return devices[order], rows[order]
    keys = np.sort((devices - low) * count + rows)
    return keys // count + low, keys % count


def _op_devices(op) -> set[int]:
    found = {d for d in op.dsts} | set(op.holders) | {d for group in op.needers for d in group}
    if op.src is not None:
        found.add(op.src)
    return found


def _frozen(value):
    """A field's value as a hashable key (lists as tuples), for a layout's key."""
    return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


def _table_columns(rows, table: str, out: dict[str, np.ndarray]) -> dict[str, list]:
    """The columns of `table`'s rows, field -> values, its layout fields (`LAYOUTS`) over its distinct layouts, in
    order of first use, with `<table>.layout` (each row's) put in `out`."""
    kinds = COLUMN_KINDS[table]
    columns = dict(zip(kinds, map(list, zip(*map(attrgetter(*kinds), rows))))) if rows else {f: [] for f in kinds}
    fields = LAYOUTS.get(table)
    if fields:
        keys = list(zip(*(columns[f] for f in fields)))
        try:
            layout, distinct = _first_use(keys, len(keys))
        except TypeError:  # a list among the values (a plan made of plain data): as tuples
            layout, distinct = _first_use(map(_frozen, keys), len(keys))
        if len(distinct) < len(keys):  # else every row is its own layout, in order: the member is left out
            out[f"{table}.layout"] = _narrow(layout)
        columns.update(zip(fields, map(list, zip(*distinct))) if distinct else ((f, []) for f in fields))
    return columns


def compact_arrays(plan) -> dict[str, np.ndarray]:
    """Every member of `plan`'s compact file, by name (without `.npy`), in the order they are written."""
    rest = plan.model_dump(mode="json", exclude=set(TABLES))
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "plan": rest,
              "counts": {t: len(getattr(plan, t)) for t in TABLES}}
    out: dict[str, np.ndarray] = {"header": _text(json.dumps(header))}
    shared = _Shared()
    for table, kinds in COLUMN_KINDS.items():
        columns = _table_columns(getattr(plan, table), table, out)
        for field, kind in kinds.items():
            _ENCODERS[kind](f"{table}.{field}", columns[field], out, shared)
    out.update(shared.members())
    count = len(plan.operations)
    out.update(_device_index(out, count))
    layout = np.asarray(out.get("operations.layout", np.arange(count)), dtype=np.int64)
    firsts = np.unique(layout, return_index=True)[1]  # the first operation of each layout (layouts are numbered so)
    try:  # the tags an operation owns depend on its layout's fields alone
        tags = np.array([tags_used(plan.operations[k]) for k in firsts.tolist()], dtype=np.int64)
    except (IndexError, ValueError) as err:  # an operation without the devices its kind's messages need
        raise CompactPlanError(f"its operations cannot be numbered into messages ({err}); `xmesh-plan verify` names the fault") from None
    tensors = [t or 0 for t in map(attrgetter("tensor"), plan.operations)]
    first, total = number_tags(tags[layout].tolist() if count else [], tensors)  # the lowering's numbering
    out["index.first_tags"] = _ints([*first, total], "message tags")
    return out


def compact_bytes(plan) -> bytes:
    """The compact file's bytes: the same plan gives the same bytes."""
    return archive_bytes(compact_arrays(plan))


def archive_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """A zip of `arrays` as `<name>.npy` members with a fixed timestamp: stored, but deflated where no rank reads
    the member (`DEFLATED`)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", allowZip64=True) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED if name.startswith(DEFLATED) else zipfile.ZIP_STORED
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def is_compact(head: bytes) -> bool:
    """Whether a file starting with `head` is a zip (a compact plan, or some other zip the reader refuses)."""
    return head.startswith(ZIP_MAGIC)


# ---------------------------------------------------------------- reading


def _size(source) -> int:
    """The bytes of a file named by its path or open (a binary file object)."""
    return os.fstat(source.fileno()).st_size if hasattr(source, "fileno") else os.path.getsize(source)


def _read_at(source, offset: int, count: int) -> bytes:
    """`count` bytes at `offset` of a file named by its path or open (its position left as it is)."""
    if hasattr(source, "fileno"):
        return os.pread(source.fileno(), count, offset)
    with open(source, "rb") as handle:
        handle.seek(offset)
        return handle.read(count)


class _Members:
    """The `.npy` members of an open compact file, each mapped (not read) until indexed. `path` is the file's path,
    or the file itself open for binary reading: every member is then read from that file, even once another is
    renamed over its path."""

    def __init__(self, path):
        self.path = path
        self.memo: dict[str, Any] = {}
        try:
            with zipfile.ZipFile(path) as archive:
                infos = archive.infolist()
                if all(i.filename != "header.npy" for i in infos):
                    listed = ", ".join(i.filename for i in infos[:3]) or "nothing"
                    raise CompactPlanError(f"a zip of {listed}{', ...' if len(infos) > 3 else ''} without header.npy, so not a compact plan")
                self.where = {i.filename.removesuffix(".npy"): self._locate(archive, i) for i in infos}
        except CompactPlanError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as err:
            raise CompactPlanError(f"a damaged or truncated zip ({err})") from None

    def _locate(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[np.dtype, tuple[int, ...], int]:
        """(dtype, shape, byte offset of the data) of a stored `.npy` member; the offset None for a deflated one."""
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CompactPlanError(f"member {info.filename} is compressed by method {info.compress_type}; compact plans "
                                   "store members or deflate them, as `xmesh-plan` writes them")
        if info.file_size > MAX_MEMBER_BYTES:
            raise CompactPlanError(f"member {info.filename} states {info.file_size:,} bytes, more than a plan's member may hold")
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if reader is None:
                raise CompactPlanError(f"member {info.filename} is .npy version {version}")
            shape, fortran, dtype = reader(member)
            skip = member.tell()
        if fortran or dtype.hasobject or dtype.kind not in "biuf":
            raise CompactPlanError(f"member {info.filename} holds {dtype}{' in Fortran order' if fortran else ''}, not plain numbers")
        if dtype.kind == "u" and dtype.itemsize == 8:  # what `_ints` writes is signed; uint64 may not fit int64
            raise CompactPlanError(f"member {info.filename} holds uint64, integers a 64-bit signed integer may not hold")
        local = _read_at(self.path, info.header_offset, 30)
        if len(local) < 30 or not local.startswith(ZIP_MAGIC):
            raise CompactPlanError(f"member {info.filename} has no local header (truncated)")
        start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        stored = info.compress_type == zipfile.ZIP_STORED
        if start + (skip + size if stored else info.compress_size) > _size(self.path) or skip + size > info.file_size:
            raise CompactPlanError(f"member {info.filename} is cut short (truncated file)")
        return dtype, tuple(shape), start + skip if stored else None

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def once(self, key: str, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per open file (offsets from lengths, the shared tables)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def get(self, name: str) -> np.ndarray:
        """The member, mapped read-only (an empty array where it has no rows)."""
        if name not in self.where:
            raise CompactPlanError(f"member {name}.npy is missing")
        dtype, shape, offset = self.where[name]
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dtype=dtype)
        if offset is None:  # deflated: read whole, once
            return self.once(f"{name}.npy", lambda: self._inflate(name))
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)

    def _inflate(self, name: str) -> np.ndarray:
        try:
            with zipfile.ZipFile(self.path) as archive, archive.open(f"{name}.npy") as member:
                array = np.lib.format.read_array(member, allow_pickle=False)
        except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError) as err:
            raise CompactPlanError(f"member {name}.npy does not inflate ({err}; damaged)") from None
        array.flags.writeable = False
        return array

    def text(self, name: str) -> Any:
        try:
            return json.loads(bytes(self.get(name)).decode())
        except (UnicodeDecodeError, ValueError) as err:
            raise CompactPlanError(f"member {name}.npy is not JSON text ({str(err)[:80]})") from None


def row_ranges(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, flat positions) of the CSR rows `rows`: every position from offsets[r] to offsets[r+1], row by row."""
    starts = np.asarray(offsets[rows], dtype=np.int64)
    lengths = np.asarray(offsets[rows + 1], dtype=np.int64) - starts
    firsts = np.cumsum(lengths) - lengths
    return lengths, np.repeat(starts - firsts, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


_DAMAGED = "(damaged: recompile the plan, or export it again from its JSON plan)"


def _offsets(m: _Members, name: str, values: str, per: int = 1) -> np.ndarray:
    """The running offsets (from 0) of a lengths member that cuts member `values` (`per` numbers an entry), computed
    once per file. Refused unless every length is from 0 to the entries `values` holds and they add up to those
    entries: checked before anything is allocated by them, and no running sum can wrap."""
    def make() -> np.ndarray:
        if values not in m:
            raise CompactPlanError(f"member {values}.npy is missing")
        numbers = int(np.prod(m.where[values][1], dtype=np.int64))
        if numbers % per:
            raise CompactPlanError(f"member {values}.npy holds {numbers:,} numbers, not entries of {per} {_DAMAGED}")
        size = numbers // per
        lengths = np.asarray(m.get(name), dtype=np.int64)
        if (lengths < 0).any():
            raise CompactPlanError(f"member {name}.npy holds a negative length")
        if lengths.size and int(lengths.max()) > size:
            raise CompactPlanError(f"member {name}.npy holds a length of {int(lengths.max()):,}, more than the {size:,} "
                                   f"entries of {values}.npy {_DAMAGED}")
        offsets = np.concatenate(([0], np.cumsum(lengths)))  # below 2**62: at most 2**31 lengths of at most 2**31
        if int(offsets[-1]) != size:
            raise CompactPlanError(f"member {name}.npy's lengths add up to {int(offsets[-1]):,}, not the {size:,} entries "
                                   f"of {values}.npy {_DAMAGED}")
        return offsets
    return m.once(name, make)


def _split(values, lengths: np.ndarray) -> list[tuple]:
    """`values` cut into consecutive tuples of `lengths` (what a record's tuple fields hold)."""
    values, out, at = tuple(values), [], 0
    for n in lengths.tolist():
        out.append(values[at:at + n])
        at += n
    return out


def _indices(m: _Members, name: str, rows, size: int) -> np.ndarray:
    """Entries `rows` of an index member, each checked to be an integer from 0 to below `size` (a shared table's
    length)."""
    stored = m.get(name)
    if stored.dtype.kind not in "iu":  # a float would be cut to another entry
        raise CompactPlanError(f"member {name}.npy holds {stored.dtype}, not integers")
    at = np.asarray(stored[rows], dtype=np.int64)
    if at.size and not 0 <= at.min() <= at.max() < size:
        raise CompactPlanError(f"member {name}.npy points outside its shared table")
    return at


def _box_table(m: _Members) -> tuple[np.ndarray, np.ndarray]:
    """(offsets of each shared box's pairs, the pairs as an (n, 2) int64 array)."""
    def make():
        offsets = _offsets(m, "boxes.dims", "boxes.values", 2)
        return offsets, np.asarray(m.get("boxes.values"), dtype=np.int64).reshape(-1, 2)
    return m.once("boxes", make)


def _boxes_at(m: _Members, name: str, rows) -> list:
    """The shared boxes that entries `rows` of index member `name` point at, each a tuple of (start, stop) pairs:
    each distinct box made once, and shared by the rows that name it."""
    offsets, pairs = _box_table(m)
    distinct, at = np.unique(_indices(m, name, rows, len(offsets) - 1), return_inverse=True)
    dims, flat = row_ranges(offsets, distinct)
    boxes = _split(map(tuple, pairs[flat].tolist()), dims)
    return [boxes[k] for k in at.reshape(-1).tolist()]


def _decode_int(m: _Members, name: str, rows: np.ndarray) -> list:
    return np.asarray(m.get(name)[rows]).tolist()


def _decode_optional_int(m: _Members, name: str, rows: np.ndarray) -> list:
    if f"{name}.none" not in m:
        return _decode_int(m, name, rows)
    none = np.asarray(m.get(f"{name}.none")[rows], dtype=bool)
    values = iter(_decode_int(m, name, _present(m, name)[rows[~none]]))  # stored for the rows that have one only
    return [None if n else next(values) for n in none.tolist()]


def _stored_count(m: _Members, name: str, none: np.ndarray) -> int:
    """How many values an optional integer column with flags `none` stores: one per row that has one; refused
    (naming the column) where the member holds another count, so that no row reads another row's value."""
    present = len(none) - int(np.count_nonzero(none))
    if m.get(name).shape != (present,):
        flags = f", one per row its {name}.none.npy says has one (damaged)" if f"{name}.none" in m else ""
        raise CompactPlanError(f"member {name}.npy is not {present} integers{flags}")
    return present


def _present(m: _Members, name: str) -> np.ndarray:
    """Per row of an optional integer column, its position among the stored values (computed once per file)."""
    def make() -> np.ndarray:
        none = np.asarray(m.get(f"{name}.none"), dtype=bool)
        _stored_count(m, name, none)
        return np.cumsum(~none) - 1
    return m.once(f"{name}.present", make)


def _floats(m: _Members, name: str, rows) -> np.ndarray:
    """A time column's entries `rows`: through the shared `floats` table where the file has one for it."""
    if f"{name}.at" not in m:
        return np.asarray(m.get(name)[rows], dtype=np.float64)
    table = m.get("floats")
    return np.asarray(table, dtype=np.float64)[_indices(m, f"{name}.at", rows, len(table))]


def _decode_float(m: _Members, name: str, rows: np.ndarray) -> list:
    return _floats(m, name, rows).tolist()


def _names(m: _Members, name: str) -> list[str]:
    """The string table of a string column, checked to be a list of strings (once per file)."""
    def make() -> list[str]:
        names = m.text(f"{name}.names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CompactPlanError(f"member {name}.names.npy is not a list of strings")
        return names
    return m.once(f"{name}.names", make)


def _decode_str(m: _Members, name: str, rows: np.ndarray) -> list:
    names = _names(m, name)
    return [names[i] for i in _indices(m, name, rows, len(names)).tolist()]


def _decode_ints(m: _Members, name: str, rows: np.ndarray) -> list:
    lengths, flat = row_ranges(_offsets(m, f"{name}.lengths", f"{name}.values"), rows)
    return _split(np.asarray(m.get(f"{name}.values")[flat]).tolist(), lengths)


def _decode_box(m: _Members, name: str, rows: np.ndarray) -> list:
    return _boxes_at(m, name, rows)


def _decode_boxes(m: _Members, name: str, rows: np.ndarray) -> list:
    lengths, flat = row_ranges(_offsets(m, f"{name}.lengths", f"{name}.values"), rows)
    return _split(_boxes_at(m, f"{name}.values", flat), lengths)


def _decode_intss(m: _Members, name: str, rows: np.ndarray) -> list:
    lengths, lists = row_ranges(_offsets(m, f"{name}.lengths", f"{name}.inner"), rows)
    inner, flat = row_ranges(_offsets(m, f"{name}.inner", f"{name}.values"), lists)
    return _split(_split(np.asarray(m.get(f"{name}.values")[flat]).tolist(), inner), lengths)


_DECODERS: dict[str, Callable[[_Members, str, np.ndarray], list]] = {
    "int": _decode_int, "int?": _decode_optional_int, "float": _decode_float, "str": _decode_str,
    "ints": _decode_ints, "box": _decode_box, "boxes": _decode_boxes, "intss": _decode_intss,
}


def layout_count(m: _Members, table: str) -> int:
    """How many layouts `table` states: the rows of its layout columns (its first layout field's member)."""
    name = f"{table}.{LAYOUTS[table][0]}"
    if name not in m:
        raise CompactPlanError(f"member {name}.npy is missing")
    return m.where[name][1][0] if m.where[name][1] else 0


def _layout_at(m: _Members, table: str, rows) -> np.ndarray:
    """The layouts of `rows` of `table`: its `<table>.layout` entries, checked, or where the writer left that out
    (every row its own layout), the rows themselves."""
    layouts = layout_count(m, table)
    if f"{table}.layout" in m:
        return _indices(m, f"{table}.layout", rows, layouts)
    if layouts != _header(m)["counts"].get(table):  # else a row would read another row's layout
        raise CompactPlanError(f"member {table}.layout.npy is missing, and the {layouts:,} layouts are not one per row")
    return np.arange(layouts, dtype=np.int64)[rows]


def _rows(m: _Members, table: str, rows: np.ndarray) -> list[dict]:
    """The records at `rows` of `table` as plain dicts, the fields a plan's JSON states: each distinct layout's fields
    decoded once, and shared by the rows of that layout."""
    kinds, fields = COLUMN_KINDS[table], LAYOUTS.get(table, ())
    try:
        columns = {field: _DECODERS[kind](m, f"{table}.{field}", rows) for field, kind in kinds.items() if field not in fields}
        if fields:
            layouts, at = np.unique(_layout_at(m, table, rows), return_inverse=True)
            pick = at.reshape(-1).tolist()
            for field in fields:
                values = _DECODERS[kinds[field]](m, f"{table}.{field}", layouts)
                if len(values) != len(layouts):
                    raise CompactPlanError(f"the {table} layout columns disagree on their length (damaged)")
                shared = m.once(f"{table}.{field}.shared", dict)  # each distinct value one object across chunks
                values = [shared.setdefault(v, v) for v in values]
                columns[field] = [values[k] for k in pick]
    except IndexError:
        raise CompactPlanError(f"the {table} columns are shorter than the header's count (truncated or damaged)") from None
    if any(len(c) != len(rows) for c in columns.values()):
        raise CompactPlanError(f"the {table} columns disagree on their length (damaged)")
    return [dict(zip(kinds, values)) for values in zip(*(columns[f] for f in kinds))]


def _header(m: _Members) -> dict:
    """The file's header, checked (once per open file)."""
    return m.once("header", lambda: _read_header(m))


def _read_header(m: _Members) -> dict:
    header = m.text("header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CompactPlanError(f"its header names format {header.get('format') if isinstance(header, dict) else None!r}, not {FORMAT!r}")
    if header.get("format_version") != FORMAT_VERSION:
        raise CompactPlanError(f"compact format version {header.get('format_version')!r}; this reads version {FORMAT_VERSION}")
    if not isinstance(header.get("plan"), dict) or not isinstance(header.get("counts"), dict):
        raise CompactPlanError("its header lacks the plan's fields")
    return header


CHUNK_ROWS = 65_536  # rows decoded at a time: a chunk's plain dicts are dropped once its records are made


INDEX_MEMBERS = ("index.devices", "index.first", "index.rows", "index.rows.wide", "index.offsets", "index.first_tags")


def index_fault(m: _Members, count: int, counts: list[int], tensors: list[int]) -> str | None:
    """The first `index.*` member that is not what `compact_arrays` writes for the operations table (their device
    columns, and `counts` tags owned by each of the `count` operations, of tensors `tensors`: `op_kinds.number_tags`);
    None when the stored index is that one. A rank reads its part through the index alone, so it must be the one the
    table that `verify` checks gives."""
    fields = (*DEVICE_FIELDS, "layout")  # the layouts' devices, and each row's layout
    columns = {name: m.get(name) for name in m.where if name.split(".")[:2] in (["operations", f] for f in fields)}
    try:
        want = _device_index(columns, count)
    except (KeyError, ValueError, IndexError):
        return "index.rows"
    first, tags = number_tags(counts, tensors)
    want["index.first_tags"] = np.array([*first, tags], dtype=np.int64)
    return next((name for name in INDEX_MEMBERS if name not in m or not np.array_equal(m.get(name), want[name])), None)


def _check_index(m: _Members, operations: list) -> None:
    """Refuse (CompactPlanError naming the member) a stored index other than the one the operations table gives; first
    chunks so many that the plan's message tags pass what the index's 64-bit integers count; where they differ, an
    operation's tensor index above any problem's tensors is named as the fault."""
    counts = [tags_used(op) for op in operations]
    if sum(counts) > np.iinfo(np.int64).max:
        most = max(range(len(counts)), key=counts.__getitem__)
        raise CompactPlanError(f"member operations.chunks.npy gives operation {operations[most].id} {operations[most].chunks:,} "
                               f"chunks, and the plan more message tags than 64-bit integers count {_DAMAGED}")
    name = index_fault(m, len(operations), counts, [op.tensor or 0 for op in operations])
    far = next((op for op in operations if (op.tensor or 0) >= MAX_TENSORS), None) if name is not None else None
    if far is not None:
        raise CompactPlanError(f"member operations.tensor.npy gives operation {far.id} tensor {far.tensor:,}, above any "
                               f"problem's {MAX_TENSORS:,} tensors, and its index is not the one its operations give {_DAMAGED}")
    if name is not None:
        raise CompactPlanError(f"member {name}.npy is not the index its operations table gives (tampered or damaged), "
                               "so a rank would run other operations than the plan's; recompile the plan, or write it "
                               "again from its JSON plan with `xmesh-plan export`")


def read_compact_data(path: str | os.PathLike, records: dict[str, Callable[[list[dict], bool], Any]] | None = None) -> dict:
    """The plan in `path` as the data its JSON states (validated by the caller), each table's rows made into records by
    `records[table](rows, integral)` a chunk at a time where given (plain dicts otherwise; `integral`: the table's
    integers are stored as integers, `stores_integers`); CompactPlanError otherwise. With records
    of the operations, the file's per-device index is rebuilt from them (`compact_arrays` writes it so) and a file
    whose stored index differs is refused: what the whole plan's checks pass is what each rank reads of it."""
    m = _Members(path)
    header = _header(m)
    data = dict(header["plan"])
    for table in TABLES:
        count = header["counts"].get(table)
        if not isinstance(count, int) or count < 0:
            raise CompactPlanError(f"its header gives no row count for {table}")
        make = (records or {}).get(table)
        integral = make is not None and stores_integers(m, table)
        data[table] = []
        for start in range(0, count, CHUNK_ROWS):
            rows = _rows(m, table, np.arange(start, min(start + CHUNK_ROWS, count), dtype=np.int64))
            data[table].extend(rows if make is None else make(rows, integral))
    if (records or {}).get("operations") is not None:
        _check_index(m, data["operations"])
    return data


# ---------------------------------------------------------------- columns, for proofs over whole tables


def _flat(array: np.ndarray, what: str) -> np.ndarray:
    """An integer member as int64 (what the record reader's `tolist` gives); refused where that could differ."""
    if array.dtype.kind not in "iu":  # uint64 members are refused on opening (`_Members._locate`)
        raise CompactPlanError(f"member {what}.npy holds {array.dtype}, not integers")
    return np.asarray(array, dtype=np.int64)


def _lengths(m: _Members, name: str, rows: int, values: str) -> np.ndarray:
    """Running offsets of the `rows` lengths of a lengths member that cuts member `values`."""
    _flat(m.get(name), name)
    if m.get(name).shape != (rows,):
        raise CompactPlanError(f"member {name}.npy is not {rows} lengths")
    return _offsets(m, name, values)


def _values(m: _Members, name: str, offsets: np.ndarray) -> np.ndarray:
    values = _flat(m.get(name), name)
    if values.shape != (int(offsets[-1]),):
        raise CompactPlanError(f"member {name}.npy has {values.shape} values, its lengths {int(offsets[-1])}")
    return values


def _column(m: _Members, name: str, kind: str, count: int) -> dict[str, Any]:
    """One field's column as flat arrays: `values` (int64, float64 or string codes), with `none` (int?), `names`
    (str), `offsets` (running, per row: ints, box, and the rows of boxes and intss), box values as (start, stop)
    pairs, `boxes` (box, boxes: indices into the shared box table), `inner` (intss: running offsets per list)."""
    if kind == "float":
        if f"{name}.at" in m:
            _flat(m.get(f"{name}.at"), f"{name}.at")
        values = _floats(m, name, slice(None))
        if values.shape != (count,):
            raise CompactPlanError(f"member {name}.npy is not {count} numbers")
        return {"values": values}
    if kind in ("int", "int?", "str"):
        values = _flat(m.get(name), name)
        none = np.zeros(count, dtype=bool)
        if kind == "int?" and f"{name}.none" in m:
            none = np.asarray(m.get(f"{name}.none"), dtype=bool)
            if none.shape != (count,):
                raise CompactPlanError(f"member {name}.none.npy is not {count} flags")
        _stored_count(m, name, none)
        out: dict[str, Any] = {"values": values}
        if kind == "int?":  # as a full column: 0 where a row has none
            out["values"], out["none"] = np.zeros(count, dtype=np.int64), none
            out["values"][~none] = values
        if kind == "str":
            out["names"] = _names(m, name)
            if count and not 0 <= values.min() <= values.max() < len(out["names"]):
                raise CompactPlanError(f"member {name}.npy names a string its table lacks")
        return out
    if kind == "box":
        table, pairs = _box_table(m)
        at = _flat(m.get(name), name)
        if at.shape != (count,):
            raise CompactPlanError(f"member {name}.npy is not {count} box indices")
        at = _indices(m, name, slice(None), len(table) - 1)
        dims = np.diff(table)[at]
        offsets = np.concatenate(([0], np.cumsum(dims)))
        _, flat = row_ranges(table, at)
        return {"offsets": offsets, "values": pairs[flat], "boxes": at}
    offsets = _lengths(m, f"{name}.lengths", count, f"{name}.inner" if kind == "intss" else f"{name}.values")
    if kind == "boxes":  # parts: indices into the shared box table (`box_table`), checked
        boxes = _indices(m, f"{name}.values", slice(None), len(_box_table(m)[0]) - 1)
        _values(m, f"{name}.values", offsets)
        return {"offsets": offsets, "boxes": boxes}
    if kind == "intss":  # needers: lists per row (`offsets`), integers per list (`inner`), checked
        inner = _lengths(m, f"{name}.inner", int(offsets[-1]), f"{name}.values")
        return {"offsets": offsets, "inner": inner, "values": _values(m, f"{name}.values", inner)}
    return {"offsets": offsets, "values": _values(m, f"{name}.values", offsets)}


def _per_row(column: dict[str, Any], kind: str, layout: np.ndarray) -> dict[str, Any]:
    """A column of kind `kind` of the layouts (`_column`) as the column of the rows whose layouts are `layout`."""
    out = dict(column)
    if "offsets" not in column:  # one value per row: int, int?, str, float
        out["values"] = column["values"][layout]
        if "none" in column:
            out["none"] = column["none"][layout]
        return out
    lengths, flat = row_ranges(column["offsets"], layout)  # a row's entries: box pairs, boxes, integers or lists
    out["offsets"] = np.concatenate(([0], np.cumsum(lengths)))
    if kind == "box":  # the pairs of each row's box, and its index in the shared table
        out["values"], out["boxes"] = column["values"][flat], column["boxes"][layout]
    elif kind == "boxes":
        out["boxes"] = column["boxes"][flat]
    elif kind == "intss":  # each row's lists, each list's integers
        inner, values = row_ranges(column["inner"], flat)
        out["inner"], out["values"] = np.concatenate(([0], np.cumsum(inner))), column["values"][values]
    else:
        out["values"] = column["values"][flat]
    return out


@dataclass(frozen=True)
class CompactColumns:
    """A compact plan as whole columns, for a proof over every row at once (`planner.verify_columns`): the plan's
    fields less its tables (`fields`), the row counts, each table's columns (`_column`), and the file, whose
    `host_order` and chosen operations a caller reads as records (`host_order_rows`, `operation_rows`)."""

    fields: dict
    counts: dict[str, int]
    tables: dict[str, dict[str, dict[str, Any]]]
    members: _Members

    def host_order_rows(self) -> list[dict]:
        return _rows(self.members, "host_order", np.arange(self.counts["host_order"], dtype=np.int64))

    def operation_rows(self, rows: np.ndarray) -> list[dict]:
        """The operations at `rows` as plain dicts (what `read_compact_data` gives for them)."""
        return _rows(self.members, "operations", rows)

    def box_table(self) -> tuple[np.ndarray, np.ndarray]:
        """The shared box table: (offsets of each box's (start, stop) pairs, the pairs as an (n, 2) int64 array)."""
        return _box_table(self.members)


def read_compact_columns(path: str | os.PathLike, keep: dict[str, set[str]],
                         wanted: Callable[[dict], bool] = lambda fields: True) -> CompactColumns | None:
    """The columns of the tasks and operations of the compact plan in `path`, every one checked to be what the record
    reader reads as integers, numbers, known strings and whole rows (CompactPlanError otherwise); those named in
    `keep` (table -> fields) are returned, the others dropped once checked. None, with no column read, where
    `wanted` of the plan's fields less its tables (its header's) is false."""
    m = _Members(path)
    header = _header(m)
    if not wanted(header["plan"]):
        return None
    counts = header["counts"]
    if not all(isinstance(counts.get(t), int) and counts[t] >= 0 for t in TABLES):
        raise CompactPlanError("its header gives no row count for a table")
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for table in ("tasks", "operations"):
        tables[table] = {}
        layouts = layout_count(m, table)
        layout = _layout_at(m, table, slice(None))
        if layout.shape != (counts[table],):
            stated = "is missing" if f"{table}.layout" not in m else f"is not {counts[table]} layout indices"
            raise CompactPlanError(f"member {table}.layout.npy {stated}")
        for field, kind in COLUMN_KINDS[table].items():
            if field in LAYOUTS[table]:  # checked over the layouts, then stated per row
                column = _column(m, f"{table}.{field}", kind, layouts)
                column = _per_row(column, kind, layout) if field in keep.get(table, ()) else column
            else:
                column = _column(m, f"{table}.{field}", kind, counts[table])
            if field in keep.get(table, ()):
                tables[table][field] = column
    return CompactColumns(header["plan"], {t: counts[t] for t in TABLES}, tables, m)


@dataclass(frozen=True)
class DeviceOps:
    """What one device needs of a plan to run its part: the plan's problem and schema version, the operations it
    takes part in (execution order), their rows in the plan's operation list, the message tag each one's first
    message gets when the whole plan is numbered (`op_kinds.first_tags`, as the executor's lowering does), the
    tags the whole plan uses, and the staging the plan states (`Plan.staging`, None when it states none)."""

    schema_version: int
    problem: Any
    operations: tuple
    rows: tuple[int, ...]
    first_tags: tuple[int, ...]
    tags: int
    staging: Any = None
    shared: frozenset[int] = frozenset()  # ids of these operations whose bundle shares its message with another (`shared_ids`)


def shared_ids(operations, rows, carrier_after) -> frozenset[int]:
    """The ids of `operations` (at plan rows `rows`) that ride in a shared message of two or more bundles
    (`schemas.carriers`): those with a carrier, and those the next plan row names as its carrier (`carrier_after(rows)`:
    the carrier of the row after each of `rows`, None past the end), which a device holding or needing only the first
    bundle of a group cannot tell from its own operations."""
    heads = [k for k, op in enumerate(operations) if op.carrier is None and op.kind == "bundle"]
    after = carrier_after([rows[k] + 1 for k in heads]) if heads else []
    return frozenset([op.id for op in operations if op.carrier is not None]
                     + [operations[k].id for k, nxt in zip(heads, after) if nxt == operations[k].id])


def device_rows(m: _Members, device: int | None) -> np.ndarray:
    """The rows of the operations `device` takes part in, read through the index (none for None)."""
    if device is None:
        return np.zeros(0, dtype=np.int64)
    devices = m.get("index.devices")
    at = int(np.searchsorted(devices, device))
    if at >= len(devices) or int(devices[at]) != device:
        return np.zeros(0, dtype=np.int64)
    start, stop = (int(k) for k in m.get("index.offsets")[at:at + 2])
    stored = m.get("index.rows")
    steps = np.asarray(stored[start:stop], dtype=np.int64)
    every = _wide_steps(m)
    wide = np.flatnonzero(steps == WIDE_STEP)
    if len(wide):  # the next entries of index.rows.wide, after those of the devices before
        before = int(np.count_nonzero(np.asarray(stored[:start]) == WIDE_STEP))
        steps[wide] = every[before:before + len(wide)]
    return int(m.get("index.first")[at]) + np.cumsum(steps)  # stored as steps from the device's first row


def _wide_steps(m: _Members) -> np.ndarray:
    """`index.rows.wide` as int64, checked to be what `_device_index` writes: integers, each 255 or more, one per
    255 marker of `index.rows` (once per file; a rank reads its steps through it)."""
    def make() -> np.ndarray:
        markers = int(np.count_nonzero(np.asarray(m.get("index.rows")) == WIDE_STEP))
        if "index.rows.wide" not in m and not markers:
            return np.zeros(0, dtype=np.int64)
        stored = m.get("index.rows.wide")
        if stored.dtype.kind not in "iu" or stored.shape != (markers,) or (markers and int(stored.min()) < WIDE_STEP):
            raise CompactPlanError(f"member index.rows.wide.npy is not {markers} integer steps of {WIDE_STEP} or more, "
                                   f"one per {WIDE_STEP} in index.rows (damaged)")
        return np.asarray(stored, dtype=np.int64)
    return m.once("index.rows.wide", make)


def stores_integers(m: _Members, table: str) -> bool:
    """Whether every integer column of `table` (and the shared box table) is stored as integers, so that every value
    read of it is a Python int (what a record's strict integer fields take; a float or bool array reads otherwise)."""
    def integral(name: str) -> bool:
        field, _, part = name.removeprefix(f"{table}.").partition(".")
        return COLUMN_KINDS[table].get(field) == "float" or part in ("none", "names") or m.where[name][0].kind in "iu"
    return all(integral(name) for name in m.where if name.startswith(f"{table}.")) \
        and all(m.where[name][0].kind in "iu" for name in ("boxes.dims", "boxes.values") if name in m)


_HEADERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # open file -> its checked header, less the problem


def read_device_data(path, device: int | None, problem: bool = True) -> tuple[dict, list[dict], np.ndarray, list[int], int, bool, Callable]:
    """(the plan's fields less its tables, the operations `device` takes part in as plain dicts, their rows, their
    first message tags, the plan's tags, whether the file stores its operations' integers as integers:
    `stores_integers`, and a function giving the carrier of given rows, for `shared_ids`) of the file at `path` or
    open as `path` (`_Members`). `problem=False`: the fields may leave the problem out; of a file open as `path` whose
    header was read before, the header is not parsed again (a large problem's is megabytes of JSON)."""
    m = _Members(path)
    opened = hasattr(path, "fileno")
    kept = None if problem or not opened else _HEADERS.get(path)
    if kept is not None:
        m.memo["header"] = kept
    header = _header(m)
    if opened and kept is None:
        _HEADERS[path] = {**header, "plan": {k: v for k, v in header["plan"].items() if k != "problem"}}
    rows = device_rows(m, device)
    tags = m.get("index.first_tags")
    count = header["counts"].get("operations")
    if not isinstance(count, int) or len(tags) != count + 1:
        raise CompactPlanError("index.first_tags does not match the operations' count (damaged)")
    def carrier_after(after: list[int]) -> list:
        inside = np.asarray([r for r in after if r < count], dtype=np.int64)
        found = iter(_decode_optional_int(m, "operations.carrier", inside) if len(inside) else [])
        return [next(found) if r < count else None for r in after]

    return (header["plan"], _rows(m, "operations", rows), rows, np.asarray(tags[rows]).tolist(), int(tags[-1]),
            stores_integers(m, "operations"), carrier_after)
