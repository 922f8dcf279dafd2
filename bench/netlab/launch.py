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
import time
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
SINGLE_COPY_ENV = {"MPIR_CVAR_CH4_CMA_ENABLE": "1"}
"""MPICH's single-copy transport inside a host (cross memory attach, `process_vm_readv`): a message of 8 KiB or
more is copied once, from the sender's buffer into the receiver's, instead of twice through shared memory.
Off by default in MPICH (it needs ptrace permission between the ranks, which root on one machine has)."""


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


def mpiexec_command(bed: Testbed, plan: Plan, launcher: Path, program: list[str], single_copy: bool = False) -> list[str]:
    counts = ranks_per_host(plan)
    if len(counts) != bed.hosts:
        raise ValueError(f"plan {plan.problem.name or '(unnamed)'} uses {len(counts)} hosts but the testbed has {bed.hosts}")
    hosts = ",".join(f"h{i}:{n}" for i, n in enumerate(counts))
    env = [a for key, value in rank_env(single_copy).items() for a in ("-genv", key, value)]
    return [IP, "netns", "exec", bed.bridge_ns, str(MPIEXEC), "-launcher", "ssh", "-launcher-exec", str(launcher),
            "-localhost", bed.bridge_addr, "-hosts", hosts, "-n", str(sum(counts)), *env, sys.executable, *program]


def rank_env(single_copy: bool = False) -> dict[str, str]:
    """The environment every MPI rank gets: `RANK_ENV`, and `SINGLE_COPY_ENV` with `single_copy`."""
    return {**RANK_ENV, **(SINGLE_COPY_ENV if single_copy else {})}


def run_ranks(bed: Testbed, plan: Plan, program: list[str], timeout_s: float, single_copy: bool = False) -> LaunchResult:
    """Launch `program` (arguments after `python`) on every rank; kill everything in the namespaces after `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix=f"{bed.run_id}-") as folder:
        cmd = mpiexec_command(bed, plan, write_launcher(bed, Path(folder)), program, single_copy)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=dict(os.environ, **rank_env(single_copy)))
        return _collect(bed, [proc], timeout_s)


TORCH_PORT = 29400  # the rendezvous store listens on testbed host 0; each testbed has its own namespaces, so no clash


def torch_rank_commands(bed: Testbed, plan: Plan, program: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """One (command, environment) per rank, as torchrun would set them (env:// rendezvous on host 0), each
    run inside its host's namespace; gloo is held to `eth0`, so ranks of different hosts cross the shaped links."""
    counts = ranks_per_host(plan)
    if len(counts) != bed.hosts:
        raise ValueError(f"plan {plan.problem.name or '(unnamed)'} uses {len(counts)} hosts but the testbed has {bed.hosts}")
    out, rank = [], 0
    for host, n in enumerate(counts):
        for local in range(n):
            env = {"RANK": str(rank), "WORLD_SIZE": str(sum(counts)), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(n),
                   "MASTER_ADDR": bed.host_addr(0), "MASTER_PORT": str(TORCH_PORT), "GLOO_SOCKET_IFNAME": "eth0",
                   "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            out.append(([IP, "netns", "exec", bed.host_ns(host), sys.executable, *program], env))
            rank += 1
    return out


def run_torch_ranks(bed: Testbed, plan: Plan, program: list[str], timeout_s: float) -> LaunchResult:
    """Launch `program` on every rank under torch.distributed (gloo) instead of MPI; rank 0's output is returned."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=dict(os.environ, **env)) for cmd, env in torch_rank_commands(bed, plan, program)]
    return _collect(bed, procs, timeout_s)


def _collect(bed: Testbed, procs: list[subprocess.Popen], timeout_s: float) -> LaunchResult:
    """Wait for every process; the first's output, every process's errors, the worst exit code. After `timeout_s`,
    or on an exception or Ctrl-C, every process in the namespaces is killed: nothing of this run outlives it."""
    deadline = time.monotonic() + timeout_s
    outs, errs, codes, timed_out = [], [], [], False
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_processes(list(bed.namespaces))
                out, err = proc.communicate()
            outs.append(out)
            errs.append(err)
            codes.append(proc.returncode)
        return LaunchResult(max(codes, key=abs), outs[0], "".join(errs), timed_out)
    finally:
        if any(p.poll() is None for p in procs):
            kill_processes(list(bed.namespaces))
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
