"""The last-resort handler at the top of every entry point (`xmesh-plan`, `python -m xmesh_plan.executor.run`).

Input errors are reported where they are found (one line, exit 2). Anything that still escapes is a
bug: the user gets one line saying so, naming the exception and how to see the traceback, exit 1.
A full disk or a failing device (`ENVIRONMENT_ERRNOS`, e.g. `> /dev/full`) is the machine's fault, not a
bug: one line saying what could not be written and what to do, exit 1.
`--debug` on the command line or `XMESH_PLAN_DEBUG=1` lets the exception through untouched. Only the
entry functions use it, so tests that call `planner.cli.main` or `executor.run.main` see real
tracebacks.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Sequence

DEBUG_FLAG = "--debug"
DEBUG_ENV = "XMESH_PLAN_DEBUG"
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})
"""OSErrors that say the machine cannot take the output (full disk, quota, device error, file too large)."""


def debug_requested(argv: Sequence[str]) -> bool:
    """True when the user asked for full tracebacks: `--debug` among the arguments or XMESH_PLAN_DEBUG set (not 0)."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "0").strip() not in ("", "0")


def internal_error_line(err: BaseException, program: str) -> str:
    """`internal error: ZeroDivisionError: division by zero; ...`: one line, the exception named, the way to see more."""
    text = " ".join(str(err).split())
    detail = f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__
    return (f"internal error: {detail}; this is a bug in {program}, not in your input. Rerun with {DEBUG_FLAG} "
            f"(or {DEBUG_ENV}=1) to see the traceback, and report it")


def environment_error_line(err: OSError) -> str:
    """`error: cannot write 'out.json' (No space left on device); ...`: one line for an `ENVIRONMENT_ERRNOS` error."""
    from .limits import quoted  # here: the handler itself imports nothing that could fail

    where = "standard output" if err.filename is None else quoted(os.fsdecode(err.filename))
    reason = err.strerror or os.strerror(err.errno or 0)
    return f"error: cannot write {where} ({reason}); free some space or write to another disk"


def run_guarded(entry: Callable[[], int | None], program: str, argv: Sequence[str], prefix: str = "") -> int:
    """Call `entry()` and return its exit code; an escaping exception becomes one line on stderr and exit 1.

    SystemExit passes through (click and argparse exit that way). A closed stdout (`| head`) ends
    quietly; running out of memory says so instead of calling itself a bug.
    """
    if debug_requested(argv):
        return entry() or 0
    try:
        try:
            code = entry() or 0
        finally:
            if sys.stdout is not None and not sys.stdout.closed:
                sys.stdout.flush()  # here, not at exit, so a full disk behind `>` is reported, not lost
        return code
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"{prefix}interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return 141  # as a shell reports a process ended by SIGPIPE
    except OSError as err:
        if err.errno not in ENVIRONMENT_ERRNOS:
            print(prefix + internal_error_line(err, program), file=sys.stderr, flush=True)
            return 1
        _silence_stdout()
        print(prefix + environment_error_line(err), file=sys.stderr, flush=True)
        return 1
    except MemoryError:
        print(f"{prefix}error: out of memory; give a smaller problem or run on a larger machine", file=sys.stderr, flush=True)
        return 1
    except Exception as err:  # noqa: BLE001 - the last resort: anything else is a bug, reported in one line
        print(prefix + internal_error_line(err, program), file=sys.stderr, flush=True)
        return 1


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so Python's exit-time flush does not complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
