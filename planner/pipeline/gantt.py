"""A PNG Gantt chart like the paper's figure: stages as rows, micro-batch numbers in boxes, transfers drawn.

Each stage has a compute row and, below it, a thin row with the transfers arriving at it.
matplotlib is optional (the `plot` extra) and imported only here, on use.
"""

from __future__ import annotations

import io

from schemas.plan import write_atomic

from .simulate import Timeline

COLORS = {"F": "#7fb3e0", "B": "#8fd18f", "I": "#8fd18f", "W": "#f2b56b", "RECV_F": "#3b6fa8", "RECV_B": "#3f8f3f"}
ROW, LANE = 1.0, 0.35


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("drawing a PNG needs matplotlib; install it with: pip install 'xmesh-plan[plot]'") from None
    return plt


def _row_top(stage: int) -> float:
    return -stage * (ROW + LANE + 0.3)


def _box(ax, start: float, end: float, y: float, height: float, color: str, label: str, min_label: float) -> None:
    ax.add_patch(_rect(start, y, end - start, height, color))
    if end - start >= min_label and label:
        ax.text((start + end) / 2, y + height / 2, label, ha="center", va="center", fontsize=7)


def _rect(x: float, y: float, width: float, height: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, facecolor=color, edgecolor="black", linewidth=0.4)


def draw_gantt(timeline: Timeline, path: str, title: str = "") -> None:
    """Write the chart to `path` (PNG); times are shown in milliseconds."""
    plt = _pyplot()
    scale = 1e3
    span = max(timeline.iteration_s * scale, 1e-9)
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.25 * len(timeline.compute) / max(timeline.stages, 1))), 0.9 + 0.8 * timeline.stages))
    min_label = span / 60
    for c in timeline.compute:
        y = _row_top(c.action.stage)
        _box(ax, c.start_s * scale, c.end_s * scale, y, ROW, COLORS[c.action.kind], f"{c.action.micro_batch}", min_label)
    for t in timeline.transfers:
        y = _row_top(t.dst_stage) - LANE
        _box(ax, t.start_s * scale, t.end_s * scale, y, LANE, COLORS["RECV_" + t.direction], "", min_label)
    ticks = [_row_top(s) + ROW / 2 for s in range(timeline.stages)]
    ax.set_yticks(ticks, [f"stage {s}" for s in range(timeline.stages)])
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(_row_top(timeline.stages - 1) - LANE - 0.2, ROW + 0.2)
    ax.set_xlabel("time (ms); thin rows: transfers arriving at the stage (blue forward, green gradient)")
    ax.set_title(title, fontsize=9, loc="left", pad=16)  # room below the title for the legend row
    handles = [_rect(0, 0, 1, 1, COLORS[k]) for k in ("F", "B", "W")]
    ax.legend(handles, ["forward", "backward (input part)", "backward (weight part)"], loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncol=3, frameon=False)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
