"""A small numpy MLP split into pipeline stages on meshes of several MPI ranks, trained with every schedule.

Each stage is a linear layer (tanh except the last, which feeds a squared-error loss); activations
are split by rows over the stage's ranks (`S0 R`), so a boundary between meshes of different sizes
is a real resharding. With `--skip`, stage 0's output also goes to the last stage and is added to
its input (a U-Net-style skip). Every rank checks its stage's losses and gradients against a
single-process reference, for every schedule; rank 0 prints one line per schedule.

The executor never imports the planner: `bench/pipeline_mlp_inputs.py` plans the transfers and
writes every schedule into a folder first, and this script reads that folder.

    python bench/pipeline_mlp_inputs.py --meshes 2,1,1,2 --skip -o mlp-inputs
    mpiexec -n 6 python -m xmesh_plan.executor.examples.pipeline_mlp mlp-inputs --steps 3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np

from xmesh_plan.schemas import Plan, load_plan
from xmesh_plan.schemas.geometry import shard_interval
from xmesh_plan.schemas.pipeline import PipelineProblem, PipelineSchedule

from ..flags import MPI_RANK, UsageError, command, launcher_rank, parse
from ..pipeline_runner import PipelineRunner, pipeline_executors, stage_of_device

WIDTH, ROWS, IN_DIM, OUT_DIM, LR = 8, 6, 5, 3, 0.1
RTOL, ATOL = 1e-9, 1e-12
MANIFEST = "manifest.json"  # {"schedules": [file, ...]} in the order they run


def make_problem(meshes: list[int], micro_batches: int, skip: bool) -> PipelineProblem:
    first = np.cumsum([0] + meshes)
    stages = [{"mesh": {"shape": (n,), "devices": tuple(range(first[i], first[i] + n))}, "forward_s": 1.0,
               "backward_input_s": 1.0, "backward_weight_s": 1.0} for i, n in enumerate(meshes)]
    tensor = {"shape": (ROWS, WIDTH), "dtype": "float64", "src_spec": "S0 R", "dst_spec": "S0 R"}
    tensors = [{"name": f"h{i}", "src_stage": i, "dst_stage": i + 1, **tensor} for i in range(len(meshes) - 1)]
    if skip:
        tensors.append({"name": "skip", "src_stage": 0, "dst_stage": len(meshes) - 1, **tensor})
    return PipelineProblem(name="mlp", stages=stages, tensors=tensors, micro_batches=micro_batches)


def plan_file(tensor: str, direction: str) -> str:
    """File name of one transfer's plan in the inputs folder, e.g. `h0.F.plan.json`."""
    return f"{tensor}.{direction}.plan.json"


def load_inputs(folder: Path) -> tuple[list[PipelineSchedule], dict[tuple[str, str], Plan]]:
    """The schedules (in manifest order) and every transfer's plan from a folder written by bench/pipeline_mlp_inputs.py."""
    names = json.loads((folder / MANIFEST).read_text())["schedules"]
    schedules = [PipelineSchedule.from_json((folder / name).read_text()) for name in names]
    problem = schedules[0].pipeline
    if any(s.pipeline != problem for s in schedules):
        raise ValueError(f"{folder}: the schedules are for different pipelines; write the folder again with one command")
    plans = {(n, d): load_plan(folder / plan_file(n, d)) for n, d in problem.transfers()}
    return schedules, plans


def init(stages: int, seed: int = 0):
    """Weights (W, b) per stage, inputs and targets per micro-batch: the same on every rank."""
    rng = np.random.default_rng(seed)
    dims = [IN_DIM] + [WIDTH] * (stages - 1) + [OUT_DIM]
    weights = [(rng.normal(0, 0.5, (dims[k], dims[k + 1])), rng.normal(0, 0.1, dims[k + 1])) for k in range(stages)]
    return weights


def data(micro_batches: int, step: int):
    rng = np.random.default_rng(1000 + step)
    return rng.normal(size=(micro_batches, ROWS, IN_DIM)), rng.normal(size=(micro_batches, ROWS, OUT_DIM))


def reference_step(weights, inputs, targets, skip: bool):
    """Loss and per-stage (dW, db) of one step over all micro-batches, in one process."""
    stages, m = len(weights), len(inputs)
    grads = [(np.zeros_like(w), np.zeros_like(b)) for w, b in weights]
    loss = 0.0
    for x, t in zip(inputs, targets):
        acts, hs = [x], []
        for k, (w, b) in enumerate(weights):
            z = acts[-1] @ w + b
            h = z if k == stages - 1 else np.tanh(z)
            hs.append(h)
            acts.append(h + hs[0] if skip and k == stages - 2 else h)
        loss += 0.5 * np.sum((hs[-1] - t) ** 2) / (ROWS * m)
        dh = (hs[-1] - t) / (ROWS * m)
        skip_grad = None
        for k in reversed(range(stages)):
            dz = dh if k == stages - 1 else dh * (1 - hs[k] ** 2)
            grads[k][0][...] += acts[k].T @ dz
            grads[k][1][...] += dz.sum(0)
            dh = dz @ weights[k][0].T
            if skip and k == stages - 1:
                skip_grad = dh
            if skip and k == 1:
                dh = dh + skip_grad
    return loss, grads


