"""The executor's errors: each message is one line naming what went wrong and what to do."""

from __future__ import annotations


class ExecutorError(RuntimeError):
    """Base class for everything the executor raises on purpose."""


class PlanMismatchError(ExecutorError):
    """The plan does not fit the running world or the arrays handed to `run()`; nothing was moved.

    `same_on_every_rank` is True when every rank raised this very message (so one of them may report it).
    """

    def __init__(self, message: str, same_on_every_rank: bool = False):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


class PeerTimeoutError(ExecutorError):
    """A transfer passed its deadline: a peer died, hangs, or runs a different plan."""


class BackendUnavailableError(ExecutorError):
    """The requested backend's library or device is missing on this machine."""
