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
from typing import Any, Callable

from .limits import quoted

MAX_FILE_BYTES = 256 * 2**20  # far above any problem, pipeline or schedule; stops /dev/zero. Writers refuse plans above it (`check_writable_size`)
MAX_COMPACT_FILE_BYTES = 2 * 2**30
"""The most a compact plan file (`schemas.plan_compact`) may be. A plan of the largest problem compile accepts by
default (`planner.unit_tasks.DEFAULT_MAX_TASKS`, 1,000,000 unit tasks) has at most a few operations per task; at
under 100 bytes per operation with its task where no layout repeats (docs/format.md, 'Compact plans') that is
under 1 GiB: the limit leaves twice that and still stops a runaway file."""


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


def write_atomic(path: str | os.PathLike, data: str | bytes, check: Callable[[Path], Any] | None = None) -> None:
    """Write text or bytes to `path` without ever replacing what the path points to.

    A regular file (or a path that does not exist yet) gets a temporary file in the same folder renamed
    over it, so a failure leaves no partial file; the result keeps the replaced file's permissions (a new
    one gets 0666 less the umask), not the temp file's 0600. A symbolic link stays: the file it points to
    is written so. A file with several names (hard links) keeps them all: every name shows the new bytes, as
    after the shell's `>` (a rename would leave the other names on the old content); the temporary copy is
    written in full first, so a full disk or a failed write is found before the file is touched, and then
    the bytes are written into the file itself (not atomic: readers may see it half written, and a write
    that fails there leaves it so). A device, FIFO or socket is written through in place, as `>` does (a
    FIFO nobody reads is an OSError, not a hang); a folder is an IsADirectoryError. Never unlinks anything
    but its own temporary file. `check`, where given, is called with the temporary file once it holds the bytes
    (for a device or FIFO, a private copy), before anything is replaced: what it raises leaves the target as it
    was."""
    target = Path(os.path.realpath(path))  # through symbolic links: the link stays, its target gets the data
    try:
        found = os.stat(target)
    except FileNotFoundError:
        found = None
    mode = found.st_mode if found is not None else None
    if (mode is not None and stat.S_ISDIR(mode)) or os.fspath(path).endswith(os.sep):  # `out/` names a folder, as `>` reads it
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    raw = data.encode() if isinstance(data, str) else data
    if mode is not None and not stat.S_ISREG(mode):
        if check is not None:
            with tempfile.TemporaryDirectory() as folder:
                copy = Path(folder) / target.name
                _named_error(target, copy.write_bytes, raw)
                check(copy)
        _write_through(target, raw)
        return
    fd, tmp = _named_error(target, tempfile.mkstemp, prefix=f".{_short(target.name)}.", suffix=".tmp", dir=target.parent)
    try:
        _named_error(target, _write_closed, fd, raw)  # a write on a descriptor names no file: name the output
        if check is not None:
            check(Path(tmp))
        if found is not None and found.st_nlink > 1:  # a rename would part this name from the file's other names
            Path(tmp).unlink()
            _write_into(target, raw)
            return
        os.chmod(tmp, 0o666 & ~_UMASK if mode is None else stat.S_IMODE(mode))  # a file replaced keeps its permissions
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_closed(fd: int, data: bytes) -> None:
    """Write `data` to the open descriptor `fd` and close it (its last bytes flushed: a full disk is found here)."""
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _short(name: str, most: int = 200) -> str:
    """`name` cut to at most `most` bytes, so the temporary copy's name (a dot, this, a random part and `.tmp`)
    stays within the 255 bytes a file system takes for any name the file itself may have."""
    return os.fsdecode(os.fsencode(name)[:most])


def _named_error(target: Path, call, *args, **kwargs):
    """`call(*args, **kwargs)`, its OSError naming `target` (the output), not the temporary copy or nothing."""
    try:
        return call(*args, **kwargs)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(target)) from None


def _write_into(target: Path, data: bytes) -> None:
    """Overwrite a regular file's bytes in place (same file, every name and its permissions kept), then cut it to
    the new length."""
    fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC)
    try:
        _write_all(fd, data)
        os.ftruncate(fd, len(data))
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(target)) from None
    finally:
        os.close(fd)


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
        _write_all(fd, data)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(target)) from None
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
