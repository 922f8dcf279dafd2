"""Busy intervals per resource, and the earliest gap where a task fits on all of its resources.

Intervals on one resource never overlap, so their starts and ends are both sorted and a bisect on
the ends finds the first interval that could collide with a candidate start. Touching intervals are
merged into one busy block, so a packed resource costs one jump, not one per task on it. Resources that every
option books together have one calendar (`booked_together`): a broadcast's chain of device ports inside the
receiving host is one resource to the search, not fourteen.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Iterable

from ..scheduling import Resource

EPS = 1e-12


class Calendar:
    """Per resource, the sorted busy intervals placed so far."""

    def __init__(self) -> None:
        self._starts: dict[Resource, list[float]] = {}
        self._ends: dict[Resource, list[float]] = {}

    def earliest_start(self, resources: Iterable[Resource], duration: float, not_before: float = 0.0) -> float:
        """The earliest t >= not_before with [t, t + duration) free on every resource: the resources are asked in
        turn, round and round, each moving t past the interval it collides with, until all of them in a row keep t."""
        t = not_before
        ends_of, starts_of = self._ends, self._starts
        busy = [(ends_of[r], starts_of[r]) for r in resources if r in ends_of]
        kept, k, n = 0, 0, len(busy)
        while kept < n:
            ends, starts = busy[k]
            i = bisect_right(ends, t + EPS)  # first interval ending after t
            if i < len(ends) and starts[i] < t + duration - EPS:
                t, kept = ends[i], 0  # every resource, this one too, is asked again at the new t
            else:
                kept += 1
            k = k + 1 if k + 1 < n else 0
        return t

    def book(self, resources: Iterable[Resource], start: float, duration: float) -> None:
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


def booked_together(resource_sets: Iterable[frozenset[Resource]]) -> dict[frozenset[Resource], tuple[Resource, ...]]:
    """Each distinct resource set as the sorted tuple of its classes' first resources, where a class is the
    resources that are named by exactly the same sets. A schedule books a whole set at once, so the resources of a
    class always carry the same busy intervals: one calendar per class answers for all of them."""
    distinct = list(dict.fromkeys(resource_sets))
    named_by: dict[Resource, list[int]] = {}
    for k, resources in enumerate(distinct):
        for r in resources:
            named_by.setdefault(r, []).append(k)
    first: dict[tuple[int, ...], Resource] = {}
    for r in sorted(named_by):
        first.setdefault(tuple(named_by[r]), r)
    return {resources: tuple(sorted({first[tuple(named_by[r])] for r in resources})) for resources in distinct}
