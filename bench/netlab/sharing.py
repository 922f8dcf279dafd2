"""What if the links shared bandwidth by another rule? Re-predict saved emulated-cluster runs with the links shared by
each rule in turn, and count the plans within 10% of measured under each.

    .venv/bin/python -m bench.netlab.sharing bench/results/netlab-mpi-device-500-32mb.json

Rules (each prediction with the CPU model, `predict.TESTBED_CPU`, as `repredict`'s "CPU model" column); each rule
but `testbed` applies under every queueing:
- `testbed`: the testbed's model, `predict.TESTBED_SHARING` (first-come-send-short at `predict.TESTBED_SHORT_MS` in
  device order, max-min in posted order), which `repredict` and `experiments` price with;
- `max-min`: the simulator's own (`simulate.max_min_rates`);
- `first-come-send`: a NIC's send side serves its messages one at a time, oldest first (then in plan order), the next
  one taking what the first leaves (water-filling); receive sides and CPUs share max-min;
- `first-come-send-small`: the same for messages of at most `--small-mib`, larger ones sharing max-min;
- `first-come-send-short`: the same for messages of at most `--short-ms` of their send side's rate, longer ones
  sharing max-min (a threshold in time, not bytes: the same at every link rate);
- `first-come-all`: every NIC side serves its messages oldest first (then in plan order); CPUs share max-min.
`--send-buffer-mib B` also ends every send in device order, for its device's next run, once at most B MiB of it is
left to go, as gloo ends a send when the socket's buffer has taken the rest (`planner.simulate.simulate(send_buffer_bytes=)`),
where the model otherwise ends it as the MPI engine does (the torch engine without receipts ends its sends so;
`experiments --no-receipts` runs it that way); posted order has no runs to end.
docs/netlab.md, "How TCP shares a link", has what each rule fits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import click

from xmesh_plan.planner.simulate import ShareRule

from .cli import options, parse, usage_error
from .first_come import FirstCome
from .predict import QUEUEINGS, TESTBED_CPU, TESTBED_SHARING, TESTBED_SHORT_MS, predictions
from .repredict import WITHIN, repredicted

RULES = ("testbed", "max-min", "first-come-send", "first-come-send-small", "first-come-send-short", "first-come-all")


def rule_table(rule: str, small_mib: float = 2.0, short_ms: float = TESTBED_SHORT_MS) -> Mapping[str, Callable[[], ShareRule]]:
    """`predict.predictions`' `sharing` for `rule`: the same rule under every queueing (`testbed`: predict's own table)."""
    if rule not in RULES:
        raise ValueError(f"unknown sharing rule {rule!r}; choose one of: {', '.join(RULES)}")
    if rule == "testbed":
        return TESTBED_SHARING
    if rule == "max-min":
        return {}
    sides = ("send", "recv") if rule == "first-come-all" else ("send",)
    small = small_mib * 2**20 if rule == "first-come-send-small" else None
    short = short_ms / 1e3 if rule == "first-come-send-short" else None
    return dict.fromkeys(QUEUEINGS, lambda: FirstCome(sides, small, short))


def priced_by(rule: str, small_mib: float = 2.0, short_ms: float = TESTBED_SHORT_MS,
              send_buffer_mib: float | None = None) -> Callable[..., dict[str, float]]:
    """`predict.predictions` with the links shared by `rule` and sends ending as `send_buffer_mib` says (None: as the
    MPI engine's); the plans are made as the planner makes them."""
    table = rule_table(rule, small_mib, short_ms)
    buffer = None if send_buffer_mib is None else send_buffer_mib * 2**20

    def predict(plan, rate_mbit, cpu=None):
        return predictions(plan, rate_mbit, cpu, table, buffer)
    return predict


def compare(paths: list[Path], rules: tuple[str, ...] = RULES, small_mib: float = 2.0, show: float = 0.02,
            short_ms: float = TESTBED_SHORT_MS, send_buffer_mib: float | None = None) -> str:
    """Per results file and rule, the plans within 10% of measured; then each plan some rule moves by `show` or more."""
    lines = []
    for path in paths:
        rows = {}
        for rule in rules:  # the plans are made as they were for the run (max-min); only their pricing follows the rule
            rows[rule] = repredicted(path, TESTBED_CPU, priced_by(rule, small_mib, short_ms, send_buffer_mib))
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


@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--small-mib", type=float, default=2.0, show_default=True,
              help="first-come-send-small: messages of at most this many MiB wait their turn")
@click.option("--short-ms", type=float, default=TESTBED_SHORT_MS, show_default=True,
              help="first-come-send-short: messages of at most this many ms at their send side's rate wait their turn "
                   "(the testbed rule keeps its own, predict.TESTBED_SHORT_MS)")
@click.option("--rules", default=",".join(RULES), show_default=True, help="comma-separated, from: " + ", ".join(RULES))
@click.option("--send-buffer-mib", type=float, default=None,
              help="end a send once at most this many MiB of it are left to go, as gloo does (default: as the MPI engine)")
@options
def _command(**_):
    """Re-predict saved runs with the links shared by each rule (RESULTS: results JSON files of bench.netlab.experiments)."""


def main(argv=None) -> int:
    prog = "python -m bench.netlab.sharing"
    args = parse(_command, argv, prog)
    rules = tuple(r.strip() for r in args.rules.split(","))
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        usage_error(prog, f"--rules: unknown {', '.join(unknown)}; choose from {', '.join(RULES)}")
    for name in ("small_mib", "short_ms", "send_buffer_mib"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) < float("inf"):
            usage_error(prog, f"--{name.replace('_', '-')} {getattr(args, name):g}: give a positive number")
    show = 0.02 if len(rules) > 1 else -1.0  # one rule: list every plan (there is no spread between rules to show)
    print(compare(args.results, rules, small_mib=args.small_mib, show=show, short_ms=args.short_ms, send_buffer_mib=args.send_buffer_mib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
