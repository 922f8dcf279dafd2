"""Click parameter types shared by the `xmesh-plan` commands, bounded to what every component they reach accepts."""

from __future__ import annotations

import errno
import math
from pathlib import Path
from typing import Any, Callable

import click

from xmesh_plan.schemas.files import write_atomic
from xmesh_plan.schemas.last_resort import ENVIRONMENT_ERRNOS
from xmesh_plan.schemas.limits import quoted

from .problem_io import InputError
from .unit_tasks import DEFAULT_MAX_TASKS

MAX_SEED = 2**31 - 1  # CP-SAT's random_seed is a 32-bit int
DEFAULT_MAX_ACTIONS = 50_000  # compute actions a schedule lays out: about 1.4 ms each in `schedule` (8 stages x 256 micro-batches: 3.5 s)
MAX_TIME_LIMIT_S = 1e6  # deterministic seconds (about 11 days): a larger budget only means never stopping


class PositiveFloat(click.ParamType):
    """A finite number in (0, most] and at least `least`: `nan`, `inf`, 0 and negatives are refused (a NaN
    ratio would pass every check)."""

    name = "number>0"

    def __init__(self, most: float = math.inf, least: float = 0.0):
        self.most, self.least = most, least

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            self.fail(f"{str(value)[:40]!r} is not a number; give a positive number such as 1.1", param, ctx)
        if not math.isfinite(number) or number <= 0 or number < self.least or number > self.most:
            upto = f" up to {self.most:g}" if math.isfinite(self.most) else ""
            low = f">= {self.least:g}" if self.least > 0 else "> 0"
            self.fail(f"{str(value)[:40]!r} must be a finite number {low}{upto}, e.g. {max(1.1, self.least):g}", param, ctx)
        return number


class Seed(click.ParamType):
    """A random seed 0 .. 2^31-1, the range every solver accepts (CP-SAT's is a 32-bit int)."""

    name = "seed"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 10 and int(text) <= MAX_SEED):
            self.fail(f"{text[:40]!r} is not a seed; give an integer from 0 to {MAX_SEED}, e.g. 0", param, ctx)
        return int(text)


class StagingMB(PositiveFloat):
    """`--max-staging-mb`: a positive number of MiB up to `most`, or 0: no limit (as when none is given)."""

    name = "MiB>=0"

    def convert(self, value, param, ctx):
        try:
            if float(value) == 0:
                return 0.0
        except (TypeError, ValueError, OverflowError):
            pass
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as err:
            self.fail(f"{err.message}; or 0 for no limit", param, ctx)


POSITIVE = PositiveFloat()
TIME_LIMIT = PositiveFloat(MAX_TIME_LIMIT_S)
BUCKET_MB = PositiveFloat(4096, least=0.001)  # --bucket-mb
STAGING_MB = StagingMB(2**20)  # --max-staging-mb
SEED = Seed()


def max_tasks_option(func):
    """`--max-tasks N` for every command that compiles: problems that could cut into more unit tasks are refused."""
    return click.option("--max-tasks", type=click.IntRange(min=1), default=DEFAULT_MAX_TASKS, show_default=True,
                        help="refuse, before cutting, a problem that could give more unit tasks than this "
                             "(memory and time grow with it; see BENCHMARKS.md, 'Task limit')")(func)


def max_actions_option(func):
    """`--max-actions N` for every command that lays out pipeline schedules: larger ones are refused before any work."""
    return click.option("--max-actions", type=click.IntRange(min=1), default=DEFAULT_MAX_ACTIONS, show_default=True,
                        help="refuse, before planning, a pipeline whose schedule would lay out more compute actions than "
                             "this (stages x micro-batches x 3, or x 2 without a split backward; time grows with it)")(func)


# What to do about an output that cannot be written, by the error's number; others get the general advice.
OUTPUT_FIXES = {
    errno.ENXIO: "start the program that reads it first (e.g. `cat` on it), or give a regular file",
    errno.ENOENT: "create its folder first, or give a path in a folder that exists",
    errno.ENOTDIR: "a part of the path is a file, not a folder; give a path through folders",
    errno.EACCES: "pick a file and folder you may write, or change their permissions",
    errno.EPERM: "pick a file and folder you may write, or change their permissions",
    errno.EROFS: "the file system is read-only; give a path on a writable one",
    errno.ELOOP: "a symbolic link on the path leads back to itself; fix or remove the link",
    errno.ENAMETOOLONG: "give a shorter file name",
}


def output_error(err: OSError, path: str, flag: str) -> Exception:
    """What to raise when the output `flag` names cannot be written: the OSError itself where the machine is at
    fault (a full disk: the last-resort handler's one line, exit 1), else a one-line InputError (exit 2)."""
    if err.errno in ENVIRONMENT_ERRNOS:
        return err
    if isinstance(err, IsADirectoryError):
        return InputError(f"{flag}: {quoted(path)} is a folder; give a file name in it")
    fix = OUTPUT_FIXES.get(err.errno, "check that the folder exists and is writable")
    return InputError(f"{flag}: cannot write {quoted(path)} ({err.strerror or err}); {fix}")


def write_output(path: str, data: str | bytes, flag: str, check: Callable[[Path], Any] | None = None) -> None:
    """Write the output file `flag` names (`schemas.files.write_atomic`: never replaces what the path points to;
    `check` is called with the written temporary file before it replaces anything)."""
    try:
        write_atomic(path, data, check)
    except OSError as err:
        raise output_error(err, path, flag) from None
