"""Launchers for the tests' multi-process runs: `mpiexec` ranks, `torchrun`, and torch.distributed ranks started
one by one with env:// variables (so a rank that dies does not take the others down, as torchrun's agent would).

Every launch runs from the repository root; the ranks import the project as `xmesh_plan` (installed) and
nothing else from the tree, so no search path is set for them. Timeouts only catch hangs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
EXECUTOR_WORKER = ROOT / "tests" / "workers" / "executor_worker.py"
TORCH_WORKER = ROOT / "tests" / "workers" / "torch_worker.py"
MPI_LAUNCH_TIMEOUT_S = 300  # catches a hang only; a passing launch takes seconds, but 16-20 ranks on a loaded 2-core CI box take minutes
TORCH_LAUNCH_TIMEOUT_S = 400  # catches a hang only: 8-16 ranks importing torch on a loaded 2-core machine take a while


def mpiexec(n: int, *args: str, timeout: float = MPI_LAUNCH_TIMEOUT_S, keep_going: bool = False) -> subprocess.CompletedProcess:
    """`mpiexec -n n python ARGS...`; with `keep_going`, a dead rank does not take the others down (they must notice it).

    The timeout only catches a hang: a passing launch ends in seconds, but on a loaded 2-core CI machine
    16-20 oversubscribed ranks can take minutes, so it is generous.
    """
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    cmd = [str(MPIEXEC)] + (["-disable-auto-cleanup"] if keep_going else []) + ["-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def mpiexec_programs(*groups: list[str], timeout: float = MPI_LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """One job of several programs, ranks numbered in order (`mpiexec -disable-auto-cleanup -n A PROG... : -n B PROG...`),
    each group `["-n", "A", program, args...]`; the commands' own one-line reports (no debug tracebacks)."""
    cmd = [str(MPIEXEC), "-disable-auto-cleanup"]
    for k, group in enumerate(groups):
        cmd += ([":"] if k else []) + group
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", XMESH_PLAN_DEBUG="0")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_demo(n: int, plan: Path | str, *flags: str, timeout: float = MPI_LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """The MPI demo on `n` ranks: `mpiexec -n n python -m xmesh_plan.executor.run PLAN FLAGS...`."""
    return mpiexec(n, "-m", "xmesh_plan.executor.run", str(plan), *flags, timeout=timeout)


def torchrun(n: int, module: str, *args: str, timeout: float = TORCH_LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node n -m module ARGS...` (as `python -m torch.distributed.run`, this interpreter's torch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(n: int, worker: Path, *args: str, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start `n` ranks of `worker` with env:// variables of a world of their own (plus `env`); see `run_ranks`."""
    port, procs = free_port(), []
    for rank in range(n):
        rank_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(n),
                    "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(worker), *args], cwd=ROOT, env=rank_env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish_ranks(procs: list[subprocess.Popen], timeout: float = TORCH_LAUNCH_TIMEOUT_S) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each process once every one ended; one still running at the deadline is
    killed, and so are the others."""
    deadline, runs = time.monotonic() + timeout, []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            runs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return runs


def run_ranks(n: int, worker: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = TORCH_LAUNCH_TIMEOUT_S) -> list[tuple[int, str, str]]:
    """Start `n` ranks of `worker` with env:// variables (plus `env`); (return code, stdout, stderr) of each once
    every rank ended. A rank still running at the deadline is killed, and so are the others."""
    return finish_ranks(start_ranks(n, worker, *args, env=env), timeout)


def launch(n: int, *args: str, worker: Path = TORCH_WORKER) -> list[str]:
    """`n` ranks of `worker` (the torch engine's by default); their `rank ...` stdout lines, every rank having succeeded."""
    runs = run_ranks(n, worker, *args)
    failed = [(code, err[-2000:]) for code, _, err in runs if code]
    assert not failed, failed
    return [line for _, out, _ in runs for line in out.splitlines() if line.startswith("rank ")]


def lines_of(runs: list[tuple[int, str, str]]) -> dict[str, list[str]]:
    """What -> every rank's result, in rank order, from `rank R: what: result` lines; every rank must have succeeded."""
    assert not [(code, err[-3000:]) for code, _, err in runs if code], [(code, err[-3000:]) for code, _, err in runs]
    out: dict[str, list[str]] = {}
    for _, text, _ in runs:
        for line in text.splitlines():
            if line.startswith("rank "):
                what, result = line.split(": ", 1)[1].split(": ", 1)
                out.setdefault(what, []).append(result)
    return out
