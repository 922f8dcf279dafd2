"""Run one plan on a fresh testbed: scale it, launch its ranks, read the link counters, tear down.

Every run is bounded: in time (`timeout_s`: the launch is killed, then the testbed removed) and in
bytes (`max_run_bytes`: a plan that would move more across devices in all its iterations is refused
before anything starts).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from xmesh_plan.executor.run import bytes_moved
from xmesh_plan.executor.scale import factors_for, factors_per_tensor, scale_plan, scale_tensors
from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.plan_tensors import is_multi
from xmesh_plan.schemas.plan import write_atomic

from . import counters
from .launch import LaunchResult, plan_hosts, ranks_per_host, run_ranks, run_torch_ranks
from .testbed import LinkShape, testbed

MAX_RUN_BYTES = 8 * 2**30
_TIMING = re.compile(r"([\d.]+) ms/iter median of \d+ \(min ([\d.]+)\)")


class PlansRefusedError(ValueError):
    """Plans refused before anything started: different rank layouts, or more bytes than `max_run_bytes`."""


@dataclass(frozen=True)
class RunOptions:
    """How to run a plan: link shape, tensor size, iterations and the bounds on time and bytes."""

    link: LinkShape
    max_mb: float = 64.0
    iters: int = 5
    warmup: int = 1
    check: bool = True
    timeout_s: float = 600.0
    rank_timeout_s: float = 120.0
    max_run_bytes: int = MAX_RUN_BYTES
    order: str = "device"  # the executor's --order: device (one operation at a time per device, the default) or posted
    engine: str = "mpi"  # mpi (mpiexec, executor.run) or torch (torch.distributed over gloo, executor.torch_run)
    single_copy: bool = False  # mpi: MPICH's single-copy transport inside a host (launch.SINGLE_COPY_ENV)
    module: str | None = None  # the ranks' `python -m` module in place of the engine's runner (steptrace's timed runner)


@dataclass
class RunResult:
    """One launch of one or more plans: per plan the median and fastest time per iteration (None if it printed none).

    `ok` only when the launch exited 0 in time and every plan reported a time; `checked` when every
    plan's destination shards were bit-exact. `hosts` compares the links with all plans together.
    """

    plans: list[Plan]
    launch: LaunchResult
    run_id: str
    hosts: list[counters.HostBytes] = field(default_factory=list)
    median_s: list[float | None] = field(default_factory=list)
    min_s: list[float | None] = field(default_factory=list)
    retransmits: dict[int, int] = field(default_factory=dict)  # host -> TCP segments sent again (a fresh namespace starts at 0)

    @property
    def ok(self) -> bool:
        return self.launch.returncode == 0 and not self.launch.timed_out and None not in self.median_s

    @property
    def checked(self) -> bool:
        return self.launch.stdout.count("check ok") == len(self.plans)


def scaled(plan: Plan, max_mb: float) -> Plan:
    """The plan on tensors shrunk to at most `max_mb` MiB each where their boundaries allow (as `executor.run --max-mb`)."""
    if is_multi(plan):
        return scale_tensors(plan, factors_per_tensor(plan, int(max_mb * 2**20)))
    return scale_plan(plan, factors_for(plan, int(max_mb * 2**20)))


def _program(paths: list[Path], plan: Plan, opts: RunOptions) -> list[str]:
    """The rank's command line after `python`; the plans are scaled already, so neither runner shrinks them again."""
    single = opts.engine == "mpi" and not is_multi(plan)
    keep = ["--scale", ",".join("1" * len(plan.problem.shape))] if single else ["--max-mb", str(2**20)]
    module = opts.module or {"mpi": "xmesh_plan.executor.run", "torch": "xmesh_plan.executor.torch_run"}[opts.engine]
    return ["-m", module, *map(str, paths), *keep, "--iters", str(opts.iters), "--warmup", str(opts.warmup),
            "--timeout", f"{opts.rank_timeout_s:g}", "--order", opts.order] + (["--check"] if opts.check else [])


def _check_bounds(plans: list[Plan], opts: RunOptions) -> None:
    """Refuse plans that need different rank layouts, or that would move more than `max_run_bytes` in all."""
    layouts = {ranks_per_host(p) for p in plans}
    if len(layouts) != 1:
        raise PlansRefusedError(f"plans launched together need the same ranks per host; got {sorted(layouts)}")
    total = sum(bytes_moved(p) for p in plans) * (opts.warmup + opts.iters)
    if total > opts.max_run_bytes:
        raise PlansRefusedError(f"these plans would move {total / 2**30:.1f} GiB in {opts.warmup + opts.iters} reshards each, over the "
                         f"{opts.max_run_bytes / 2**30:.1f} GiB bound; lower max_mb or iterations (or raise the bound: experiments --max-run-gib)")


def run_plans(plans: list[Plan], opts: RunOptions) -> RunResult:
    """Scale the plans, run them one after another in one launch on a testbed with one namespace per plan host, and
    compare the link counters with all their bytes. One launch pays the start-up (seconds per rank) once."""
    plans = [scaled(p, opts.max_mb) for p in plans]
    _check_bounds(plans, opts)
    reshards = opts.warmup + opts.iters
    with tempfile.TemporaryDirectory(prefix="netlab-plan-") as folder, testbed(len(plan_hosts(plans[0])), opts.link) as bed:
        paths = [Path(folder) / f"{i}.plan.json" for i in range(len(plans))]
        for path, plan in zip(paths, plans):
            write_atomic(path, plan.to_json())
        before = counters.read_links(bed)
        program = _program(paths, plans[0], opts)
        if opts.engine == "torch":
            launch = run_torch_ranks(bed, plans[0], program, opts.timeout_s)
        else:
            launch = run_ranks(bed, plans[0], program, opts.timeout_s, opts.single_copy)
        after = counters.read_links(bed)
        retransmits = counters.retransmitted_segments(bed)
    result = RunResult(plans, launch, bed.run_id, counters.compare_many(before, after, plans, reshards), retransmits=retransmits)
    times = [line for line in launch.stdout.splitlines() if _TIMING.search(line)]
    for i in range(len(plans)):
        timing = _TIMING.search(times[i]) if i < len(times) else None
        result.median_s.append(float(timing.group(1)) / 1e3 if timing else None)
        result.min_s.append(float(timing.group(2)) / 1e3 if timing else None)
    return result


def run_plan(plan: Plan, opts: RunOptions) -> RunResult:
    return run_plans([plan], opts)
