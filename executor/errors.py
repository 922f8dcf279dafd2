"""The executor's errors: each message is one line naming what went wrong and what to do."""

from __future__ import annotations


class ExecutorError(RuntimeError):
    """Base class for everything the executor raises on purpose."""


class PlanMismatchError(ExecutorError):
    """The plan does not fit the running world or the arrays handed to `run()`; nothing was moved."""


class PeerTimeoutError(ExecutorError):
    """A transfer passed its deadline: a peer died, hangs, or runs a different plan."""


class BackendUnavailableError(ExecutorError):
    """The requested backend's library or device is missing on this machine."""
