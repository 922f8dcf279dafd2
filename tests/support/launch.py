"""Launchers for the tests' multi-process runs: `mpiexec` ranks and torch.distributed ranks (env://)."""

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
    """Launch `n` ranks; with `keep_going`, a dead rank does not take the others down (they must notice it).

    The timeout only catches a hang: a passing launch ends in seconds, but on a loaded 2-core CI machine
    16-20 oversubscribed ranks can take minutes, so it is generous.
    """
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONPATH=str(ROOT))
    cmd = [str(MPIEXEC)] + (["-disable-auto-cleanup"] if keep_going else []) + ["-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, *args: str, worker: Path = TORCH_WORKER) -> list[str]:
    """Start `n` ranks of `worker` with env:// variables; their stdout lines, after every rank ended."""
    port, procs = free_port(), []
    for rank in range(n):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(worker), *args], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = []
    deadline = time.monotonic() + TORCH_LAUNCH_TIMEOUT_S
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append((proc.returncode, out, err))
    lines = [line for _, out, _ in outputs for line in out.splitlines() if line.startswith("rank ")]
    failed = [(code, err[-2000:]) for code, _, err in outputs if code]
    assert not failed, failed
    return lines
