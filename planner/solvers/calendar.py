"""Busy intervals per resource, and the earliest gap where a task fits on all of its resources.

Intervals on one resource never overlap, so their starts and ends are both sorted and a bisect on
the ends finds the first interval that could collide with a candidate start. Touching intervals are
merged into one busy block, so a packed resource costs one jump, not one per task on it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from ..scheduling import Resource

EPS = 1e-12


class Calendar:
    """Per resource, the sorted busy intervals placed so far."""

    def __init__(self) -> None:
        self._starts: dict[Resource, list[float]] = {}
        self._ends: dict[Resource, list[float]] = {}

    def earliest_start(self, resources: frozenset[Resource], duration: float, not_before: float = 0.0) -> float:
        """The earliest t >= not_before with [t, t + duration) free on every resource."""
        t = not_before
        ends_of, starts_of = self._ends, self._starts
        moved = True
        while moved:
            moved = False
            for r in resources:
                ends = ends_of.get(r)
                if not ends:
                    continue
                i = bisect_right(ends, t + EPS)  # first interval ending after t
                if i < len(ends) and starts_of[r][i] < t + duration - EPS:
                    t, moved = ends[i], True
        return t

    def book(self, resources: frozenset[Resource], start: float, duration: float) -> None:
        for r in resources:
            self._book_one(self._starts.setdefault(r, []), self._ends.setdefault(r, []), start, start + duration)

    @staticmethod
    def _book_one(starts: list[float], ends: list[float], begin: float, end: float) -> None:
        """Insert [begin, end) into the blocks, merging with a block that ends at begin or starts at end."""
        i = bisect_left(starts, begin)
        if i > 0 and ends[i - 1] >= begin - EPS:
            i -= 1
            begin = starts[i]
            del starts[i], ends[i]
        if i < len(starts) and starts[i] <= end + EPS:
            end = max(end, ends[i])
            del starts[i], ends[i]
        starts.insert(i, begin)
        ends.insert(i, end)
