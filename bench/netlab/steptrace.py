"""Where a reshard's time goes on the testbed: every step's launch and finish time, per operation, against the model.

The ranks run `executor.run` with `MpiEngine._launch` and `_finish` wrapped to note the monotonic time
(one clock for every namespace of the machine) of each step of every reshard, or with `--engine torch`
`executor.torch_run` with `TorchEngine._advance` (which posts messages) and `_finish` wrapped: the torch
engine waits for a send no step depends on only at the end, so such a send marks only its start; the plan's simulated
timeline (`predict.simulated`: the queueing for the order, the testbed's sharing and `predict.TESTBED_CPU` at this
machine's core count, as `experiments` prices) is set beside the measured one of the last timed reshard
before the checked one, operation by operation, so a gap the model does not have shows where it opens.
A bench tool: the engines are patched only inside the ranks this module launches. `XMESH_NETLAB_POLL=LOW,HIGH`
(seconds) sets the ranks' sleeps between polls, to see how polling shifts the timeline.

    sudo .venv/bin/python -m bench.netlab.steptrace --case case9 --approach ours --max-mb 32
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import click

from .cli import options, parse, usage_error

TRACE_ENV = "XMESH_NETLAB_STEPTRACE"  # the folder each rank writes its trace-<rank>.json into
ENGINE_ENV = "XMESH_NETLAB_STEPTRACE_ENGINE"  # mpi or torch: which engine the ranks run and time


def _timed_start(engines: list, start):
    """An engine's `start` that opens a new reshard's trace (and lists the engine at its first)."""
    def timed_start(self, src):
        if not hasattr(self, "_trace"):
            engines.append(self)
            self._traces = []
        self._trace = {"start": time.monotonic(), "launch": {}, "finish": {}}
        self._traces.append(self._trace)
        return start(self, src)
    return timed_start


def _stamped(method, key: str):
    """`method(self, i)` that first notes the time of step i under `key` ("launch" or "finish") in this reshard's trace."""
    def stamped(self, i):
        self._trace[key][i] = time.monotonic()
        return method(self, i)
    return stamped


def _patch_torch(engines: list) -> None:
    """Wrap the torch engine as `_patch` wraps MPI's: a message's launch is when `_advance` posts it."""
    from xmesh_plan.executor import torch_engine

    cls = torch_engine.TorchEngine
    advance = cls._advance

    def timed_advance(self, q):
        head = self.heads[q]
        now = time.monotonic()
        advance(self, q)
        for i in self.queues[q][head:self.heads[q]]:
            self._trace["launch"][i] = now

    cls.start, cls._advance = _timed_start(engines, cls.start), timed_advance
    cls._run_local, cls._finish = _stamped(cls._run_local, "launch"), _stamped(cls._finish, "finish")


def _patch(folder: Path, engine: str = "mpi") -> None:
    """Wrap the engine (`mpi` or `torch`) so every step's launch and finish are timed in every reshard; written out at exit."""
    engines: list = []
    atexit.register(lambda: _dump(folder, engines, engine))
    if engine == "torch":
        _patch_torch(engines)
        return
    from xmesh_plan.executor import mpi_engine

    cls = mpi_engine.MpiEngine
    cls.start, cls._launch, cls._finish = _timed_start(engines, cls.start), _stamped(cls._launch, "launch"), _stamped(cls._finish, "finish")
    if os.environ.get("XMESH_NETLAB_POLL"):  # experiment: the engines' (shortest, longest) sleep between polls
        poll = poll_sleeps(os.environ["XMESH_NETLAB_POLL"])
        init = mpi_engine.MpiEngine.__init__

        def polled_init(self, *a, **k):
            init(self, *a, **k)
            self.poll_s = poll

        mpi_engine.MpiEngine.__init__ = polled_init


def _dump(folder: Path, engines: list, kind: str) -> None:
    """Write this rank's traces: per engine (`kind`: mpi or torch) its device, steps and every reshard's launch and finish times."""
    rank = os.environ.get("PMI_RANK", os.environ.get("RANK", str(os.getpid())))
    out = []
    for engine in engines:
        steps = [{"op": s.op, "action": s.action, "peer": s.peer, "nbytes": s.data.nbytes if s.data else 0, "piece": s.piece,
                  **({"receipt": True} if s.data and s.data.buffer == "receipt" else {})}  # the torch engine's, on gloo
                 for s in engine.steps]
        out.append({"device": engine.program.device, "engine": kind, "steps": steps,
                    "reshards": [{"start": t["start"], "launch": [t["launch"].get(s.index) for s in engine.steps],
                                  "finish": [t["finish"].get(s.index) for s in engine.steps]} for t in engine._traces]})
    (folder / f"trace-{rank}.json").write_text(json.dumps(out))


