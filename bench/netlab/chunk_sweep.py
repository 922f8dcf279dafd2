"""The planner's chunk counts against the simulator's best, with the testbed's CPU model (`Cluster.cpu`).

    .venv/bin/python -m bench.netlab.chunk_sweep --cases one_to_1x4,case9 --rates 500,10000 --mb 32,2048

Per case, rate and tensor size: the broadcast plan (greedy solver) made with `predict.TESTBED_CPU` and 300 us per
message, its simulated time (host order, the plan's own claim), and every broadcast forced to each K of a sweep:
the best K and "planner / best": 1.000 is as good as the sweep's best, below 1 where the planner's K (or mix of K across
broadcasts) is not in the sweep and simulates faster than every K in it. `--hops-only` prices
chunks hop by hop, leaving out a relay's copies and the cores the relays share (`strategies._cpu_per_chunk` zeroed),
to show what that part of the planner's pricing changes.
"""

from __future__ import annotations

import sys

import click
import numpy as np

from xmesh_plan.planner import strategies
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import simulate_plan
from xmesh_plan.schemas.geometry import region_size

from .cli import options, parse
from .experiments import reference_problem
from .predict import TESTBED_CPU

SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def sweep(name: str, rate_mbit: float, max_mb: float) -> str:
    """One table row: the planner's chunk counts and time against the best forced K."""
    problem = reference_problem(name, rate_mbit, 0.0, 300.0, max_mb, TESTBED_CPU)
    plan = compile_plan(problem, strategy="broadcast", solver="greedy")
    timed = {}
    fewest = min((region_size(op.region) * problem.itemsize for op in plan.operations if op.kind == "broadcast"), default=0)
    for k in (k for k in SWEEP if k == 1 or k <= fewest // strategies.MIN_CHUNK_BYTES):  # chunks the planner could choose
        ops = tuple(op.model_copy(update={"chunks": k}) if op.kind == "broadcast" else op for op in plan.operations)
        timed[k] = simulate_plan(plan.model_copy(update={"operations": ops})).makespan_s
    best = min(timed, key=timed.get)
    mine = simulate_plan(plan).makespan_s
    ks = sorted({op.chunks for op in plan.operations if op.kind == "broadcast"})
    return (f"| {name} | {rate_mbit:g} | {max_mb:g} | {','.join(map(str, ks))} | {mine * 1e3:.2f} | {best} | "
            f"{timed[best] * 1e3:.2f} | {mine / timed[best]:.3f} |")


@click.option("--cases", default="one_to_1x4,case9", show_default=True)
@click.option("--rates", default="500,10000", show_default=True, help="Mbit/s, comma-separated")
@click.option("--mb", default="32,2048", show_default=True, help="tensor sizes in MiB, comma-separated")
@click.option("--hops-only", is_flag=True, help="the planner prices each hop alone, without the relays' copies on the shared cores")
@options
def _command(**_):
    """The planner's chunk counts against the simulator's best."""


def main(argv=None) -> int:
    args = parse(_command, argv, "python -m bench.netlab.chunk_sweep")
    if args.hops_only:
        strategies._cpu_per_chunk = lambda per_chunk, hop_cross, cluster: np.zeros(per_chunk.shape[0])
        strategies._pipelined_seconds.cache_clear()
    print("| case | Mbit/s | MiB | planner K | planner ms | best K | best ms | planner / best |\n|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        for rate in map(float, args.rates.split(",")):
            for mb in map(float, args.mb.split(",")):
                print(sweep(name, rate, mb), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
