"""The bound on every wait for a peer: `timeout_s` must be a finite number of seconds > 0.

An infinite timeout turns a missing rank into a hang for ever, the very thing it exists to report.

>>> check_timeout(60)
60.0
>>> check_timeout(float("inf"))
Traceback (most recent call last):
...
ValueError: timeout_s=inf must be a finite number of seconds in (0, 1e+07]; it bounds every wait for a peer, so a missing rank is reported instead of waited for for ever
"""

from __future__ import annotations

import numpy as np

MAX_TIMEOUT_S = 1e7  # about 4 months; also keeps deadlines (monotonic() + timeout) and sleeps finite


def is_number(value) -> bool:
    """A real number, not a boolean (numpy scalars included)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_timeout(value, name: str = "timeout_s") -> float:
    """`value` as a float, or ValueError naming `name` unless it is a finite number in (0, MAX_TIMEOUT_S]."""
    if not is_number(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{name}={value!r} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}]; "
                         "it bounds every wait for a peer, so a missing rank is reported instead of waited for for ever")
    return float(value)
