"""Compile defaults (planner/compile_defaults.py): every example compiled with its kind's default switches
and with the other choice, timed in the order the executor runs it by default, so the rule rests on figures.

Single-tensor reference cases (the paper's nine and the seven one-to-many): default (`split_hosts` and
`coalesce` off) against both on, timed in device order (`ReshardingExecutor`'s default) and host order
(the plan's own claim). Weight-sync examples: default (both on) against both off (the chained plan),
timed posted (`TransferExecutor`'s default on MPI; the plan states it, `Plan.executor_prediction`)
and host order. Compile wall times are this machine's and noisy.

    .venv/bin/python -m bench.bench_compile_defaults   # a minute or two, most of it the Llama compiles

Writes bench/results/compile_defaults.json and remakes BENCHMARKS.md ("Weight sync", "Compile defaults").
"""

from __future__ import annotations

import time
import tomllib

from bench.report import update_benchmarks_doc, write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.reference_cases import reference_cases
from xmesh_plan.planner.simulate import simulate_plan
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, weight_sync_toml

COMMAND = ".venv/bin/python -m bench.bench_compile_defaults"
BOTH_OFF = {"split_hosts": False, "coalesce": False}
BOTH_ON = {"split_hosts": True, "coalesce": True}


def timed(problem, options: dict) -> tuple[object, float]:
    begin = time.perf_counter()
    plan = compile_plan(problem, **options)
    return plan, time.perf_counter() - begin


def single_row(name: str, problem) -> dict:
    """A single-tensor case: the default plan and the both-on plan, in device and host order."""
    row = {"problem": name, "lower_bound_s": None}
    for key, options in (("default", {}), ("both_on", BOTH_ON)):
        plan, wall = timed(problem, options)
        row |= {f"{key}_host_s": plan.predicted_seconds, f"{key}_device_s": simulate_plan(plan, "device-order").makespan_s,
                f"{key}_compile_s": wall, "lower_bound_s": plan.lower_bound_seconds}
    return row


def transfer_row(name: str) -> dict:
    """A weight-sync example: the default plan and the chained one, posted and host order. The chained Llama
    plan states no posted time (too costly to simulate at compile: `executor_order`), so it is timed here."""
    problem = build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC[name])))
    row = {"problem": name}
    for key, options in (("default", {}), ("both_off", BOTH_OFF)):
        plan, wall = timed(problem, options)
        stated = plan.executor_prediction
        row |= {f"{key}_host_s": plan.predicted_seconds, f"{key}_compile_s": wall, "lower_bound_s": plan.lower_bound_seconds,
                f"{key}_operations": len(plan.operations), f"{key}_posted_stated": stated is not None,
                f"{key}_posted_s": stated.predicted_seconds if stated else simulate_plan(plan, "posted").makespan_s}
    return row


def main() -> None:
    singles = []
    for name, problem in reference_cases():
        singles.append(single_row(name, problem))
        r = singles[-1]
        print(f"{name}: device order default {r['default_device_s']:.4f} s, both on {r['both_on_device_s']:.4f} s", flush=True)
    transfers = []
    for name in WEIGHT_SYNC:
        transfers.append(transfer_row(name))
        r = transfers[-1]
        print(f"{name}: posted default {r['default_posted_s']:.4f} s, both off {r['both_off_posted_s']:.4f} s; "
              f"compile {r['default_compile_s']:.1f} / {r['both_off_compile_s']:.1f} s", flush=True)
    write_json("compile_defaults.json", {"command": COMMAND, "singles": singles, "transfers": transfers})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
