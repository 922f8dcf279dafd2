"""Command-line flags of the demo commands (`executor.run`, `executor.torch_run`, `redistribute_demo`), parsed by click
without letting click end the process.

These commands run once per rank of a job. Click's own handling of a bad flag (a usage block, then exit) would print
one block per rank and, under MPI, leave the ranks out of the agreement on who refused its input; so `parse` turns a
bad flag into one line (`UsageError`, exit 2) that each command reports as it reports any refused input, and prints
`--help` on one rank only.

>>> @command("A demo with one flag.")
... @click.option("--iters", type=int, default=5)
... def demo(**_):
...     pass
>>> parse(demo, ["--iters", "3"], "demo").iters
3
>>> try:
...     parse(demo, ["--iters", "x"], "demo")
... except UsageError as err:
...     print(err)
Invalid value for '--iters': 'x' is not a valid integer; see `demo --help`
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import SimpleNamespace

import click


MPI_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # where mpiexec (MPICH, Open MPI, PMIx) puts a rank's number
TORCH_RANK = ("RANK",)  # where torchrun puts it


class UsageError(ValueError):
    """A bad command-line value: one line naming the flag (exit 2)."""


def command(help: str, epilog: str | None = None):
    """A click command for a demo (its function only names the flags; `parse` reads them): `-h/--help` prints the help
    on the rank `parse` says, then ends the process with status 0."""

    def make(func):
        func = click.option("-h", "--help", is_flag=True, expose_value=False, is_eager=True, callback=_help,
                            help="show this message and exit")(func)
        return click.command(help=help, epilog=epilog, add_help_option=False)(func)

    return make


def _help(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        if ctx.obj.get("show_help", True):
            click.echo(ctx.get_help())
        ctx.exit()


def parse(cmd: click.Command, argv: Sequence[str] | None, prog: str, show_help: bool = True) -> SimpleNamespace:
    """The flags `argv` (None: this process's arguments) gives `cmd`, by parameter name, or a one-line UsageError that
    points at `prog --help`. `--help` prints the help where `show_help` (one rank of a job) and raises SystemExit(0)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ctx = cmd.make_context(prog, args, obj={"show_help": show_help})
    except click.exceptions.Exit as done:  # --help
        raise SystemExit(done.exit_code) from None
    except click.ClickException as err:
        message = " ".join(err.format_message().split()).rstrip(".")  # one line, whatever the value held
        raise UsageError(f"{message}; see `{prog} --help`") from None
    return SimpleNamespace(**ctx.params)


def launcher_rank(*keys: str) -> int:
    """This process's rank as its launcher set it in the first of the environment variables `keys` that holds a number
    (read before the job's communicator starts); 0 when none does (not under a launcher)."""
    for key in keys:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0
