"""Read a file a user names as UTF-8 text and parse it as JSON or TOML, every failure one line.

Text that is not UTF-8, a device such as /dev/zero, a folder, nesting deeper than Python's
recursion limit and integers of thousands of digits all become a `DataFileError` naming the file.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 256 * 2**20  # far above any problem, pipeline, schedule or plan; stops /dev/zero


class DataFileError(ValueError):
    """A file that cannot be read or parsed; the message names the file and says what to do."""


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The file's text (UTF-8, a leading byte-order mark dropped), or a DataFileError naming `what` it should be."""
    try:
        with open(_existing_or_example(path), "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise DataFileError(f"{path}: cannot read the {what} ({err.strerror or err}); check the path") from None
    if len(data) > MAX_FILE_BYTES:
        raise DataFileError(f"{path}: more than {MAX_FILE_BYTES // 2**20} MiB; this is not a {what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataFileError(f"{path}: not a text file (not UTF-8 at byte {err.start}); pass a {what} saved as UTF-8 JSON or TOML") from None


def _existing_or_example(path: str | os.PathLike) -> str | os.PathLike:
    """`path`, or the shipped copy of a documented example (`plans/case3.problem.json`) it names when absent."""
    if os.path.exists(path):
        return path
    from xmesh_plan.examples import shipped_example  # the front package; it imports nothing else

    return shipped_example(path) or path


def parse_data(text: str, path: str | os.PathLike, toml: bool = False) -> Any:
    """JSON (or TOML) text as plain data; syntax errors, absurd nesting and huge integers name the file."""
    kind = "TOML" if toml else "JSON"
    try:
        return tomllib.loads(text) if toml else json.loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors too
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).splitlines()[0][:200]
        if "integer string conversion" in reason:  # Python's own advice (set_int_max_str_digits) is not the user's fix
            reason = "an integer of thousands of digits"
        raise DataFileError(f"{path}: not valid {kind} ({reason}); fix the syntax") from None


def read_data_file(path: str | os.PathLike, what: str) -> Any:
    """Parse a `.toml` file as TOML and anything else as JSON; every failure is a one-line DataFileError."""
    return parse_data(read_text_file(path, what), path, toml=Path(path).suffix == ".toml")
