"""Click parameter types shared by the `xmesh-plan` commands."""

from __future__ import annotations

import math

import click

from .unit_tasks import DEFAULT_MAX_TASKS


class PositiveFloat(click.ParamType):
    """A finite number > 0: `nan`, `inf`, 0 and negatives are refused (a NaN ratio would pass every check)."""

    name = "number>0"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number; give a positive number such as 1.1", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"{value!r} must be a finite number > 0, e.g. 1.1", param, ctx)
        return number


POSITIVE = PositiveFloat()


def max_tasks_option(func):
    """`--max-tasks N` for every command that compiles: problems that could cut into more unit tasks are refused."""
    return click.option("--max-tasks", type=click.IntRange(min=1), default=DEFAULT_MAX_TASKS, show_default=True,
                        help="refuse, before cutting, a problem that could give more unit tasks than this "
                             "(memory and time grow with it; see BENCHMARKS.md, 'Task limit')")(func)
