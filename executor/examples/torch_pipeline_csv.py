"""Run a schedule CSV (from `xmesh-plan schedule --torch-csv`) in torch.distributed.pipelining's own runtime.

One CPU process per CSV row (pipeline rank = stage), gloo, a tiny MLP (one linear layer per stage,
tanh between), one training step. The parent process checks every stage's gradients against the same
model run in one process and prints one line; any mismatch or runtime error exits non-zero.

    xmesh-plan schedule bench/pipelines/gpt-2.6b-4stage-fp16.json --torch-csv s.csv --torch-format compute_comms
    python -m xmesh_plan.executor.examples.torch_pipeline_csv s.csv --format compute_comms --micro-batches 16

Imports torch only (not the planner), and click for its flags; torch's schedule class for a CSV is `_PipelineScheduleRuntime`.
"""

from __future__ import annotations

import csv
import os
import queue
import socket
import sys

import click
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from ..flags import UsageError, command, parse

WIDTH, ROWS_PER_MICRO_BATCH, SEED = 8, 2, 0
RTOL, ATOL = 1e-5, 1e-6


def csv_ranks(path: str) -> int:
    with open(path, newline="") as file:
        return sum(1 for _ in csv.reader(file))


def make_layers(stages: int):
    torch.manual_seed(SEED)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh() if s < stages - 1 else torch.nn.Identity())
            for s in range(stages)]


def make_batch(micro_batches: int):
    generator = torch.Generator().manual_seed(SEED + 1)
    rows = ROWS_PER_MICRO_BATCH * micro_batches
    return torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator)


def reference_gradients(stages: int, micro_batches: int) -> list[list]:
    """The whole model in one process: mean squared error over the batch, as torch's schedule scales it."""
    layers = make_layers(stages)
    inputs, target = make_batch(micro_batches)
    torch.nn.functional.mse_loss(torch.nn.Sequential(*layers)(inputs), target).backward()
    return [[p.grad.clone() for p in layer.parameters()] for layer in layers]


def run_rank(rank: int, world: int, runs: list[tuple[str, str]], micro_batches: int, port: int, results) -> None:
    """One pipeline rank: load each (CSV, format) into torch's runtime, take one step, hand back this stage's gradients."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for path, form in runs:
            layer = make_layers(world)[rank]
            stage = PipelineStage(layer, rank, world, torch.device("cpu"))
            schedule = _PipelineScheduleRuntime([stage], micro_batches, loss_fn=torch.nn.functional.mse_loss)
            schedule._load_csv(path, format=form)
            inputs, target = make_batch(micro_batches)
            schedule.step(*([inputs] if rank == 0 else []), target=target if rank == world - 1 else None)
            results.put((rank, path, form, [p.grad.tolist() for p in layer.parameters()]))  # lists: tensors would share memory
    except Exception as err:  # noqa: BLE001 - report it, so the parent need not wait for the deadline
        results.put((rank, path, form, f"{type(err).__name__}: {err}"))
        raise
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_csvs(runs: list[tuple[str, str]], micro_batches: int, timeout_s: float = 300.0) -> list[str]:
    """Run each (CSV, format) in turn on one set of processes, as many as the CSVs have rows; return the problems
    found (empty: every rank's gradients match the single-process model). Processes start once: importing torch is slow."""
    world, port = csv_ranks(runs[0][0]), free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=run_rank, args=(r, world, runs, micro_batches, port, results)) for r in range(world)]
    for process in processes:
        process.start()
    got: dict = {}
    try:
        while len(got) < world * len(runs):
            rank, path, form, grads = results.get(timeout=timeout_s)
            got[(rank, path, form)] = grads
            if isinstance(grads, str):
                break
    except queue.Empty:
        pass
    finally:
        for process in processes:  # a rank that failed leaves its peers waiting on a receive
            process.join(5 if len(got) == world * len(runs) else 0)
            if process.is_alive():
                process.terminate()
    expected = reference_gradients(world, micro_batches)
    problems = []
    for (rank, path, form), grads in sorted(got.items()):
        if isinstance(grads, str):
            problems.append(f"{path} ({form}), rank {rank}: {grads}")
        elif not all(torch.allclose(torch.tensor(a), b, rtol=RTOL, atol=ATOL) for a, b in zip(grads, expected[rank])):
            problems.append(f"{path} ({form}), rank {rank}: gradients differ from the single-process model")
    if not problems and len(got) < world * len(runs):
        problems.append(f"only {len(got)} of {world * len(runs)} rank results came within {timeout_s:.0f} s")
    return problems


PROG = "python -m xmesh_plan.executor.examples.torch_pipeline_csv"


@command(__doc__.splitlines()[0])
@click.argument("csv_file")
@click.option("--format", "form", type=click.Choice(("compute_only", "compute_comms")), default="compute_only",
              help="the CSV's format, as `xmesh-plan schedule --torch-format` wrote it (default compute_only)")
@click.option("--micro-batches", type=int, required=True, help="the pipeline's micro_batches")
def _command(**_) -> None:
    """The flags (`main` reads them)."""


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(_command, argv, PROG)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    problems = run_csvs([(args.csv_file, args.form)], args.micro_batches)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{args.csv_file}: {csv_ranks(args.csv_file)} ranks ran in torch's runtime; gradients match one process")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
