"""What a long compile or verify is doing, on stderr, through rich: the phase, a bar where the phase counts its
items, and the time so far.

On a terminal one live status line (rich's progress display, redrawn twice a second, gone when done), then
`label: done in N s`. Piped or logged (stderr not a terminal) a short run prints nothing; one that is still
running after `QUIET_S` seconds prints its phase then, each later phase as it starts, one line each, and
`label: done in N s`, so a log of a ten-minute compile says where it was without carriage-return redraws.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

QUIET_S = 3.0  # a piped run shorter than this prints no phase lines


class _Lines:
    """Phase lines for a stderr that is not a terminal: none until `QUIET_S` has passed, then one per phase."""

    def __init__(self, label: str, console: Console):
        self.label, self.console, self.lock = label, console, threading.Lock()
        self.phase, self.loud = "starting", False
        self.timer = threading.Timer(QUIET_S, self.wake)
        self.timer.daemon = True

    def wake(self) -> None:
        with self.lock:
            self.loud = True
            self._print()

    def stage(self, phase: str) -> None:
        with self.lock:
            self.phase = phase
            if self.loud:
                self._print()

    def _print(self) -> None:
        self.console.print(f"{self.label}: {self.phase} ...", highlight=False, markup=False, soft_wrap=True)


@contextmanager
def progress(label: str, done_below_s: float = 0.0):
    """Show `label`'s phases on stderr (see the module docstring). Yields a dict: "stage" takes a phase's name
    (`compile_plan(on_stage=...)`), "count" takes (done, total) of the phase's items (a bar on a terminal), and
    "seconds" holds the elapsed time afterwards. A terminal gets no `done` line for a run under `done_below_s`."""
    tty = sys.stderr.isatty()
    begin = time.perf_counter()
    console = Console(file=sys.stderr, force_terminal=tty)
    bar = Progress(TextColumn("{task.description} ..."), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True, disable=not tty, refresh_per_second=2, console=console)
    task = bar.add_task(label, total=None)
    lines = None if tty else _Lines(label, console)

    def stage(phase: str) -> None:
        bar.update(task, description=f"{label}: {phase}", total=None, completed=0)
        if lines is not None:
            lines.stage(phase)

    timing = {"stage": stage, "count": lambda done, total: bar.update(task, completed=done, total=total)}
    if lines is not None:
        lines.timer.start()
    with bar:
        try:
            yield timing
        finally:
            timing["seconds"] = time.perf_counter() - begin
            if lines is not None:
                lines.timer.cancel()
    if (tty and timing["seconds"] >= done_below_s) or (lines is not None and lines.loud):
        click.echo(f"{label}: done in {timing['seconds']:.2f} s", err=True)
