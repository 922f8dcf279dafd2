"""Busy intervals per resource, and the earliest gap where a task fits on all of its resources.

Intervals on one resource never overlap, so their starts and ends are both sorted and a bisect on
the ends finds the first interval that could collide with a candidate start.
"""

from __future__ import annotations

from bisect import bisect_right, insort

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
        moved = True
        while moved:
            moved = False
            for r in resources:
                ends = self._ends.get(r)
                if not ends:
                    continue
                i = bisect_right(ends, t + EPS)  # first interval ending after t
                if i < len(ends) and self._starts[r][i] < t + duration - EPS:
                    t, moved = ends[i], True
        return t

    def book(self, resources: frozenset[Resource], start: float, duration: float) -> None:
        for r in resources:
            insort(self._starts.setdefault(r, []), start)
            insort(self._ends.setdefault(r, []), start + duration)

    def free_at(self, resource: Resource) -> float:
        """When the resource's last booked interval ends (0 when it has none)."""
        ends = self._ends.get(resource)
        return ends[-1] if ends else 0.0
