"""`python -m bench.netlab PLAN... [--rate-mbit 500] [--check]`: run plans on an emulated cluster (as root).

Prints per plan the executor's line, then each host's link bytes against the plan's. Exit 0 when
every run passed, 1 when a run failed or a check did not pass, 2 on bad input or no namespaces.
`--clean-stale` removes namespaces that killed runs left behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

from xmesh_plan.schemas import PlanFileError, read_plan_file

import click

from .cli import options, parse
from .run_plan import RunOptions, RunResult, run_plans
from .testbed import LinkShape, TestbedError, clean_stale, unavailable_reason


@click.argument("plans", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--rate-mbit", type=float, default=500.0, show_default=True, help="every host link, each direction")
@click.option("--mtu", type=int, default=9000, show_default=True, help="link MTU")
@click.option("--max-mb", type=float, default=64.0, show_default=True, help="shrink each tensor to at most this")
@click.option("--iters", type=int, default=5, show_default=True)
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--check", is_flag=True, help="check every destination shard bit for bit")
@click.option("--engine", type=click.Choice(["mpi", "torch"]), default="mpi", show_default=True, help="mpi (mpiexec) or torch (gloo)")
@click.option("--order", type=click.Choice(["device", "posted"]), default="device", show_default=True,
              help="the executor's order: posted (every message at once) or device (one operation at a time per device)")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds before a run is killed")
@click.option("--clean-stale", is_flag=True, help="remove namespaces left by killed runs, then go on")
@options
def _command(**_):
    """Run plans (PLANS: plans needing the same ranks per host, run in one launch) on the emulated cluster."""


def _arguments(argv):
    return parse(_command, argv, "python -m bench.netlab")


def report(result: RunResult) -> str:
    lines = [line for line in result.launch.stdout.splitlines() if "ms/iter" in line] or ["(no timing printed)"]
    for row in result.hosts:
        m, p = row.measured, row.predicted
        lines.append(f"  host {row.host}: sent {m.sent:>12,} (plan {p.sent:>12,})  received {m.received:>12,} (plan {p.received:>12,})")
    if not result.ok:
        lines.append(f"  FAILED (exit {result.launch.returncode}{', timed out' if result.launch.timed_out else ''}): "
                     + result.launch.stderr.strip()[-2000:])
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _arguments(argv)
    reason = unavailable_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if args.clean_stale:
        print(f"removed {len(clean_stale())} stale namespaces")
        if not args.plans:
            return 0
    try:
        opts = RunOptions(LinkShape(args.rate_mbit, args.mtu), args.max_mb, args.iters, args.warmup, args.check, args.timeout,
                          order=args.order, engine=args.engine)
        plans = [read_plan_file(p) for p in args.plans]
        if not plans:
            raise ValueError("give at least one plan file, e.g. plans/case3.plan.json")
    except (ValueError, PlanFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        result = run_plans(plans, opts)
    except (ValueError, TestbedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report(result), flush=True)
    return 0 if result.ok and (result.checked or not args.check) else 1


if __name__ == "__main__":
    sys.exit(main())
