"""Every schedule on one pipeline, side by side: which wins, and how much communication each exposes.

Rows: 1F1B with blocking transfers (no overlap), GPipe, 1F1B, eager-1F1B and eager-1F1B with weight
delaying (all overlapping), and the signal bound: the fastest of those schedules when every transfer
is free (the paper's "signal send/recv"). Splitting off the weight gradient also fills pipeline
bubbles, so the bound includes the `-wd` schedules; otherwise eager-1f1b-wd could beat it.
"""

from __future__ import annotations

from dataclasses import dataclass

from xmesh_plan.schemas.pipeline import PipelineProblem, PipelineSchedule, TransferCost

from .build import build_schedule
from .costs import signal_costs
from .simulate import Metrics, evaluate

VARIANTS = (  # label, schedule, overlap
    ("1f1b (no overlap)", "1f1b", False),
    ("gpipe", "gpipe", True),
    ("1f1b", "1f1b", True),
    ("eager-1f1b", "eager-1f1b", True),
    ("eager-1f1b-wd", "eager-1f1b-wd", True),
)
SIGNAL_CANDIDATES = ("1f1b", "eager-1f1b", "1f1b-wd", "eager-1f1b-wd")


@dataclass(frozen=True)
class Row:
    label: str
    schedule: PipelineSchedule
    metrics: Metrics


def compare(problem: PipelineProblem, costs: tuple[TransferCost, ...]) -> list[Row]:
    rows = []
    for label, name, overlap in VARIANTS:
        schedule = build_schedule(problem, name, costs, overlap)
        rows.append(Row(label, schedule, evaluate(schedule)[1]))
    return rows + [signal_bound(problem, costs)]


def signal_bound(problem: PipelineProblem, costs: tuple[TransferCost, ...]) -> Row:
    """The fastest candidate schedule with free transfers (ties: the first listed)."""
    best = None
    for name in SIGNAL_CANDIDATES:
        schedule = build_schedule(problem, name, signal_costs(costs))
        metrics = evaluate(schedule)[1]
        if best is None or metrics.iteration_s < best.metrics.iteration_s - 1e-12:
            best = Row("signal", schedule, metrics)
    return best


def row_by_label(rows: list[Row], label: str) -> Row:
    return next(r for r in rows if r.label == label)


def format_table(rows: list[Row]) -> str:
    """A markdown table; throughput is relative to the signal bound, memory to 1F1B's peak."""
    signal = row_by_label(rows, "signal").metrics.iteration_s
    base = row_by_label(rows, "1f1b").metrics.peak_in_flight
    lines = ["| schedule | iteration (ms) | % of signal throughput | bubble | exposed comm (ms) | weight delay | peak in-flight micro-batches per stage (vs 1f1b) |",
             "|---|---:|---:|---:|---:|---|---|"]
    for row in rows:
        m = row.metrics
        memory = " ".join(f"{p}({p - b:+d})" for p, b in zip(m.peak_in_flight, base))
        delay = ",".join(map(str, row.schedule.weight_delay)) or "-"
        label = f"signal ({row.schedule.schedule}, free transfers)" if row.label == "signal" else row.label
        lines.append(f"| {label} | {m.iteration_s * 1e3:.2f} | {100 * signal / m.iteration_s:.1f} | {m.bubble_fraction:.3f} "
                     f"| {m.exposed_comm_s * 1e3:.2f} | {delay} | {memory} |")
    return "\n".join(lines)
