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


def test_the_mpi_demo_refuses_a_converting_plan_in_one_line_on_every_rank(tmp_path):
    """The demo fills and checks shards of the source dtype, which a conversion does not keep: refused before any byte
    moves, as the torch demo refuses it (the MPI engine itself runs such a plan)."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.problem_io import build_problem
    from xmesh_plan.schemas.plan_io import write_plan_file

    mesh = {"shape": [2], "devices": [0, 1]}
    plan = compile_plan(build_problem({"shape": [8, 4], "dtype": "float32", "dst_dtype": "fp16", "src": {"mesh": mesh, "spec": "S0 R"},
                                       "dst": {"mesh": mesh, "spec": "R S0"}}), solver="greedy")
    path = tmp_path / "cast.plan.json"
    write_plan_file(path, plan)
    result = mpiexec(2, "-m", "xmesh_plan.executor.run", str(path), "--check")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "check ok" not in result.stdout
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert "the plan converts float32 to float16 at the sender, and this command fills and checks shards of the source dtype" \
        in result.stderr, result.stderr
