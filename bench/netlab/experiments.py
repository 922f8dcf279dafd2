"""Paper cases on the emulated cluster: measured time per reshard against the model, per strategy, solver and Alpa baseline.

For each case and link rate, every approach is compiled on the paper's problem with its NICs at the
link rate, scaled to `--max-mb`, and all of them run in one launch (start-up paid once) on a fresh
testbed; the medians of `--iters` timed reshards after `--warmup` are set against three predictions
(`predict.py`) and the byte lower bound, and the links' byte counters against the plans' bytes.
Writes bench/results/netlab.json (or `--out`) and prints the runs as Markdown tables (`--no-markdown`: not);
`bench/benchmarks_doc.py` makes BENCHMARKS.md from the results files it names.

    sudo .venv/bin/python -m bench.netlab.experiments [--cases case3,case7] [--rates 200,500]
"""

from __future__ import annotations

import math
import os
import sys
import time
import tomllib
from dataclasses import replace


import click

from ..report import write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.reference_cases import reference_problems
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, weight_sync_toml
from xmesh_plan.executor.scale import factors_for
from xmesh_plan.schemas import Cpu, Plan, ReshardingProblem

from .baseline_plans import baseline_plan
from .cli import options, parse, usage_error
from .predict import TESTBED_CPU, TESTBED_SHORT_MS, at_rate, predictions
from .run_plan import MAX_RUN_BYTES, PlansRefusedError, RunOptions, run_plans, scaled
from .testbed import LinkShape, unavailable_reason

APPROACHES = [  # label, strategy, solver (None: an Alpa baseline)
    ("ours", "broadcast", "auto"),
    ("send_recv", "send_recv", "auto"),
    ("local_allgather", "local_allgather", "auto"),
    ("global_allgather", "global_allgather", "auto"),
    ("auto", "auto", "auto"),
    ("naive", "broadcast", "naive"),
    ("size", "broadcast", "size"),
    ("alpa-send-recv", None, None),
    ("alpa-allgather", None, None),
] + [(f"bc-{solver}", "broadcast", solver) for solver in ("greedy", "randomized-greedy", "dfs", "list-backfill", "cpsat")]
# every solver on its own; one whose operations are another approach's runs once (rows say `same_as`)
COMMAND = ".venv/bin/python -m bench.netlab.experiments"
PROG = "python -m bench.netlab.experiments"
EXTRA_CASES = {  # name -> (the problem, (label, compile_plan options) per plan); reference cases use APPROACHES
    "alltoall_2x4": (  # the scaling table's all-to-all, small: 64 boxes of 64 KiB between 4 hosts
        lambda: build_problem({"name": "alltoall_2x4", "shape": [128, 256, 32], "dtype": "float32",
                               "src": {"mesh": "2x4", "spec": "S0 R S1"}, "dst": {"mesh": "2x4", "spec": "R S01 R"}}),
        (("ours", {}), ("coalesce", {"coalesce": True}))),
    "weight_sync_small": (  # a multi-tensor plan: the default against chained (neither split nor coalesced) and the rest
        lambda: build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC["weight_sync_small"]))),
        (("default", {}), ("chained", {"split_hosts": False, "coalesce": False}),
         ("split-hosts", {"split_hosts": True, "coalesce": False}),
         ("no-cross-tensor", {"cross_tensor": False}))),  # bundles of one tensor each, no shared messages
}


