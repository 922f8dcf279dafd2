"""Conversion at the sender run by the MPI engine under real `mpiexec` ranks (`executor.convert_host`): the plans of
tests/test_convert_torch.py (every sender hook on fp16, bf16, FP8 with block and per-tensor scales; per-tensor scales
over replicated and uneven sources, whose senders swap their amax), every destination element and scale bit for bit
against torch's own cast of the whole tensor (tests/workers/convert_worker.py)."""

from __future__ import annotations

import pytest

from tests.support.launch import MPI_LAUNCH_TIMEOUT_S, MPIEXEC, ROOT, mpiexec

WORKER = ROOT / "tests" / "workers" / "convert_worker.py"
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)"),
              pytest.mark.timeout(2 * MPI_LAUNCH_TIMEOUT_S)]


def test_every_sender_hook_and_swapped_scale_converts_bit_exact_on_4_mpi_ranks():
    result = mpiexec(4, str(WORKER), "mpi")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    runs = ["mpi device order", "mpi posted", "mpi replicated"]
    for rank in range(4):
        mine = sorted(line.split(": ", 1)[1] for line in lines if line.startswith(f"rank {rank}:"))
        assert mine == sorted([f"{run} step {k}: ok" for run in runs for k in (0, 1)] + ["one tensor: ok"]), lines
