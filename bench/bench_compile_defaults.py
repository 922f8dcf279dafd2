"""Compile defaults (planner/compile_defaults.py): every example compiled with its kind's default switches
and with the other choice, timed in the order the executor runs it by default, so the rule rests on figures.

Single-tensor reference cases (the paper's nine and the seven one-to-many): default (`split_hosts` and
`coalesce` off) against both on, timed in device order (`ReshardingExecutor`'s default) and host order
(the plan's own claim). Weight-sync examples: default (both on) against both off (the chained plan),
timed posted (`TransferExecutor`'s default on MPI; the plan states it, `Plan.executor_prediction`)
and host order. Compile wall times are this machine's and noisy.

    .venv/bin/python -m bench.bench_compile_defaults            # a minute or two, most of it the Llama compiles
    .venv/bin/python -m bench.bench_compile_defaults --render   # rewrite BENCHMARKS.md from bench/results/compile_defaults.json
"""

from __future__ import annotations

import json
import sys
import time
import tomllib
from pathlib import Path


from bench.report import replace_section, write_json
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


COMPILE_TIME = """Compile time of the Llama problem with the defaults, measured apart from this script (CPU seconds of
`compile_plan` alone, so the machine's load counts less; two runs each, taking turns, the commit before
the new defaults against this one, each imported from its own checkout):
`python -c 'compile_plan(load_any_problem("plans/weight_sync_llama3_8b.problem.toml"))'` took 8.30 and
8.39 s before (the chained plan, no posted time) and 10.04 and 10.58 s now (`--split-hosts --coalesce`
and the posted simulation, about 3 s of it): 1.24x. The simulator's rate sharing was made cheaper on
the way, exactly (124 plans and the Llama plan compared byte for byte before and after). Larger FSDP
meshes cost more: from 16x8 (the same CPU measure, one run each) the default took 45.1 s before
(94,592 unit tasks, predicted 0.4160 s) and 95.7 s now (25,120, predicted 0.3359 s): 2.1x, most of
it the host-order simulation of the bundles, whose gathers inside a host all run at once, run twice
until the listing settles (the wall times of the "Weight sync" scale table were taken under heavier
load than the ones they replace)."""


def render(command: str, singles: list[dict], transfers: list[dict]) -> None:
    """Write the BENCHMARKS.md section from measured rows (`--render` redoes it from the results JSON)."""
    def over(r, key):
        return f"{r[key]:.4f} ({r[key] / r['lower_bound_s']:.3f}x)"
    single_lines = "\n".join(
        f"| {r['problem']} | {r['lower_bound_s']:.4f} | {over(r, 'default_device_s')} | {over(r, 'both_on_device_s')} "
        f"| {over(r, 'default_host_s')} | {over(r, 'both_on_host_s')} |" for r in singles)
    worse = sum(r["both_on_device_s"] > r["default_device_s"] * (1 + 1e-9) for r in singles)
    better = sum(r["both_on_device_s"] < r["default_device_s"] * (1 - 1e-9) for r in singles)
    transfer_lines = "\n".join(
        f"| {r['problem']} | {r['lower_bound_s']:.4f} | {over(r, 'default_posted_s')} | {over(r, 'both_off_posted_s')}"
        f"{'' if r['both_off_posted_stated'] else ' (not stated)'} | {over(r, 'default_host_s')} | {over(r, 'both_off_host_s')} "
        f"| {r['default_compile_s']:.1f} / {r['both_off_compile_s']:.1f} |" for r in transfers)
    replace_section("Compile defaults", f"""
Made by (2-core CPU machine shared with other jobs; compile times are noisy, predicted times are not):

```
{command}
```

What `compile` does when `--split-hosts` / `--coalesce` are not given (`planner/compile_defaults.py`)
is read from the problem's kind: both on for a multi-tensor problem, both off for one tensor. Each
example below is compiled both ways and timed, by the one network simulator, in the order its executor
runs it by default. Raw: `bench/results/compile_defaults.json`.

Multi-tensor (weight sync), default (both on) against both off (`--no-split-hosts --no-coalesce`, the
chained plan that was the default before): posted is `TransferExecutor`'s default on MPI and what the
plan states (`executor_prediction`; "not stated": the plan was too costly to time posted at compile,
`planner/executor_order.py`, and is timed here); host order is the plan's own claim. In brackets,
over the byte lower bound. (The torch engine runs multi-tensor plans in device order:
`xmesh-plan inspect --orders` times that.)

| problem | lower bound s | default posted s | both off posted s | default host s | both off host s | compile wall s (default / both off) |
|---|---:|---:|---:|---:|---:|---|
{transfer_lines}

Single tensor (the reference cases of `make plans`), default (both off) against both on: device order
is `ReshardingExecutor`'s default. Both on is slower in device order on {worse} of {len(singles)} cases and
faster on {better}; the default stays off.

| case | lower bound s | default device s | both on device s | default host s | both on host s |
|---|---:|---:|---:|---:|---:|
{single_lines}

{COMPILE_TIME}
""")


def main() -> None:
    if sys.argv[1:2] == ["--render"]:
        saved = json.loads((Path(__file__).resolve().parent / "results" / "compile_defaults.json").read_text())
        render(saved["command"], saved["singles"], saved["transfers"])
        return
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
    render(COMMAND, singles, transfers)


if __name__ == "__main__":
    main()
