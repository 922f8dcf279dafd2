"""What if the links shared bandwidth by another rule? Re-predict saved emulated-cluster runs with the simulator's
max-min fair sharing swapped for a first-come rule, and count the plans within 10% of measured under each.

    PYTHONPATH=$PWD .venv/bin/python -m bench.netlab.sharing bench/results/netlab-device-500-64mb-plancpu-s10.json

Rules (each prediction with the CPU model, `predict.TESTBED_CPU`, as `repredict`'s "CPU model" column):
- `max-min`: the simulator's own (`simulate.max_min_rates`);
- `first-come-send`: a NIC's send side serves its messages one at a time, oldest first (then in plan order), the next
  one taking what the first leaves (water-filling); receive sides and CPUs share max-min;
- `first-come-send-small`: the same for messages of at most `--small-mib`, larger ones sharing max-min;
- `first-come-send-short`: the same for messages of at most `--short-ms` of their send side's rate, longer ones
  sharing max-min (a threshold in time, not bytes: the same at every link rate);
- `first-come-all`: every NIC side serves its messages oldest first (then in plan order); CPUs share max-min.
An experiment, not a model: the simulator keeps max-min (BENCHMARKS.md, "Emulated cluster ..." sessions 11 and 12).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path

from xmesh_plan.planner import simulate
from xmesh_plan.planner.simulate import Flow, max_min_rates

from .predict import TESTBED_CPU, predictions
from .repredict import WITHIN, repredicted

RULES = ("max-min", "first-come-send", "first-come-send-small", "first-come-send-short", "first-come-all")


class FirstCome:
    """Rates where the NIC sides in `sides` ("send", or "send" and "recv") serve their messages oldest first, the
    messages of at most `small` bytes only, or of at most `short_s` seconds at their send side's rate (None: all);
    an instance lives for one simulation (it remembers when each flow first asked for a rate, which is when it started)."""

    def __init__(self, sides: tuple[str, ...], small: float | None = None, short_s: float | None = None):
        self.sides, self.small, self.short_s = sides, small, short_s
        self.first_seen: dict[int, tuple[int, int]] = {}
        self.calls = itertools.count()

    def queued_on(self, f: Flow, capacity: dict[str, float]) -> list[str]:
        """The NIC sides on which `f` waits its turn."""
        if self.small is not None and f.nbytes > self.small:
            return []
        sides = [link for link in f.links if link.startswith("h") and link.split(".")[1].split(":")[0] in self.sides]
        if self.short_s is not None and any(f.nbytes > self.short_s * capacity[link] for link in sides):
            return []
        return sides

    def __call__(self, active: list[Flow], capacity: dict[str, float]) -> dict[int, float]:
        call = next(self.calls)
        for f in active:
            self.first_seen.setdefault(f.id, (call, f.id))
        order = sorted(active, key=lambda f: self.first_seen[f.id])
        left = {link: capacity[link] for f in active for link in f.links}
        waits = {f.id: self.queued_on(f, capacity) for f in active}
        line: dict[str, list[int]] = {}
        for f in order:
            for link in waits[f.id]:
                line.setdefault(link, []).append(f.id)
        rate = {f.id: 0.0 for f in active}
        frozen: set[int] = set()
        while True:  # raise every flow at the head of all its lines together until a link fills; freeze that link's flows
            heads = [f for f in order if f.id not in frozen
                     and all(next(i for i in line[link] if i not in frozen) == f.id for link in waits[f.id])]
            if not heads:
                break
            users: dict[str, int] = {}
            for f in heads:
                for link in f.links:
                    users[link] = users.get(link, 0) + 1
            step = min(left[link] / n for link, n in users.items())
            full = set()
            for link, n in users.items():
                left[link] -= step * n
                if left[link] <= 1e-9 * capacity[link]:
                    full.add(link)
            for f in heads:
                rate[f.id] += step
            frozen |= {f.id for f in active if any(link in full for link in f.links)}
        return {i: max(r, 1e-9) for i, r in rate.items()}  # a flow the water-filling left at 0 still ends, if late


@contextlib.contextmanager
def sharing(rule: str, small_mib: float = 2.0, short_ms: float = 20.0):
    """The simulator sharing links by `rule` inside the block (a fresh rule per simulation)."""
    if rule not in RULES:
        raise ValueError(f"unknown sharing rule {rule!r}; choose one of: {', '.join(RULES)}")
    if rule == "max-min":
        yield
        return
    sides = ("send", "recv") if rule == "first-come-all" else ("send",)
    small = small_mib * 2**20 if rule == "first-come-send-small" else None
    short = short_ms / 1e3 if rule == "first-come-send-short" else None
    run_flows = simulate.run_flows

    def fresh(*args, **kwargs):
        simulate.max_min_rates = FirstCome(sides, small, short)
        return run_flows(*args, **kwargs)

    simulate.run_flows = fresh
    try:
        yield
    finally:
        simulate.run_flows, simulate.max_min_rates = run_flows, max_min_rates


def priced_by(rule: str, small_mib: float = 2.0, short_ms: float = 20.0):
    """`predict.predictions` with the links shared by `rule` (the planner, which also simulates, is left alone)."""
    def predict(plan, rate_mbit, cpu=None):
        with sharing(rule, small_mib, short_ms):
            return predictions(plan, rate_mbit, cpu)
    return predict


def compare(paths: list[Path], rules: tuple[str, ...] = RULES, small_mib: float = 2.0, show: float = 0.02,
            short_ms: float = 20.0) -> str:
    """Per results file and rule, the plans within 10% of measured; then each plan some rule moves by `show` or more."""
    lines = []
    for path in paths:
        rows = {}
        for rule in rules:  # the plans are made as they were for the run (max-min); only their pricing follows the rule
            rows[rule] = repredicted(path, TESTBED_CPU, priced_by(rule, small_mib, short_ms))
        base = rows[rules[0]]
        lines.append(f"{path.name}: " + ", ".join(
            f"{rule} {sum(abs(r['measured'] / r['cpu'] - 1) <= WITHIN for r in rows[rule])} of {len(base)}" for rule in rules))
        lines += ["", "| case | Mbit/s | approach | measured ms | " + " | ".join(f"{rule}: meas/model" for rule in rules) + " |",
                  "|---|---|---|---|" + "---|" * len(rules)]
        for k, r in enumerate(base):
            ratios = [r["measured"] / rows[rule][k]["cpu"] for rule in rules]
            if max(ratios) - min(ratios) >= show:
                lines.append(f"| {r['case']} | {r['rate']:g} | {r['approach']} | {r['measured'] * 1e3:.0f} | "
                             + " | ".join(f"{q:.3f}" for q in ratios) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.netlab.sharing", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results JSON files of bench.netlab.experiments")
    parser.add_argument("--small-mib", type=float, default=2.0, help="first-come-send-small: messages of at most this many MiB wait their turn")
    parser.add_argument("--short-ms", type=float, default=20.0,
                        help="first-come-send-short: messages of at most this many ms at their send side's rate wait their turn")
    parser.add_argument("--rules", default=",".join(RULES), help="comma-separated, from: " + ", ".join(RULES))
    args = parser.parse_args(argv)
    rules = tuple(r.strip() for r in args.rules.split(","))
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        parser.error(f"--rules: unknown {', '.join(unknown)}; choose from {', '.join(RULES)}")
    for name in ("small_mib", "short_ms"):
        if not 0 < getattr(args, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name):g}: give a positive number")
    show = 0.02 if len(rules) > 1 else -1.0  # one rule: list every plan (there is no spread between rules to show)
    print(compare(args.results, rules, small_mib=args.small_mib, show=show, short_ms=args.short_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
