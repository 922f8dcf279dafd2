"""Simulator: seconds, operations per second and peak memory of timing 10^4 to 10^6 operations, against the reference engine.

Synthetic plans on a 32-host x 8-device cluster with 8 NICs of 400 Gbit/s per host (the issue's frontier
cluster), each operation its own task pinned to one NIC (`send:N` in a plan's host order): `sends`, every
operation one message between devices of two random hosts (64 KiB to 4 MiB); `broadcasts`, every operation a
two-chunk broadcast down a chain of two other hosts' devices (four flows). Each point runs in a fresh process, so
its peak RSS is its own: lowering plus the simulation (`planner.simulate.simulate`), in host order (what
`compile` times a plan in) and device order (the executor's default for a single tensor). The reference engine
(`tests.support.reference_flows`: every moving flow stepped at every event) runs the same plans up to
`--old-max-ops`; both run in one session and the ratio is of CPU seconds, so it holds on a loaded machine
even where the wall-clock seconds do not. `--disciplines posted` (every message at once, rates shared over
thousands of concurrent flows at every event) is quadratic in either engine: keep it to 10^4. `same_makespan`:
host order agrees to rounding; device order can differ from 10^4 operations on (1e-6 .. 1e-2), as the reference
engine does from itself with every link's capacity changed by 1e-15: messages ready at one instant take a connection
in the order rounding puts them.

    .venv/bin/python -m bench.bench_simulate --plans sends                           # 10^4 .. 10^6, reference up to 10^5
    .venv/bin/python -m bench.bench_simulate --plans broadcasts --sizes 10000,100000

Adds each point to bench/results/simulate.json as it is measured (a point measured again replaces its row).
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import click

from bench.report import RESULTS, ROOT, write_json
from xmesh_plan.schemas import Cluster, DeviceMesh, Nic, Operation, Placement, ReshardingProblem

HOSTS, PER_HOST, NICS = 32, 8, 8
SIZES = (10_000, 100_000, 1_000_000)
PLANS = ("sends", "broadcasts")
DISCIPLINES = ("host-order", "device-order")
COMMAND = ".venv/bin/python -m bench.bench_simulate"


def cluster_problem() -> ReshardingProblem:
    devices = tuple(range(HOSTS * PER_HOST))
    mesh = DeviceMesh(shape=(HOSTS, PER_HOST), devices=devices)
    cluster = Cluster(devices_per_host=PER_HOST, nics=tuple(Nic(send_gbps=400, recv_gbps=400) for _ in range(NICS)))
    return ReshardingProblem(shape=(2**31,), dtype="bfloat16", cluster=cluster,
                             src=Placement(mesh=mesh, spec="S01"), dst=Placement(mesh=mesh, spec="R"))


def operations(kind: str, n: int, seed: int = 0) -> list[Operation]:
    """`n` synthetic operations of `kind` (see the module docstring), seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        hosts = rng.sample(range(HOSTS), 2 if kind == "sends" else 3)
        devices = [h * PER_HOST + rng.randrange(PER_HOST) for h in hosts]
        elements = rng.randint(2**15, 2**21)  # bfloat16: 64 KiB .. 4 MiB
        if kind == "sends":
            out.append(Operation(id=i, task=i, kind="send", src=devices[0], dsts=(devices[1],), region=((0, elements),)))
        else:
            out.append(Operation(id=i, task=i, kind="broadcast", src=devices[0], dsts=tuple(devices[1:]),
                                 region=((0, elements),), chunks=2))
    return out


