"""Re-predict saved emulated-cluster runs without the testbed: rebuild each run's plans (deterministic), price them
with today's model, with and without a model of the shared CPU (`Cluster.cpu`), and count the fits per case.

    .venv/bin/python -m bench.netlab.repredict bench/results/netlab-mpi-device-500-32mb.json \\
        bench/results/netlab-mpi-device-200-16mb.json [--cores 2 --copy-gbps 24 --message-us 0]

A distinct plan of a launch counts once (as `summary.compact` counts); "saved" is the prediction stored in the file,
"today" this checkout's model without the CPU, "CPU model" with it (defaults: `predict.TESTBED_CPU`); both share the
links as the testbed does (`predict.TESTBED_SHARING`; a file whose saved predictions share device order max-min, as
some archived ones do, then differs from "today" on case 4's solver plans: 0.80-0.88x "saved", about 0.97x "today"). The plans are rebuilt with this checkout's planner, so a file made with
another version may get other plans; compare "saved" with "today" to see.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from xmesh_plan.schemas import Cpu
from xmesh_plan.schemas.validation import describe_validation_error

from .cli import options, parse, usage_error
from .experiments import _plans
from .predict import TESTBED_CPU, predictions
from .run_plan import scaled
from .summary import MODEL

WITHIN = 0.10


def repredicted(path: Path, cpu: Cpu, predict=predictions) -> list[dict]:
    """Per distinct plan of every run in `path`: case, rate, approach, measured, saved, today's and the CPU model's
    prediction (`predict`: `predict.predictions` or a stand-in with its arguments, `sharing` prices by other rules)."""
    data = json.loads(path.read_text())
    max_mb = float(re.search(r"--max-mb (\S+)", data["meta"]["command"]).group(1))
    rows = []
    for run in data["runs"]:
        model = MODEL[run.get("order", data["meta"]["order"])]
        plan_cpu = Cpu.model_validate(run["plan_cpu"]) if run.get("plan_cpu") else None  # runs of `experiments --plan-cpu`
        made = dict(_plans(run["case"], run["rate_mbit"], run["latency_us"], run["overhead_us"], max_mb, plan_cpu))
        for row in run["rows"]:
            if row.get("same_as") or not row["measured_s"] or isinstance(made.get(row["approach"]), str):
                continue
            plan = scaled(made[row["approach"]], max_mb)
            rows.append({"case": run["case"], "rate": run["rate_mbit"], "approach": row["approach"], "measured": row["measured_s"],
                         "saved": row["predicted_s"][model], "today": predict(plan, run["rate_mbit"])[model],
                         "cpu": predict(plan, run["rate_mbit"], cpu)[model]})
    return rows


def _fit(rows: list[dict], key: str) -> tuple[int, dict]:
    """How many rows are within 10% of `key`'s prediction, and the worst row."""
    ratios = [(r["measured"] / r[key], r["approach"]) for r in rows]
    return sum(abs(q - 1) <= WITHIN for q, _ in ratios), max(ratios, key=lambda q: abs(q[0] - 1))


def table(rows: list[dict]) -> str:
    """One line per case and rate: plans within 10% and the worst plan, saved / today / with the CPU model."""
    lines = ["| case | Mbit/s | plans | within 10%: saved | today | CPU model | worst: saved | today | CPU model |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["rate"], r["case"]) for r in rows}, key=lambda k: (-k[0], k[1]))
    for rate, case in keys + [(None, "all")]:
        mine = [r for r in rows if (r["rate"], r["case"]) == (rate, case) or case == "all"]
        fits = [_fit(mine, key) for key in ("saved", "today", "cpu")]
        lines.append(f"| {case} | {'-' if rate is None else f'{rate:g}'} | {len(mine)} | "
                     + " | ".join(str(n) for n, _ in fits) + " | "
                     + " | ".join(f"{name} {q:.2f}" for _, (q, name) in fits) + " |")
    return "\n".join(lines)


def changed(rows: list[dict], at_least: float = 0.02) -> str:
    """The plans whose ratio the CPU model moves by `at_least` or more."""
    lines = ["| case | Mbit/s | approach | measured ms | today ms | CPU model ms | meas/today | meas/CPU model |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if abs(r["measured"] / r["cpu"] - r["measured"] / r["today"]) >= at_least:
            lines.append(f"| {r['case']} | {r['rate']:g} | {r['approach']} | {r['measured'] * 1e3:.0f} | {r['today'] * 1e3:.0f} | "
                         f"{r['cpu'] * 1e3:.0f} | {r['measured'] / r['today']:.2f} | {r['measured'] / r['cpu']:.2f} |")
    return "\n".join(lines)


def spread(rows: list[dict]) -> str:
    """Median measured / model and the root mean square of its logarithm, per prediction."""
    out = []
    for key in ("saved", "today", "cpu"):
        logs = [math.log(r["measured"] / r[key]) for r in rows]
        out.append(f"{key}: median {math.exp(statistics.median(logs)):.3f}, rms log {math.sqrt(sum(x * x for x in logs) / len(logs)):.4f}")
    return "Measured / model: " + "; ".join(out) + "."


def crossed(rows: list[dict]) -> str:
    """The plans the CPU model brings within 10% of measured, and those it takes out (today -> CPU model)."""
    def inside(r, key):
        return abs(r["measured"] / r[key] - 1) <= WITHIN
    into = [r for r in rows if inside(r, "cpu") and not inside(r, "today")]
    out = [r for r in rows if inside(r, "today") and not inside(r, "cpu")]
    name = lambda r: f"{r['case']}/{r['rate']:g} {r['approach']} {r['measured'] / r['today']:.2f} -> {r['measured'] / r['cpu']:.2f}"
    return (f"Brought within 10% ({len(into)}): " + (", ".join(map(name, into)) or "none") + f"\nTaken out ({len(out)}): "
            + (", ".join(map(name, out)) or "none"))


@click.argument("results", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--cores", type=float, default=TESTBED_CPU.cores, show_default=True, help="cores every rank shares")
@click.option("--message-us", type=float, default=TESTBED_CPU.message_us, show_default=True,
              help="CPU per message inside a host, at each end, microseconds")
@click.option("--copy-gbps", type=float, default=TESTBED_CPU.copy_gbps, show_default=True, help="shared-memory copy rate of one core, Gbit/s")
@options
def _command(**_):
    """Re-predict saved emulated-cluster runs (RESULTS: results JSON files of bench.netlab.experiments)."""


def main(argv=None) -> int:
    prog = "python -m bench.netlab.repredict"
    args = parse(_command, argv, prog)
    try:
        cpu = Cpu(cores=args.cores, message_us=args.message_us, copy_gbps=args.copy_gbps)
    except ValidationError as err:
        usage_error(prog, f"cpu.{describe_validation_error(err)}")
    rows = [r for path in args.results for r in repredicted(path, cpu)]
    print(f"{cpu!r}\n\n{table(rows)}\n\n{spread(rows)}\n{crossed(rows)}\n\nPlans the CPU model moves by 0.02 or more (measured / model):\n\n{changed(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
