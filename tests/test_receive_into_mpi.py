"""The MPI engine writes the caller's arrays in place (`run(shards, into=...)`) on real `mpiexec` ranks: views into
larger parents (rows, columns, every other element: the last two through MPI derived datatypes), converting plans
included, every byte as the engine's own buffers receive it, nothing written outside the views or into the engine's
own buffers, no reference kept, and no buffer of the engine's own made by an executor only ever handed views
(tests/workers/into_mpi_worker.py)."""

from __future__ import annotations

import pytest

from tests.support.launch import MPI_LAUNCH_TIMEOUT_S, MPIEXEC, ROOT, mpiexec

WORKER = ROOT / "tests" / "workers" / "into_mpi_worker.py"
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)"),
              pytest.mark.timeout(2 * MPI_LAUNCH_TIMEOUT_S)]


def test_views_of_the_callers_arrays_receive_in_place_on_4_mpi_ranks():
    result = mpiexec(4, str(WORKER))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    labels = [f"{plan} {order}" for plan in ("three broadcast", "three local_allgather", "three bundles", "converting")
              for order in ("device", "posted")] + ["one tensor"]
    labels += [f"{label} into only" for label in labels]
    assert lines == sorted(f"rank {r}: {label}: ok" for r in range(4) for label in labels), lines
