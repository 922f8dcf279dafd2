"""Pipeline schedules on the paper's models: iteration time of every schedule against the signal bound.

Models (the paper's Table "Models in end-to-end evaluation", with our stated assumptions):
- GPT-like: uniform transformer stages, one activation (micro-batch, 1024, H) to the next stage,
  sharded on the data-parallel mesh axis and replicated on the operator-parallel one (`S0 R R`).
- U-Transformer-like: 4 U-Net levels (level l: 256/4^l tokens of width H*2^l); every level's
  output also skips to its mirrored decoder stage, so a 2-stage cut carries 4 skips + the bottleneck.
Compute per micro-batch: 2*P*tokens FLOPs forward, the same again for input and for weight
gradients, at 40 TFLOP/s per V100 in FP16 and 10 in FP32 (about a third of FP16 peak, two thirds
of FP32 peak). Each stage is one host of 4 GPUs (logical 2x2 or 4x1); hosts have one 10 Gbit/s
NIC, the paper's p3.8xlarge. Transfer times come from compile_plan (broadcast strategy).

Run: .venv/bin/python -m bench.bench_pipeline [--quick] [--png-dir bench/results] [--examples bench/pipelines]
Writes bench/results/pipeline.json (every case's metrics per schedule), from which `bench/benchmarks_doc.py` makes the
BENCHMARKS.md section "Pipelines".
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from xmesh_plan.planner.pipeline.compare import compare, format_table, row_by_label
from xmesh_plan.planner.pipeline.costs import transfer_costs
from xmesh_plan.planner.pipeline.simulate import evaluate
from xmesh_plan.schemas.pipeline import PipelineProblem
from xmesh_plan.schemas.problem import DeviceMesh
from xmesh_plan.schemas.plan import write_atomic

TFLOPS_PER_GPU = {"float16": 40e12, "float32": 10e12}
GPUS_PER_STAGE = 4
LEVELS = 4
UTRANS_TOKENS = 256
GPT_TOKENS = 1024
RESULTS = Path(__file__).resolve().parent / "results"


def stage_mesh(stage: int, shape: tuple[int, int]) -> DeviceMesh:
    """Stage i on host i: its 4 GPUs as a logical 2x2 (dp x op) or 4x1 mesh."""
    return DeviceMesh(shape=shape, devices=tuple(range(GPUS_PER_STAGE * stage, GPUS_PER_STAGE * (stage + 1))))


def stage_dict(stage: int, mesh: tuple[int, int], flops: float, dtype: str, act_bytes: int) -> dict:
    forward = flops / (GPUS_PER_STAGE * TFLOPS_PER_GPU[dtype])
    return {"name": f"stage{stage}", "mesh": stage_mesh(stage, mesh), "forward_s": round(forward, 9),
            "backward_input_s": round(forward, 9), "backward_weight_s": round(forward, 9), "activation_bytes": act_bytes}


def tensor(name: str, src: int, dst: int, shape: tuple[int, ...], dtype: str, dst_spec: str = "S0 R R") -> dict:
    return {"name": name, "src_stage": src, "dst_stage": dst, "shape": shape, "dtype": dtype, "src_spec": "S0 R R", "dst_spec": dst_spec}


def gpt(name: str, layers: int, hidden: int, stages: int, mesh: tuple[int, int], batch: int, micro_batches: int, dtype: str = "float16") -> PipelineProblem:
    b = batch // micro_batches
    flops = 2 * 12 * layers * hidden**2 * b * GPT_TOKENS / stages
    act = 2 * b * GPT_TOKENS * hidden * (layers // stages)  # 2BSH bytes per layer (the paper's Table)
    st = [stage_dict(i, mesh, flops, dtype, act) for i in range(stages)]
    ts = [tensor(f"h{i}", i, i + 1, (b, GPT_TOKENS, hidden), dtype) for i in range(stages - 1)]
    return PipelineProblem(name=name, stages=st, tensors=ts, micro_batches=micro_batches)


def level_shape(level: int, b: int, hidden: int) -> tuple[int, int, int]:
    return (b, UTRANS_TOKENS // 4**level, hidden * 2**level)


def utrans_tensors(stages: int, b: int, hidden: int, dtype: str) -> list[dict]:
    """Skips from each encoder level to its mirrored stage, and each stage's output to the next."""
    half = stages // 2
    per_stage = LEVELS // half
    out = []
    for level in range(LEVELS):
        src = level // per_stage
        out.append(tensor(f"skip{level}", src, stages - 1 - src, level_shape(level, b, hidden), dtype, "R S1 R"))
    for i in range(stages - 1):
        level = min((i + 1) * per_stage, (stages - 1 - i) * per_stage, LEVELS)
        out.append(tensor(f"h{i}", i, i + 1, level_shape(level, b, hidden), dtype))
    return out


