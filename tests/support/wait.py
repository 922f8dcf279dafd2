"""Waiting on a condition instead of sleeping a guessed time: poll until it holds or a deadline passes.

The deadline only bounds a hang (a loaded CI machine may need far longer than usual); a test never asserts on
how long the wait took.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold before the deadline (an AssertionError, so pytest reports it as a failure)."""


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> T:
    """`condition()`'s first truthy value, polling every `poll_s`; WaitTimeout naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)
