"""Run `python -m xmesh_plan.executor.run` with each host's ranks inside that host's namespace.

One Hydra proxy per host namespace: mpiexec runs in the bridge namespace and "logs in" to host
`h<i>` through a launcher script that runs the proxy under `ip netns exec <run>-h<i>`, so ranks of
one host share memory and ranks of different hosts talk TCP over the shaped links. UCX is held to
TCP on `eth0` (left alone it finds shared memory across namespaces and the links carry nothing).
Rank r plays the plan's r-th device; Hydra fills hosts in order, so `-hosts h0:4,h1:4` puts the
ranks of plan host 0 on testbed host 0 and so on.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.schemas import Plan

from .testbed import IP, Testbed, kill_processes

MPIEXEC = Path(sys.executable).parent / "mpiexec"
ROOT = Path(__file__).resolve().parents[2]
RANK_ENV = {
    "UCX_TLS": "tcp,self",  # no shared memory between hosts
    "UCX_NET_DEVICES": "eth0",
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",  # blocking MPI calls yield the core instead of spinning
    "PYTHONPATH": str(ROOT),
}


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def plan_hosts(plan: Plan) -> tuple[int, ...]:
    """The plan's hosts in order; testbed host i plays plan host `plan_hosts(plan)[i]`."""
    return tuple(sorted({plan.problem.cluster.host_of(d) for d in plan_devices(plan)}))


def ranks_per_host(plan: Plan) -> tuple[int, ...]:
    """How many ranks each testbed host runs (ranks of one host are consecutive, as devices are sorted)."""
    count = Counter(plan.problem.cluster.host_of(d) for d in plan_devices(plan))
    return tuple(count[h] for h in plan_hosts(plan))


def write_launcher(bed: Testbed, folder: Path) -> Path:
    """The script Hydra calls as `ssh`: `launcher [-x ...] h<i> command...` runs the command in host i's namespace."""
    path = folder / "netns-launcher.sh"
    path.write_text("#!/bin/sh\n"
                    'while [ "${1#-}" != "$1" ]; do shift; done\n'  # drop ssh options (-x)
                    'host="$1"; shift\n'
                    f'exec {IP} netns exec {shlex.quote(bed.run_id)}-"$host" sh -c "$*"\n')
    path.chmod(0o755)
    return path


def mpiexec_command(bed: Testbed, plan: Plan, launcher: Path, program: list[str]) -> list[str]:
    counts = ranks_per_host(plan)
    if len(counts) != bed.hosts:
        raise ValueError(f"plan {plan.problem.name or '(unnamed)'} uses {len(counts)} hosts but the testbed has {bed.hosts}")
    hosts = ",".join(f"h{i}:{n}" for i, n in enumerate(counts))
    env = [a for key, value in RANK_ENV.items() for a in ("-genv", key, value)]
    return [IP, "netns", "exec", bed.bridge_ns, str(MPIEXEC), "-launcher", "ssh", "-launcher-exec", str(launcher),
            "-localhost", bed.bridge_addr, "-hosts", hosts, "-n", str(sum(counts)), *env, sys.executable, *program]


def run_ranks(bed: Testbed, plan: Plan, program: list[str], timeout_s: float) -> LaunchResult:
    """Launch `program` (arguments after `python`) on every rank; kill everything in the namespaces after `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix=f"{bed.run_id}-") as folder:
        cmd = mpiexec_command(bed, plan, write_launcher(bed, Path(folder)), program)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=dict(os.environ, **RANK_ENV))
        try:
            out, err = proc.communicate(timeout=timeout_s)
            return LaunchResult(proc.returncode, out, err, False)
        except subprocess.TimeoutExpired:
            kill_processes(list(bed.namespaces))
            out, err = proc.communicate()
            return LaunchResult(proc.returncode, out, err, True)
        finally:  # an exception or Ctrl-C while waiting: nothing of this run may outlive it
            if proc.poll() is None:
                kill_processes(list(bed.namespaces))
                proc.kill()
                proc.communicate()