def one(kind: str, n: int, discipline: str, engine: str) -> dict:
    """Lower and time one plan in this process: seconds, flows, simulated makespan, peak RSS."""
    from xmesh_plan.planner import simulate as new
    from tests.support import reference_flows as old

    problem, ops = cluster_problem(), operations(kind, n)
    nics = {op.task: op.task % NICS for op in ops}
    begin, cpu = time.perf_counter(), time.process_time()
    result = (new.simulate if engine == "new" else old.reference_simulate)(ops, problem, discipline, nics)
    seconds, cpu_s = time.perf_counter() - begin, time.process_time() - cpu
    return {"plan": kind, "operations": n, "discipline": discipline, "engine": engine, "flows": result.flows,
            "seconds": seconds, "cpu_s": cpu_s, "ops_per_s": n / seconds, "ops_per_cpu_s": n / cpu_s,
            "makespan_s": result.makespan_s, "work": result.work,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(kind: str, n: int, discipline: str, engine: str) -> dict:
    child = subprocess.run([sys.executable, "-m", "bench.bench_simulate", "--one", kind, str(n), discipline, engine], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    return json.loads(child.stdout.splitlines()[-1])


@click.command(help=__doc__.splitlines()[0])
@click.option("--sizes", default=",".join(map(str, SIZES)), show_default=True, help="operations per plan, comma-separated")
@click.option("--old-max-ops", type=int, default=100_000, show_default=True, help="largest plan the reference engine times")
@click.option("--plans", default=",".join(PLANS), show_default=True, help=f"synthetic plans, comma-separated: {', '.join(PLANS)}")
@click.option("--disciplines", default=",".join(DISCIPLINES), show_default=True, help="simulator disciplines, comma-separated")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS / "simulate.json", show_default=True,
              help="results JSON")
@click.option("--one", "single", nargs=4, hidden=True, help="(internal) one point in this process: plan, size, discipline, engine")
def main(sizes: str, old_max_ops: int, plans: str, disciplines: str, out: Path, single) -> None:
    if single:
        kind, n, discipline, engine = single
        print(json.dumps(one(kind, int(n), discipline, engine)))
        return
    try:
        counts = [int(s) for s in sizes.split(",")]
    except ValueError:
        raise click.BadParameter(f"{sizes!r}: give whole numbers separated by commas, e.g. 10000,100000", param_hint="--sizes")
    command = COMMAND + "".join(f" {a}" for a in sys.argv[1:])
    for kind in plans.split(","):
        for n in counts:
            for discipline in disciplines.split(","):
                new = measure(kind, n, discipline, "new")
                rows = [new]
                line = (f"{kind:<10} {n:>9,} ops {discipline:<12} new {new['seconds']:7.1f} s (CPU {new['cpu_s']:6.1f} s, "
                        f"{new['ops_per_s']:>7,.0f} ops/s, {new['peak_rss_mib']:,.0f} MiB)")
                if n <= old_max_ops:
                    old = measure(kind, n, discipline, "old")
                    rows.append(old)
                    new["old_over_new"] = old["cpu_s"] / new["cpu_s"]
                    new["same_makespan"] = abs(old["makespan_s"] - new["makespan_s"]) <= 1e-12 * old["makespan_s"]
                    line += (f"  old {old['seconds']:7.1f} s (CPU {old['cpu_s']:6.1f} s, {old['peak_rss_mib']:,.0f} MiB)"
                             f"  old/new CPU {new['old_over_new']:.1f}x")
                print(line, flush=True)
                record(out, command, rows)
    print(f"wrote {out}")


def record(out: Path, command: str, rows: list[dict]) -> None:
    """Add `rows` to the results in `out` (a point measured again replaces its row), after every point, so a long run
    that is stopped keeps what it measured."""
    data = json.loads(out.read_text()) if out.exists() else {"commands": [], "points": []}
    key = lambda r: (r["plan"], r["operations"], r["discipline"], r["engine"])  # noqa: E731
    fresh = {key(r) for r in rows}
    data["points"] = sorted([r for r in data["points"] if key(r) not in fresh] + rows, key=key)
    data["commands"] = sorted(set(data["commands"]) | {command})
    if out.parent == RESULTS:
        write_json(out.name, data)
    else:
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
