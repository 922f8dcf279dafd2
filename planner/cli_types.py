"""Click parameter types shared by the `xmesh-plan` commands."""

from __future__ import annotations

import math

import click


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