def poll_sleeps(text: str) -> tuple[float, float]:
    """`XMESH_NETLAB_POLL`'s LOW,HIGH: two sleeps in seconds, 0 < LOW <= HIGH."""
    try:
        low, high = (float(v) for v in text.split(","))
        if not 0 < low <= high < float("inf"):
            raise ValueError
    except ValueError:
        raise ValueError(f"XMESH_NETLAB_POLL={text!r}: give LOW,HIGH in seconds with 0 < LOW <= HIGH, e.g. 2e-5,1e-4") from None
    return low, high


def rank_main() -> int:
    """A rank: `executor.run` (or `executor.torch_run`, $XMESH_NETLAB_STEPTRACE_ENGINE=torch) with its steps timed
    into $XMESH_NETLAB_STEPTRACE."""
    engine = os.environ.get(ENGINE_ENV, "mpi")
    _patch(Path(os.environ[TRACE_ENV]), engine)
    if engine == "torch":
        from xmesh_plan.executor.torch_run import main as torch_main
        return torch_main()
    from xmesh_plan.executor.run import console_main
    return console_main("python -m bench.netlab.steptrace")


def op_times(traces: list[dict], reshard: int = -2, engine: int = 0
             ) -> tuple[dict[int, tuple[float, float]], dict[tuple[int, int], tuple[float, float]]]:
    """Measured seconds from the reshard's start (the earliest rank's `start()`): per operation (its first send
    started, or for a local copy its end; its last step finished) and per (operation, device) the same, for the
    `engine`-th engine each rank started (one per plan the ranks ran; a multi-tensor plan in posted order starts one
    per tensor). `reshard` -2: the last timed one before the checked one (whose finished ranks compare their shards
    meanwhile), which needs a warm-up and two timed reshards."""
    traces = [t for t in traces if len(t) > engine]  # a rank that started no engine wrote an empty trace
    counts = {len(t[engine]["reshards"]) for t in traces} or {0}
    if min(counts) < 3 and reshard == -2:
        raise ValueError(f"the ranks ran {min(counts)} reshards; the table takes the last timed one before the checked "
                         "one, so run a warm-up and at least 2 timed ones (--iters 2)")
    zero = min(t[engine]["reshards"][reshard]["start"] for t in traces)
    per_op: dict[int, list[float]] = {}
    per_device: dict[tuple[int, int], list[float]] = {}
    for t in traces:
        r = t[engine]
        times = r["reshards"][reshard]
        for s, launched, finished in zip(r["steps"], times["launch"], times["finish"]):
            unfinished_send = launched is not None and s["action"] == "send" and r.get("engine") == "torch"
            if (finished is None and not unfinished_send) or s.get("receipt"):  # a receipt moves none of the op's bytes
                continue
            key = (s["op"], r["device"])
            # a receive is posted long before bytes move (posted order: at start()), so only sends mark a start; a send
            # whose end no step waited for (the torch engine waits for those after the rest) marks only its start
            lo = launched - zero if s["action"] == "send" else finished - zero
            hi = finished - zero if finished is not None else lo
            for table, k in ((per_op, s["op"]), (per_device, key)):
                was = table.setdefault(k, [lo, hi])
                was[0], was[1] = min(was[0], lo), max(was[1], hi)
    return {k: tuple(v) for k, v in per_op.items()}, {k: tuple(v) for k, v in per_device.items()}


def compare(plan, traces: list[dict], rate_mbit: float, order: str, cpu=None) -> str:
    """A table, operation by operation in plan order: measured (start, end) against the simulator's for `order`
    (with `cpu`, when given, as `predict.testbed_problem`)."""
    from xmesh_plan.schemas.geometry import region_size

    from .experiments import MODEL_OF_ORDER
    from .predict import simulated, testbed_problem

    sim = simulated(plan, testbed_problem(plan, rate_mbit, cpu), MODEL_OF_ORDER[order])
    measured, _ = op_times(traces)
    if not measured:
        raise ValueError("the traces hold no finished step; did the ranks run the plan?")
    lines = ["| op | kind | src -> dsts | MiB | chunks | model start ms | model end ms | first send ms | measured end ms | end late by ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for op in plan.operations:
        m = measured.get(op.id)
        ms, me = (f"{m[0] * 1e3:.1f}", f"{m[1] * 1e3:.1f}") if m else ("-", "-")
        late = f"{(m[1] - sim.op_end_s[op.id]) * 1e3:+.1f}" if m else "-"
        nbytes = plan.problem.itemsize * region_size(op.region)
        lines.append(f"| {op.id} | {op.kind} | {op.src} -> {','.join(map(str, op.dsts))} | {nbytes / 2**20:.2f} | {op.chunks} | "
                     f"{sim.op_start_s[op.id] * 1e3:.1f} | {sim.op_end_s[op.id] * 1e3:.1f} | {ms} | {me} | {late} |")
    total = max(e for _, e in measured.values())
    lines.append(f"\nmodel {sim.makespan_s * 1e3:.1f} ms, measured (this reshard) {total * 1e3:.1f} ms, ratio {total / sim.makespan_s:.3f}")
    return "\n".join(lines)


def traced_run(plan, opts):
    """`run_plan.run_plans([plan], opts)` with every rank's steps timed: (the run's result, one trace per rank)."""
    from .run_plan import run_plans

    if opts.engine not in ("mpi", "torch"):
        raise ValueError(f"steptrace times the mpi or torch engine's steps; got engine {opts.engine!r}")
    before = {key: os.environ.get(key) for key in (TRACE_ENV, ENGINE_ENV)}
    with tempfile.TemporaryDirectory(prefix="netlab-steptrace-") as folder:
        os.environ[TRACE_ENV] = folder  # the ranks inherit it (mpiexec and the torch launcher pass the environment on)
        os.environ[ENGINE_ENV] = opts.engine
        try:
            result = run_plans([plan], replace(opts, module="bench.netlab.steptrace"))
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        traces = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("trace-*.json"))]
    return result, traces