class MlpStage:
    """One stage's compute on this rank's rows; gradients accumulate over the step's micro-batches."""

    def __init__(self, problem: PipelineProblem, stage: int, rows: slice, weights, inputs, targets):
        self.problem, self.stage, self.rows = problem, stage, rows
        self.w, self.b = weights
        self.last = stage == len(problem.stages) - 1
        self.inputs, self.targets = inputs, targets
        self.stash: dict[int, tuple] = {}
        self.dz: dict[int, np.ndarray] = {}
        self.gw, self.gb, self.loss = np.zeros_like(self.w), np.zeros_like(self.b), 0.0
        self.in_names = [t.name for t in problem.tensors if t.dst_stage == stage]
        self.out_names = [t.name for t in problem.tensors if t.src_stage == stage]

    def forward(self, m: int, received: dict) -> dict:
        x = self.inputs[m][self.rows] if self.stage == 0 else sum(received[n] for n in self.in_names)
        z = x @ self.w + self.b
        h = z if self.last else np.tanh(z)
        self.stash[m] = (x, h)
        if self.last:
            self.loss += 0.5 * np.sum((h - self.targets[m][self.rows]) ** 2) / (ROWS * len(self.inputs))
        return {name: h for name in self.out_names}

    def backward_input(self, m: int, grads: dict) -> dict:
        x, h = self.stash[m]
        if self.last:
            dz = (h - self.targets[m][self.rows]) / (ROWS * len(self.inputs))
        else:
            dz = sum(grads[n] for n in self.out_names) * (1 - h**2)
        self.dz[m] = dz
        dx = dz @ self.w.T
        return {name: dx for name in self.in_names}

    def backward_weight(self, m: int) -> None:
        x, _ = self.stash.pop(m)
        dz = self.dz.pop(m)
        self.gw += x.T @ dz
        self.gb += dz.sum(0)


def run(args) -> int:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        schedules, plans = load_inputs(args.inputs)
    except (OSError, ValueError, KeyError) as err:
        if world.Get_rank() == 0:
            print(f"error: {args.inputs}: cannot read the inputs ({str(err).splitlines()[0]}); write them with "
                  "`python bench/pipeline_mlp_inputs.py -o FOLDER`", file=sys.stderr)
        return 2
    problem = schedules[0].pipeline
    meshes = [len(s.mesh.devices) for s in problem.stages]
    skip = any(t.name == "skip" for t in problem.tensors)
    if world.Get_size() != sum(meshes):
        if world.Get_rank() == 0:
            print(f"error: run with mpiexec -n {sum(meshes)} for meshes {','.join(map(str, meshes))}", file=sys.stderr)
        return 2
    stage = stage_of_device(schedules[0], world.Get_rank())
    mesh = problem.stages[stage].mesh.devices
    lo, hi = shard_interval(ROWS, len(mesh), mesh.index(world.Get_rank()))
    stage_comm = world.Split(stage, world.Get_rank())
    executors = pipeline_executors(schedules[0], plans, world)
    failures = 0
    for schedule in schedules:
        name, overlap = schedule.schedule, schedule.overlap
        weights = init(len(meshes))
        ref_weights = [(w.copy(), b.copy()) for w, b in weights]
        worst = 0.0
        for step in range(args.steps):
            inputs, targets = data(problem.micro_batches, step)
            fns = MlpStage(problem, stage, slice(lo, hi), weights[stage], inputs, targets)
            PipelineRunner(schedule, fns, executors, stage).run_iteration()
            gw, gb, loss = fns.gw.copy(), fns.gb.copy(), np.array([fns.loss])
            stage_comm.Allreduce(MPI.IN_PLACE, gw, op=MPI.SUM)
            stage_comm.Allreduce(MPI.IN_PLACE, gb, op=MPI.SUM)
            world.Allreduce(MPI.IN_PLACE, loss, op=MPI.SUM)
            ref_loss, ref_grads = reference_step(ref_weights, inputs, targets, skip)
            ok = (np.allclose(loss[0], ref_loss, rtol=RTOL, atol=ATOL) and np.allclose(gw, ref_grads[stage][0], rtol=RTOL, atol=ATOL)
                  and np.allclose(gb, ref_grads[stage][1], rtol=RTOL, atol=ATOL))
            worst = max(worst, abs(loss[0] - ref_loss), float(np.abs(gw - ref_grads[stage][0]).max()))
            failures += 0 if ok else 1
            w, b = weights[stage]
            weights[stage] = (w - LR * gw, b - LR * gb)
            ref_weights = [(rw - LR * rg[0], rb - LR * rg[1]) for (rw, rb), rg in zip(ref_weights, ref_grads)]
        bad = np.array([failures], np.int64)
        world.Allreduce(MPI.IN_PLACE, bad, op=MPI.SUM)
        if world.Get_rank() == 0:
            label = name + ("" if overlap else " (no overlap)")
            print(f"{'OK' if bad[0] == 0 else 'MISMATCH'} {label}: {args.steps} steps, final loss {loss[0]:.12f} "
                  f"(reference {ref_loss:.12f}), largest difference {worst:.2e}", flush=True)
        failures = int(bad[0])
        if failures:
            return 1
    for executor in executors.values():  # every rank closes the same executors: frees their communicators
        executor.close()
    return 0


PROG = "mpiexec -n N python -m xmesh_plan.executor.examples.pipeline_mlp"


@command(f"{__doc__.splitlines()[0]} INPUTS: the folder bench/pipeline_mlp_inputs.py writes (plans and schedules).")
@click.argument("inputs", type=click.Path(path_type=Path))
@click.option("--steps", type=int, default=3, help="training steps per schedule (default 3)")
def _command(**_) -> None:
    """The flags (`main` reads them)."""


def main(argv: list[str] | None = None) -> None:
    """Every rank reads the same flags; a bad one is one line from rank 0 and exit status 2 on every rank."""
    try:
        args = parse(_command, argv, PROG, show_help=launcher_rank(*MPI_RANK) == 0)
        if args.steps < 1:
            raise UsageError(f"--steps {args.steps}: give at least 1, e.g. --steps 3")
    except UsageError as err:
        if launcher_rank(*MPI_RANK) == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
