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

from executor.run import bytes_moved
from executor.scale import factors_for, scale_plan
from schemas import Plan
from schemas.plan import write_atomic

from . import counters
from .launch import LaunchResult, plan_hosts, run_ranks
from .testbed import LinkShape, testbed

MAX_RUN_BYTES = 8 * 2**30
_TIMING = re.compile(r"([\d.]+) ms/iter median of \d+ \(min ([\d.]+)\)")


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


@dataclass
class RunResult:
    """What one run measured; `ok` only when the launch exited 0 and (with check) every shard was bit-exact."""

    plan: Plan
    launch: LaunchResult
    run_id: str
    hosts: list[counters.HostBytes] = field(default_factory=list)
    median_s: float | None = None
    min_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.launch.returncode == 0 and not self.launch.timed_out and self.median_s is not None

    @property
    def checked(self) -> bool:
        return "check ok" in self.launch.stdout


def scaled(plan: Plan, max_mb: float) -> Plan:
    """The plan on a tensor shrunk to at most `max_mb` MiB where its boundaries allow (as `executor.run --max-mb`)."""
    return scale_plan(plan, factors_for(plan, int(max_mb * 2**20)))


def _program(path: Path, plan: Plan, opts: RunOptions) -> list[str]:
    ones = ",".join("1" * len(plan.problem.shape))
    return ["-m", "executor.run", str(path), "--scale", ones, "--iters", str(opts.iters), "--warmup", str(opts.warmup),
            "--timeout", f"{opts.rank_timeout_s:g}"] + (["--check"] if opts.check else [])


def run_plan(plan: Plan, opts: RunOptions) -> RunResult:
    """Scale `plan`, run it on a testbed with one namespace per plan host, and compare the link counters."""
    plan = scaled(plan, opts.max_mb)
    reshards = opts.warmup + opts.iters
    total = bytes_moved(plan) * reshards
    if total > opts.max_run_bytes:
        raise ValueError(f"{plan.problem.name or 'plan'} would move {total / 2**30:.1f} GiB in {reshards} reshards, over the "
                         f"{opts.max_run_bytes / 2**30:.1f} GiB bound; lower max_mb or iterations")
    with tempfile.TemporaryDirectory(prefix="netlab-plan-") as folder, testbed(len(plan_hosts(plan)), opts.link) as bed:
        path = Path(folder) / "scaled.plan.json"
        write_atomic(path, plan.to_json())
        before = counters.read_links(bed)
        launch = run_ranks(bed, plan, _program(path, plan, opts), opts.timeout_s)
        after = counters.read_links(bed)
    result = RunResult(plan, launch, bed.run_id, counters.compare(before, after, plan, reshards))
    timing = _TIMING.search(launch.stdout)
    if timing:
        result.median_s, result.min_s = float(timing.group(1)) / 1e3, float(timing.group(2)) / 1e3
    return result