@click.option("--case", default="case9", show_default=True)
@click.option("--approach", default="ours", show_default=True, help="a label of experiments.APPROACHES")
@click.option("--rate", type=float, default=500.0, show_default=True, help="link rate, Mbit/s")
@click.option("--max-mb", type=float, default=32.0, show_default=True)
@click.option("--order", type=click.Choice(["device", "posted"]), default="device", show_default=True)
@click.option("--engine", type=click.Choice(["mpi", "torch"]), default="mpi", show_default=True,
              help="the ranks' engine: MPI, or torch.distributed over gloo")
@click.option("--iters", type=int, default=3, show_default=True)
@click.option("--overhead-us", type=float, default=None,
              help="per-message overhead to plan and predict with (default: measured on the testbed, as experiments --latency-us measure)")
@click.option("--plan-cpu", is_flag=True, help="plan with the testbed's CPU modelled (experiments --plan-cpu)")
@click.option("--keep", help="also write the raw traces and the table into this folder")
@options
def _command(**_):
    """Where a reshard's time goes on the testbed: every step's launch and finish, per operation, against the model."""


def main(argv=None) -> int:
    prog = "python -m bench.netlab.steptrace"
    args = parse(_command, argv, prog)
    if args.iters < 2:
        usage_error(prog, f"--iters {args.iters}: give at least 2 (the table takes the last timed reshard before the checked one)")

    from .experiments import APPROACHES, _plans, measure_message_costs, replace_cores
    from xmesh_plan.planner.reference_cases import reference_problems

    cases = [n for n, _ in reference_problems()]
    if args.case not in cases:
        usage_error(prog, f"--case {args.case!r}: choose one of {', '.join(cases)}")
    labels = [label for label, *_ in APPROACHES]
    if args.approach not in labels:
        usage_error(prog, f"--approach {args.approach!r}: choose one of {', '.join(labels)}")
    from .predict import TESTBED_CPU
    from .run_plan import RunOptions, scaled
    from xmesh_plan.executor.ranks import plan_devices
    from .testbed import LinkShape, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    opts = RunOptions(LinkShape(args.rate, 9000), args.max_mb, args.iters, 1, order=args.order, engine=args.engine)
    overhead = args.overhead_us if args.overhead_us is not None else round(measure_message_costs(opts)[1], 1)
    made = dict(_plans(args.case, args.rate, 0.0, overhead, args.max_mb, replace_cores(TESTBED_CPU) if args.plan_cpu else None))
    plan = made[args.approach]
    if isinstance(plan, str):
        print(f"error: {args.approach} on {args.case}: {plan}", file=sys.stderr)
        return 2
    result, traces = traced_run(plan, opts)
    ranks = len(plan_devices(plan))  # every rank writes a trace at exit, an empty one if it started no engine
    if not result.ok or len(traces) != ranks:
        print(f"error: the run failed ({len(traces)} of {ranks} ranks wrote a trace): {result.launch.stderr[-1500:]}", file=sys.stderr)
        return 1
    table = compare(scaled(plan, args.max_mb), traces, args.rate, args.order, replace_cores(TESTBED_CPU))
    print(f"{args.case} {args.approach} at {args.rate:g} Mbit/s, {args.max_mb:g} MiB, {args.order} order, {args.engine} engine, "
          f"{overhead:g} us per message; median {result.median_s[0] * 1e3:.1f} ms over {args.iters}; "
          f"bit-exact: {result.checked}\n{table}")
    if args.keep:
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        from xmesh_plan.schemas.files import write_atomic

        write_atomic(keep / "traces.json", json.dumps(traces))
        write_atomic(keep / "table.md", table + "\n")
    return 0


if __name__ == "__main__":
    if os.environ.get(TRACE_ENV) and sys.argv[1:2] and sys.argv[1].endswith(".json"):  # a rank: plan files first
        sys.exit(rank_main())
    sys.exit(main())