def utrans(name: str, layers: int, hidden: int, stages: int, batch: int, micro_batches: int, dtype: str) -> PipelineProblem:
    b = batch // micro_batches
    flops = 2 * 12 * layers * hidden**2 * b * UTRANS_TOKENS / stages
    act = 2 * b * UTRANS_TOKENS * hidden * (layers // stages)
    st = [stage_dict(i, (2, 2), flops, dtype, act) for i in range(stages)]
    return PipelineProblem(name=name, stages=st, tensors=utrans_tensors(stages, b, hidden, dtype), micro_batches=micro_batches)


def cases(micro_batches: int, quick: bool) -> list[PipelineProblem]:
    m = micro_batches
    out = [
        gpt("gpt-1.3b-2x2-fp16", 24, 2048, 2, (2, 2), 1024, m),
        gpt("gpt-2.6b-2x2-fp16", 32, 2560, 2, (2, 2), 1024, m),
        gpt("gpt-2.6b-4x1-fp16", 32, 2560, 2, (4, 1), 1024, m),
        utrans("utrans-1b-fp16", 24, 1792, 2, 2048, m, "float16"),
        utrans("utrans-2.1b-fp16", 26, 2560, 2, 2048, m, "float16"),
        utrans("utrans-2.1b-fp32", 26, 2560, 2, 2048, m, "float32"),
    ]
    if not quick:
        out += [
            gpt("gpt-2.6b-4stage-fp16", 32, 2560, 4, (2, 2), 1024, m),
            gpt("gpt-2.6b-8stage-fp16", 32, 2560, 8, (2, 2), 1024, m),
            utrans("utrans-2.1b-4stage-fp16", 26, 2560, 4, 2048, m, "float16"),
            utrans("utrans-2.1b-8stage-fp16", 26, 2560, 8, 2048, m, "float16"),
        ]
    return out


def checks(problem: PipelineProblem, rows) -> list[str]:
    """The issue's targets, as text: eager >= 90% of signal (U-Transformer), and the ordering."""
    t = {r.label: r.metrics.iteration_s for r in rows}
    notes = [f"eager-1f1b at {100 * t['signal'] / t['eager-1f1b']:.1f}% of signal"]
    eager, plain = (row_by_label(rows, k).metrics.peak_activation_bytes for k in ("eager-1f1b", "1f1b"))
    notes.append("eager-1f1b activation memory over 1f1b per stage: " + " ".join(f"+{(e - p) / 2**30:.2f}" for e, p in zip(eager, plain)) + " GiB")
    exposed = t["1f1b (no overlap)"] > t["signal"] * 1.001
    if exposed:
        order = t["1f1b (no overlap)"] >= t["1f1b"] >= t["eager-1f1b"] >= t["eager-1f1b-wd"]
        strict = t["1f1b"] > t["eager-1f1b"] > t["eager-1f1b-wd"]
        notes.append("ordering no-overlap >= overlap >= eager >= eager+wd " + ("holds" if order else "FAILS")
                     + ("" if strict else " (not strict)"))
    return notes


@click.command(help=__doc__.splitlines()[0])
@click.option("--micro-batches", type=int, default=16, show_default=True)
@click.option("--quick", is_flag=True, help="only the paper's 2-stage cases")
@click.option("--png-dir", help="write a Gantt chart of 1f1b / eager-1f1b / eager-1f1b-wd per case here")
@click.option("--examples", help="write each case's pipeline JSON here")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS / "pipeline.json", show_default=True,
              help="results JSON")
def main(micro_batches: int, quick: bool, png_dir: str | None, examples: str | None, out: Path) -> None:
    results = []
    for problem in cases(micro_batches, quick):
        started = time.perf_counter()
        costs = transfer_costs(problem)
        rows = compare(problem, costs)
        fwd = sum(c.seconds for c in costs if c.direction == "F")
        click.echo(f"\n### {problem.name}: {len(problem.stages)} stages, {problem.micro_batches} micro-batches, "
                   f"forward {problem.stages[0].forward_s * 1e3:.2f} ms/stage, forward transfers (sum) {fwd * 1e3:.2f} ms per micro-batch "
                   f"({time.perf_counter() - started:.1f} s to plan and simulate)\n")
        click.echo(format_table(rows))
        click.echo("\n" + "; ".join(checks(problem, rows)))
        results.append({"case": problem.name, "stages": len(problem.stages), "micro_batches": problem.micro_batches,
                        "schedules": {r.label: r.metrics.as_dict() for r in rows}})
        if examples:
            Path(examples).mkdir(parents=True, exist_ok=True)
            write_atomic(Path(examples) / f"{problem.name}.json", problem.model_dump_json(indent=1) + "\n")
        if png_dir:
            draw(problem, rows, Path(png_dir))
    command = " ".join([".venv/bin/python -m bench.bench_pipeline"] + sys.argv[1:])
    write_atomic(out, json.dumps({"command": command, "cases": results}, indent=1, sort_keys=True) + "\n")


def draw(problem: PipelineProblem, rows, folder: Path) -> None:
    from xmesh_plan.planner.pipeline.gantt import draw_gantt

    folder.mkdir(parents=True, exist_ok=True)
    for label in ("1f1b", "eager-1f1b", "eager-1f1b-wd"):
        timeline, metrics = evaluate(row_by_label(rows, label).schedule)
        draw_gantt(timeline, str(folder / f"{problem.name}.{label}.png"), f"{problem.name}: {label}, {metrics.iteration_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
