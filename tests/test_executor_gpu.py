"""NCCL backend on a real GPU; skipped with the reason where CuPy or a CUDA device is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_executor_cases import compiled, problem, write_plans

ROOT = Path(__file__).resolve().parents[1]


def _gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install cupy-cuda12x to run the NCCL backend tests)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as err:
        return f"CuPy finds no CUDA device ({err})"
    return None if count else "CuPy finds no CUDA device"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_reason() is not None, reason=_gpu_reason() or "")]


def _run(n: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONPATH=str(ROOT))
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(n), sys.executable, "-m", "executor.run", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_single_gpu_copies_and_pack_unpack_bit_exact(tmp_path):
    """One rank that is both meshes: local copies of strided boxes on the GPU."""
    one = problem("gpu_local", (64, 48, 8), (1,), (0,), "R R R", (1,), (0,), "R R R")
    path = write_plans(tmp_path, [compiled(one, "broadcast")])[0]
    result = _run(1, path, "--backend", "nccl", "--check", "--scale", "1,1,1")
    assert result.returncode == 0 and "check ok" in result.stdout, result.stderr[-3000:]


def test_two_ranks_share_one_gpu_with_fake_hosts(tmp_path):
    """NCCL_HOSTID per rank + socket transport: the workaround for 'Duplicate GPU detected'."""
    two = problem("gpu_pair", (64, 48), (1,), (0,), "R R", (1,), (1,), "R S0")
    path = write_plans(tmp_path, [compiled(two, "send_recv")])[0]
    result = _run(2, path, "--backend", "nccl", "--check", "--gpu", "0", "--fake-hosts", "--scale", "1,1")
    assert result.returncode == 0 and "check ok" in result.stdout, result.stderr[-3000:]