def reference_problem(name: str, rate_mbit: float, latency_us: float | None = None, overhead_us: float | None = None,
                      max_mb: float | None = None, cpu: Cpu | None = None) -> ReshardingProblem:
    """Paper case `name` on the testbed's links (`predict.at_rate`), its tensor shrunk to at most `max_mb` MiB as the
    executor would shrink it (when given): plans are made for the tensor that runs, so chunk counts fit its bytes."""
    problem = at_rate(build_problem(dict(reference_problems())[name]), rate_mbit, latency_us, overhead_us, cpu)
    if max_mb is None:
        return problem
    factors = factors_for(compile_plan(problem, strategy="broadcast", solver="naive"), int(max_mb * 2**20))
    return problem.model_copy(update={"shape": tuple(n // f for n, f in zip(problem.shape, factors))})


def _plans(name: str, rate_mbit: float, latency_us: float | None = None, overhead_us: float | None = None,
           max_mb: float | None = None, cpu: Cpu | None = None):
    """(label, plan or the reason it could not be made) for every approach on case `name` at the link rate
    (and per-message latency and overhead, when given), on the reference tensor shrunk to at most
    `max_mb` MiB as the executor would shrink it (when given); planned with the shared CPU `cpu`, when given."""
    if name in EXTRA_CASES:
        make, variants = EXTRA_CASES[name]
        problem = at_rate(make(), rate_mbit, latency_us, overhead_us, cpu)
        return [(label, compile_plan(problem, **options)) for label, options in variants]
    problem = reference_problem(name, rate_mbit, latency_us, overhead_us, max_mb, cpu)
    out = []
    for label, strategy, solver in APPROACHES:
        try:
            plan = baseline_plan(problem, label) if strategy is None else compile_plan(problem, strategy=strategy, solver=solver)
            out.append((label, plan))
        except (ValueError, AssertionError) as err:
            out.append((label, f"{type(err).__name__}: {err}"))
    return out


def measure_message_costs(opts: RunOptions) -> tuple[float, float]:
    """(latency, overhead) of one message on the testbed, in microseconds: the median time of a reshard
    that sends one tiny message between two hosts, all of it charged as overhead (link time), none as
    latency. On the testbed a message's cost is CPU work on 2 cores shared by every rank, so messages
    in flight together queue for it rather than overlap (docs/netlab.md, "What one message costs")."""
    plan = compile_plan(at_rate(build_problem(dict(reference_problems())["one_to_1x1"]), opts.link.rate_mbit), strategy="send_recv", solver="auto")
    result = run_plans([plan], replace(opts, max_mb=1e-4, iters=30, warmup=5))
    if not result.ok:
        raise RuntimeError(f"the message-cost probe failed: {result.launch.stderr[-500:]}")
    return 0.0, result.median_s[0] * 1e6


def replace_cores(cpu):
    """The fitted CPU model with this machine's core count (the ranks of every host run on all of them)."""
    return cpu.model_copy(update={"cores": float(os.cpu_count() or cpu.cores)})


def run_case(name: str, rate_mbit: float, opts: RunOptions, latency_us: float | None = None, overhead_us: float | None = None,
             plan_cpu: Cpu | None = None) -> dict:
    made = _plans(name, rate_mbit, latency_us, overhead_us, opts.max_mb, plan_cpu)
    plans = [(label, p) for label, p in made if not isinstance(p, str)]
    first_of: dict[str, str] = {}  # the operations, as JSON -> the first approach that has them
    same_as = {}
    for label, plan in plans:
        same_as[label] = first_of.setdefault(plan.model_dump_json(include={"operations"}), label)
    distinct = [(label, p) for label, p in plans if same_as[label] == label]
    started = time.monotonic()
    result = run_plans([p for _, p in distinct], opts)
    timed = {label: (median, fastest) for (label, _), median, fastest in zip(distinct, result.median_s, result.min_s)}
    rows = []
    for label, plan in plans:
        median, fastest = timed[same_as[label]]
        rows.append({"approach": label, "strategy": plan.strategy, "solver": plan.solver.name, "ops": len(plan.operations),
                     "measured_s": median, "min_s": fastest, "predicted_s": predictions(scaled(plan, opts.max_mb), rate_mbit),
                     "predicted_cpu_s": predictions(scaled(plan, opts.max_mb), rate_mbit, replace_cores(TESTBED_CPU)),
                     **({"same_as": same_as[label]} if same_as[label] != label else {})})
    shape = list(getattr(plans[0][1].problem, "shape", ()))
    return {"case": name, "rate_mbit": rate_mbit, "latency_us": latency_us, "overhead_us": overhead_us, "order": opts.order, "shape": shape, "rows": rows,
            "plan_cpu": plan_cpu.model_dump() if plan_cpu is not None else None,
            "skipped": {label: p for label, p in made if isinstance(p, str)}, "checked": result.checked,
            "ok": result.ok, "wall_s": round(time.monotonic() - started, 1), "links": [h.as_dict() for h in result.hosts],
            "retransmitted_segments": result.retransmits,
            "reshards": opts.warmup + opts.iters, "stderr_tail": "" if result.ok else result.launch.stderr[-2000:]}


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


MODEL_OF_ORDER = {"posted": "posted", "device": "device-order"}  # executor --order -> the simulator queueing that describes it


def table(runs: list[dict], order: str = "device") -> str:
    lines = ["| case | Mbit/s | approach | measured ms | host-order ms | device-order ms | posted ms | bound ms | "
             f"meas/{MODEL_OF_ORDER[order]} | meas/bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        model = MODEL_OF_ORDER[run.get("order", order)]
        for r in run["rows"]:
            p, m = r["predicted_s"], r["measured_s"]
            label = r["approach"] + (f" (= {r['same_as']})" if r.get("same_as") else "")
            lines.append(f"| {run['case']} | {run['rate_mbit']:g} | {label} | {_ms(m)} | {_ms(p['host-order'])} | "
                         f"{_ms(p['device-order'])} | {_ms(p['posted'])} | {_ms(p['lower-bound'])} | {_ratio(m, p[model])} | "
                         f"{_ratio(m, p['lower-bound'])} |")
    return "\n".join(lines)


def link_table(runs: list[dict]) -> str:
    lines = ["| case | Mbit/s | latency us | plan bytes (all hosts, both ways) | link bytes | excess | excess per reshard | TCP retransmits | bit-exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        plan = sum(h["predicted_sent"] + h["predicted_received"] for h in run["links"])
        link = sum(h["sent"] + h["received"] for h in run["links"])
        latency = "plan's" if run.get("latency_us") is None else f"{run['latency_us']:g}"
        lines.append(f"| {run['case']} | {run['rate_mbit']:g} | {latency} | {plan:,} | {link:,} | {(link - plan) / plan:+.2%} | "
                     f"{(link - plan) / run['reshards'] / len(run['rows']) / 2**10:,.0f} KiB | "
                     f"{sum(run.get('retransmitted_segments', {}).values()):,} | {'yes' if run['checked'] else 'NO'} |")
    return "\n".join(lines)


@click.option("--cases", default=",".join(n for n, _ in reference_problems()), show_default=True,
              help="comma-separated case names: the reference cases, alltoall_2x4, weight_sync_small")
@click.option("--rates", default="200,500", show_default=True, help="link rates in Mbit/s, comma-separated")
@click.option("--max-mb", type=float, default=16.0, show_default=True)
@click.option("--iters", type=int, default=3, show_default=True)
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--mtu", type=int, default=9000, show_default=True)
@click.option("--out", default="netlab.json", show_default=True, help="results file name under bench/results/")
@click.option("--order", type=click.Choice(sorted(MODEL_OF_ORDER)), default="device", show_default=True,
              help="the executor's order: posted (every message at once) or device (one operation at a time per device)")
@click.option("--engine", type=click.Choice(["mpi", "torch"]), default="mpi", show_default=True,
              help="mpi: mpiexec + executor.run; torch: torch.distributed over gloo + executor.torch_run")
@click.option("--latency-us", default="measure", show_default=True,
              help="per-message latency and overhead the plans are made and predicted with: 'measure' (a probe on "
                   "the testbed at each rate, charged as overhead, no latency), 'plan' (the cases' own: "
                   "20 us and 1 us), or LATENCY[,OVERHEAD] in microseconds (e.g. 0,300; overhead the cluster default when left out)")
@click.option("--single-copy", is_flag=True,
              help="mpi: MPICH's single-copy transport inside a host (MPIR_CVAR_CH4_CMA_ENABLE=1): one copy per "
                   "message of 8 KiB or more instead of two through shared memory")
@click.option("--plan-cpu", is_flag=True,
              help="make the plans with the testbed's shared CPU modelled (predict.TESTBED_CPU at this machine's "
                   "core count, as Cluster.cpu): chunk counts that weigh the relays' copies inside a host")
@click.option("--max-run-gib", type=float, default=MAX_RUN_BYTES / 2**30, show_default=True,
              help="refuse a case whose plans would move more than this across devices in all their reshards "
                   "(every paper case at 64 MiB and 4 reshards needs 10)")
@click.option("--no-receipts", is_flag=True,
              help="torch: end gloo sends as gloo does, without the engine's receipts in device order (bench.netlab.no_receipts)")
@click.option("--no-markdown", is_flag=True, help="do not print the runs as Markdown tables at the end")
@options
def _command(**_):
    """Paper cases on the emulated cluster: measured time per reshard against the model."""


def _arguments(argv):
    args = parse(_command, argv, PROG)
    if not (math.isfinite(args.max_run_gib) and args.max_run_gib > 0):
        usage_error(PROG, f"--max-run-gib {args.max_run_gib:g}: give a positive number of GiB")
    if args.single_copy and args.engine != "mpi":
        usage_error(PROG, "--single-copy is an MPICH setting; use it with --engine mpi")
    if args.no_receipts and args.engine != "torch":
        usage_error(PROG, "--no-receipts is the torch engine's; use it with --engine torch")
    args.costs = None
    if args.latency_us not in ("measure", "plan"):
        try:
            costs = [float(v) for v in args.latency_us.split(",")]
            if not 1 <= len(costs) <= 2 or not all(math.isfinite(c) and c >= 0 for c in costs):
                raise ValueError
            args.costs = (costs[0], costs[1] if len(costs) == 2 else None)
        except ValueError:
            usage_error(PROG, f"--latency-us {args.latency_us!r}: give LATENCY[,OVERHEAD] in microseconds (e.g. 200,40), 'measure' or 'plan'")
    return args


def main(argv=None) -> int:
    args = _arguments(argv)
    reason = unavailable_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    runs = []
    for rate in [float(r) for r in args.rates.split(",")]:
        opts = RunOptions(LinkShape(rate, args.mtu), args.max_mb, args.iters, args.warmup, order=args.order, engine=args.engine,
                          single_copy=args.single_copy, max_run_bytes=int(args.max_run_gib * 2**30),
                          module="bench.netlab.no_receipts" if args.no_receipts else None)
        latency, overhead = args.costs or (None, None)
        if args.latency_us == "measure":
            latency, overhead = (round(v, 1) for v in measure_message_costs(opts))
            print(f"measured per message at {rate:g} Mbit/s: latency {latency:g} us, overhead {overhead:g} us", flush=True)
        for name in args.cases.split(","):
            try:
                runs.append(run_case(name, rate, opts, latency, overhead, replace_cores(TESTBED_CPU) if args.plan_cpu else None))
            except PlansRefusedError as err:
                kept = ""
                if runs:  # the file says where the sweep stopped, so its command (every case) does not mislead
                    path = write_json(args.out, {"meta": {**_meta(args, os.getloadavg()), "stopped_at": f"{name} at {rate:g} Mbit/s"},
                                                 "runs": runs})
                    kept = f"; the {len(runs)} runs before it are in {path}"
                print(f"error: {name} at {rate:g} Mbit/s: {err}{kept}", file=sys.stderr)
                return 2
            print(*table([runs[-1]], args.order).splitlines()[2:], link_table([runs[-1]]).splitlines()[-1], sep="\n", flush=True)
            write_json(args.out, {"meta": _meta(args, None), "runs": runs})  # kept case by case: a later failure loses nothing
    load = os.getloadavg()
    meta = _meta(args, load)
    write_json(args.out, {"meta": meta, "runs": runs})
    if not args.no_markdown:
        print(f"\n`{meta['command']}` (as root; load average after: {load[0]:.1f}, {os.cpu_count()} cores)\n\n"
              f"{table(runs, args.order)}\n\n{link_table(runs)}")
    return 0 if all(r["ok"] and r["checked"] for r in runs) else 1


def _meta(args, load) -> dict:
    """The results file's header: the command that made it, the load average after (None while it runs), the machine."""
    return {"command": f"{COMMAND} --cases {args.cases} --rates {args.rates} --max-mb {args.max_mb:g} --iters {args.iters} "
                       f"--warmup {args.warmup} --mtu {args.mtu} --order {args.order} --engine {args.engine} --latency-us {args.latency_us}"
                       f"{' --single-copy' if args.single_copy else ''}{' --plan-cpu' if args.plan_cpu else ''}"
                       f"{' --no-receipts' if args.no_receipts else ''}"
                       f"{f' --max-run-gib {args.max_run_gib:g}' if args.max_run_gib * 2**30 != MAX_RUN_BYTES else ''}",
            "loadavg_after": load, "cpus": os.cpu_count(), "plan_cpu": args.plan_cpu,
            "sharing": f"testbed: first come at a host's send side for messages up to {TESTBED_SHORT_MS:g} ms in device order, else max-min",
            "order": args.order, "engine": args.engine, "single_copy": args.single_copy,
            **({"receipts": not args.no_receipts} if args.engine == "torch" else {})}


if __name__ == "__main__":
    sys.exit(main())
