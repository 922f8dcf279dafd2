"""PipelineRunner: every schedule trains the example MLP to the single-process result.

In-process (threads, one per stage, with a fake executor) for the runner's logic, and under
mpiexec with the real ReshardingExecutor on meshes of several ranks with sharded tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from xmesh_plan.executor.examples.pipeline_mlp import MlpStage, data, init, make_problem, reference_step
from xmesh_plan.executor.pipeline_runner import PipelineRunner
from xmesh_plan.executor.errors import ExecutorError
from xmesh_plan.planner.pipeline.build import build_schedule
from xmesh_plan.planner.pipeline.schedules import SCHEDULE_NAMES
from xmesh_plan.schemas.pipeline import TransferCost

ROOT = Path(__file__).resolve().parents[1]


class FakeTransfer:
    """One transfer between two threads: the sender's start() hands over a copy, the receiver polls."""

    def __init__(self):
        self.value, self.ready = None, threading.Event()

    def endpoint(self, sending: bool) -> "FakeEndpoint":
        return FakeEndpoint(self, sending)


class FakeEndpoint:
    def __init__(self, transfer: FakeTransfer, sending: bool):
        self.transfer, self.sending = transfer, sending

    def start(self, local_shard=None) -> None:
        if self.sending:
            self.transfer.value = np.array(local_shard, copy=True)
            self.transfer.ready.set()

    def test(self) -> bool:
        return self.sending or self.transfer.ready.is_set()

    def wait(self):
        return None if self.sending else self.transfer.value


def fake_executors(problem, stages: int):
    """Per stage: (tensor, direction, micro-batch) -> its endpoint of a fresh in-process transfer."""
    out = [dict() for _ in range(stages)]
    for name, direction in problem.transfers():
        t = problem.tensor(name)
        src, dst = (t.src_stage, t.dst_stage) if direction == "F" else (t.dst_stage, t.src_stage)
        for m in range(problem.micro_batches):
            transfer = FakeTransfer()
            out[src][(name, direction, m)] = transfer.endpoint(True)
            out[dst][(name, direction, m)] = transfer.endpoint(False)
    return out


def free_costs(problem):
    return tuple(TransferCost(tensor=n, direction=d, seconds=0.5, nics=(f"{n}:{d}",)) for n, d in problem.transfers())


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("stages,skip", [(2, False), (4, True)])
def test_runner_matches_reference_in_process(name, stages, skip):
    problem = make_problem([1] * stages, 4, skip)
    schedule = build_schedule(problem, name, free_costs(problem))
    weights = init(stages)
    inputs, targets = data(4, 0)
    executors = fake_executors(problem, stages)
    fns = [MlpStage(problem, s, slice(None), weights[s], inputs, targets) for s in range(stages)]
    errors = []

    def run(stage):
        try:
            PipelineRunner(schedule, fns[stage], executors[stage], stage, timeout_s=20).run_iteration()
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    loss, grads = reference_step(weights, inputs, targets, skip)
    assert fns[-1].loss == pytest.approx(loss, rel=1e-12)
    for stage in range(stages):
        np.testing.assert_allclose(fns[stage].gw, grads[stage][0], rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(fns[stage].gb, grads[stage][1], rtol=1e-10, atol=1e-14)


def test_runner_refuses_missing_executors():
    problem = make_problem([1, 1], 2, False)
    schedule = build_schedule(problem, "1f1b", free_costs(problem))
    with pytest.raises(ExecutorError, match="no executor for 0SEND_F"):
        PipelineRunner(schedule, None, {}, 0)


def mpirun(tmp_path, ranks: int, inputs_args: list[str], steps: str) -> subprocess.CompletedProcess:
    """The documented two commands: the planner writes plans and schedules, then mpiexec runs the MLP on them."""
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    python, inputs = sys.executable, str(tmp_path / "mlp-inputs")
    made = subprocess.run([python, "bench/pipeline_mlp_inputs.py", *inputs_args, "-o", inputs], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    command = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), python, "-m", "xmesh_plan.executor.examples.pipeline_mlp", inputs,
               "--steps", steps]
    # generous: a passing run takes seconds, but oversubscribed ranks on a loaded 2-core machine can take minutes
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.mpi
@pytest.mark.timeout(900)  # above the two 300 s subprocess limits, so they report first
@pytest.mark.parametrize("ranks,inputs_args,steps", [
    (4, ["--meshes", "2,2"], "3"),
    (6, ["--meshes", "2,1,1,2", "--skip"], "2"),
])
def test_mpi_pipeline_matches_reference_for_every_schedule(tmp_path, ranks, inputs_args, steps):
    result = mpirun(tmp_path, ranks, inputs_args, steps)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("OK", "MISMATCH"))]
    assert len(lines) == len(SCHEDULE_NAMES) + 1
    assert all(line.startswith("OK") for line in lines), result.stdout


@pytest.mark.parametrize("odd", [["--help"], ["--steps", "0"]], ids=["help", "bad-flag"])
def test_a_rank_alone_with_other_flags_ends_the_job(tmp_path, odd):
    """`mpiexec A : B` with `--help` or a bad flag on one rank only: that rank left before MPI started and the other waited
    in MPI_Init for ever. Every rank joins the job and they leave together, exit 2."""
    from tests.support.launch import mpiexec_programs
    mlp = [sys.executable, "-m", "xmesh_plan.executor.examples.pipeline_mlp"]
    result = mpiexec_programs(["-n", "1", *mlp, str(tmp_path / "none")], ["-n", "1", *mlp, str(tmp_path / "other"), *odd],
                              timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "error:" in result.stderr, result.stderr
