"""Read a file a user names as UTF-8 text and parse it as JSON or TOML, every failure one line; write
every output file (`write_atomic`) without ever replacing what its path points to.

Text that is not UTF-8, a device such as /dev/zero, a folder, nesting deeper than Python's
recursion limit, integers of thousands of digits and an object naming a key twice all become a
`DataFileError` naming the file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from .limits import quoted

MAX_FILE_BYTES = 256 * 2**20  # far above any problem, pipeline or schedule; stops /dev/zero. Writers refuse plans above it (`check_writable_size`)


class DataFileError(ValueError):
    """A file that cannot be read or parsed; the message names the file and says what to do."""


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The file's text (UTF-8, a leading byte-order mark dropped), or a DataFileError naming `what` it should be."""
    try:
        with open(_existing_or_example(path), "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise DataFileError(f"{quoted(path)}: cannot read the {what} ({err.strerror or err}); check the path") from None
    if len(data) > MAX_FILE_BYTES:
        raise DataFileError(f"{quoted(path)}: more than {MAX_FILE_BYTES // 2**20} MiB, the most a {what} file may be; "
                            "split what it describes into smaller files")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataFileError(f"{quoted(path)}: not a text file (not UTF-8 at byte {err.start}); pass a {what} saved as UTF-8 JSON or TOML") from None


def check_writable_size(text: str, what: str) -> None:
    """Raise DataFileError where `text` is larger than the readers take (MAX_FILE_BYTES), so no writer makes a
    file its own readers refuse."""
    size = len(text.encode())
    if size > MAX_FILE_BYTES:
        raise DataFileError(f"the {what} would be {size / 2**20:,.0f} MiB, above the {MAX_FILE_BYTES // 2**20} MiB its readers take, "
                            "so it was not written; split the problem into smaller transfers")


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
        return tomllib.loads(text) if toml else json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise DataFileError(f"{quoted(path)}: not valid {kind} (the key {quoted(err.args[0])} appears twice in one object; "
                            "only one can count); keep one of them") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors too
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).splitlines()[0][:200]
        if "integer string conversion" in reason:  # Python's own advice (set_int_max_str_digits) is not the user's fix
            reason = "an integer of thousands of digits"
        raise DataFileError(f"{quoted(path)}: not valid {kind} ({reason}); fix the syntax") from None


class _DuplicateKey(Exception):
    """A JSON object names a key twice (json.loads would silently keep the last)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def read_data_file(path: str | os.PathLike, what: str) -> Any:
    """Parse a `.toml` file as TOML and anything else as JSON; every failure is a one-line DataFileError."""
    return parse_data(read_text_file(path, what), path, toml=Path(path).suffix == ".toml")


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask is process-wide, so reading it later races other threads


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write text or bytes to `path` without ever replacing what the path points to.

    A regular file (or a path that does not exist yet) gets a temporary file in the same folder renamed
    over it, so a failure leaves no partial file; the result has the usual permissions (0666 less the
    umask), not the temp file's 0600. A symbolic link stays: the file it points to is written so. A
    device, FIFO or socket is written through in place, as the shell's `>` does (a FIFO nobody reads
    is an OSError, not a hang); a folder is an IsADirectoryError. Never unlinks anything."""
    target = Path(os.path.realpath(path))  # through symbolic links: the link stays, its target gets the data
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if mode is not None and not stat.S_ISREG(mode):
        _write_through(target, data.encode() if isinstance(data, str) else data)
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_through(target: Path, data: bytes) -> None:
    """Write into an existing file that is not a regular file (a device, a FIFO), without creating or truncating
    it: opened non-blocking, so a FIFO with no reader fails at once (ENXIO), then written blocking."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        reason = "a FIFO or socket that nothing reads" if err.errno == errno.ENXIO else err.strerror
        raise OSError(err.errno, reason, str(target)) from None
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(target)) from None
    finally:
        os.close(fd)
