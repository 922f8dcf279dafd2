"""A PNG Gantt chart like the paper's figure: stages as rows, micro-batch numbers in boxes, transfers drawn.

Each stage has a compute row and, below it, a thin row with the transfers arriving at it.
matplotlib is optional (the `plot` extra) and imported only here, on use.
"""

from __future__ import annotations

import io
import textwrap

from schemas.plan import write_atomic

from .simulate import Timeline

COLORS = {"F": "#7fb3e0", "B": "#8fd18f", "I": "#8fd18f", "W": "#f2b56b", "RECV_F": "#3b6fa8", "RECV_B": "#3f8f3f"}
ROW, LANE = 1.0, 0.35
LEGEND = {"F": "forward", "B": "backward", "I": "backward (input part)", "W": "backward (weight part)"}
TITLE_PT, LABEL_PT, DPI = 9, 7, 120


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


def _box(ax, start: float, end: float, y: float, height: float, color: str, label: str):
    """A box; with a label, its text (centred) is returned so labels that do not fit can be dropped once laid out."""
    ax.add_patch(_rect(start, y, end - start, height, color))
    if label:
        return ax.text((start + end) / 2, y + height / 2, label, ha="center", va="center", fontsize=LABEL_PT)
    return None


def _drop_labels_that_overflow(fig, ax, labelled: list) -> None:
    """Keep a micro-batch number only where it fits inside its box, measured after layout."""
    renderer = fig.canvas.get_renderer()
    for text, start, end in labelled:
        left, right = ax.transData.transform([(start, 0), (end, 0)])[:, 0]
        if text.get_window_extent(renderer).width + 2 > right - left:
            text.remove()


def _rect(x: float, y: float, width: float, height: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, facecolor=color, edgecolor="black", linewidth=0.4)


def _fit_title(fig, title_text, title: str) -> None:
    """Wrap the title into as few lines as keep it inside the figure's right edge, measured, not guessed."""
    if not title:
        return
    renderer = fig.canvas.get_renderer()
    per_line = len(title)
    while True:
        title_text.set_text("\n".join(textwrap.wrap(title, per_line)))
        extent = title_text.get_window_extent(renderer)
        if extent.x1 <= fig.bbox.width - 4 or per_line <= 20:
            break
        per_line = max(20, min(per_line - 1, int(per_line * (fig.bbox.width - 4 - extent.x0) / extent.width)))


def draw_gantt(timeline: Timeline, path: str, title: str = "") -> None:
    """Write the chart to `path` (PNG); times are shown in milliseconds."""
    plt = _pyplot()
    fig = gantt_figure(timeline, title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def gantt_figure(timeline: Timeline, title: str = ""):
    """The laid-out matplotlib figure (the caller closes it): boxes, fitted labels and title, legend of the kinds drawn."""
    plt = _pyplot()
    scale = 1e3
    span = max(timeline.iteration_s * scale, 1e-9)
    width = max(8.0, min(24.0, 0.25 * len(timeline.compute) / max(timeline.stages, 1)))
    height = 0.9 + 0.8 * timeline.stages
    fig, ax = plt.subplots(figsize=(width, height), dpi=DPI)
    labelled = []
    for c in timeline.compute:
        start, end = c.start_s * scale, c.end_s * scale
        text = _box(ax, start, end, _row_top(c.action.stage), ROW, COLORS[c.action.kind], f"{c.action.micro_batch}")
        labelled.append((text, start, end))
    for t in timeline.transfers:
        y = _row_top(t.dst_stage) - LANE
        _box(ax, t.start_s * scale, t.end_s * scale, y, LANE, COLORS["RECV_" + t.direction], "")
    ticks = [_row_top(s) + ROW / 2 for s in range(timeline.stages)]
    ax.set_yticks(ticks, [f"stage {s}" for s in range(timeline.stages)])
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(_row_top(timeline.stages - 1) - LANE - 0.2, ROW + 0.2)
    ax.set_xlabel("time (ms); thin rows: transfers arriving at the stage (blue forward, green gradient)")
    title_text = ax.set_title(title, fontsize=TITLE_PT, loc="left", pad=16)  # room below the title for the legend row
    kinds = [k for k in LEGEND if any(c.action.kind == k for c in timeline.compute)]  # "B" or "I" and "W"
    ax.legend([_rect(0, 0, 1, 1, COLORS[k]) for k in kinds], [LEGEND[k] for k in kinds], loc="lower left",
              bbox_to_anchor=(0.0, 1.0), fontsize=LABEL_PT, ncol=len(kinds), frameon=False)
    for _ in range(2):  # the layout moves the title's left edge; fit it, lay out, fit again
        _fit_title(fig, title_text, title)
        fig.set_size_inches(width, height + 0.16 * title_text.get_text().count("\n"))
        fig.tight_layout()
    _drop_labels_that_overflow(fig, ax, labelled)
    return fig
