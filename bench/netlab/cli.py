"""The bench.netlab tools' command lines on click, keeping what their callers rely on: `main(argv) -> int`, the
options as attributes of one object, and a usage error as one `Error:` line with exit code 2."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import click


def options(fn):
    """A click command that only declares options and arguments; `parse` reads them."""
    return click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=fn.__doc__)(fn)


def parse(command: click.Command, argv, prog: str) -> SimpleNamespace:
    """`argv` (default: the process's arguments) parsed by `command`; `--help` prints and exits 0, a usage error exits 2."""
    try:
        ctx = command.make_context(prog, list(sys.argv[1:] if argv is None else argv))
    except click.exceptions.Exit as stop:
        raise SystemExit(stop.exit_code) from None
    except click.ClickException as err:
        err.show()
        raise SystemExit(err.exit_code) from None
    return SimpleNamespace(**ctx.params)


def usage_error(prog: str, message: str):
    """Stop as a usage error does: `Usage:` and `Error: message` on stderr, exit code 2."""
    click.echo(f"Usage: {prog} [OPTIONS]\nTry '{prog} --help' for help.\n\nError: {message}", err=True)
    raise SystemExit(2)
