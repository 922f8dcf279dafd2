"""A PNG Gantt chart like the paper's figure: stages as rows, micro-batch numbers in boxes, transfers drawn.

Each stage has a compute row and, below it, one thin row per tensor arriving at it (named on the
left, e.g. `h0 from s0`, `h1.grad from s2`), its boxes numbered by micro-batch. A number that does
not fit its box is shrunk, then turned upright; one that still does not fit is drawn at the
smallest size anyway, never dropped. matplotlib is optional (the `plot` extra), imported on use.
"""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass

from xmesh_plan.schemas.plan import write_atomic

from .simulate import Timeline, TransferSpan

COLORS = {"F": "#7fb3e0", "B": "#8fd18f", "I": "#8fd18f", "W": "#f2b56b", "RECV_F": "#3b6fa8", "RECV_B": "#3f8f3f"}
ROW, LANE, GAP = 1.0, 0.4, 0.3
LEGEND = {"F": "forward", "B": "backward", "I": "backward (input part)", "W": "backward (weight part)"}
TITLE_PT, DPI = 9, 120
COMPUTE_PT, LANE_PT = (7.0, 6.0, 5.0), (5.5, 4.5)  # label sizes tried in turn, largest first
Route = tuple[str, str, int]  # tensor, direction, sending stage


@dataclass(frozen=True)
class Rows:
    """Where each stage's compute row and each arriving route's lane sit (data y of their bottom edge)."""

    stage_bottom: tuple[float, ...]
    lane_bottom: dict[tuple[int, Route], float]
    bottom: float

    @staticmethod
    def of(timeline: Timeline) -> "Rows":
        arriving: dict[int, set[Route]] = {s: set() for s in range(timeline.stages)}
        for t in timeline.transfers:
            arriving[t.dst_stage].add(route_of(t))
        y, stage_bottom, lane_bottom = 0.0, [], {}
        for stage in range(timeline.stages):
            y -= ROW
            stage_bottom.append(y)
            for route in sorted(arriving[stage], key=lambda r: (r[1] == "B", r[0], r[2])):  # forward lanes first
                y -= LANE
                lane_bottom[(stage, route)] = y
            y -= GAP
        return Rows(tuple(stage_bottom), lane_bottom, y + GAP)


def route_of(t: TransferSpan) -> Route:
    return (t.tensor, t.direction, t.src_stage)


def lane_name(route: Route) -> str:
    tensor, direction, src = route
    return f"{tensor}{'.grad' if direction == 'B' else ''} from s{src}"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("drawing a PNG needs matplotlib; install it with: pip install 'xmesh-plan[plot]'") from None
    return plt


def _box(ax, start: float, end: float, y: float, height: float, color: str, label: str, sizes: tuple[float, ...]):
    """A box and its centred label; returns (text, box) so the label can be fitted once the figure is laid out."""
    box = _rect(start, y, end - start, height, color)
    ax.add_patch(box)
    return ax.text((start + end) / 2, y + height / 2, label, ha="center", va="center", fontsize=sizes[0]), box


def _fit_label(text, box, renderer, sizes: tuple[float, ...], upright: bool) -> None:
    """Shrink the label (then, if `upright`, turn it upright) until it fits its box; at worst keep the smallest."""
    edge = box.get_window_extent(renderer)
    for rotation in (0, 90) if upright else (0,):
        text.set_rotation(rotation)
        for size in sizes:
            text.set_fontsize(size)
            extent = text.get_window_extent(renderer)
            if extent.width + 2 <= edge.width and extent.height <= edge.height:
                return


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
    scale, rows = 1e3, Rows.of(timeline)
    width = max(8.0, min(24.0, 0.25 * len(timeline.compute) / max(timeline.stages, 1)))
    height = 0.9 + 0.55 * -rows.bottom
    fig, ax = plt.subplots(figsize=(width, height), dpi=DPI)
    labels = []
    for c in timeline.compute:
        box = _box(ax, c.start_s * scale, c.end_s * scale, rows.stage_bottom[c.action.stage], ROW, COLORS[c.action.kind],
                   f"{c.action.micro_batch}", COMPUTE_PT)
        labels.append((*box, COMPUTE_PT, True))
    for t in timeline.transfers:
        box = _box(ax, t.start_s * scale, t.end_s * scale, rows.lane_bottom[(t.dst_stage, route_of(t))], LANE,
                   COLORS["RECV_" + t.direction], f"{t.micro_batch}", LANE_PT)
        labels.append((*box, LANE_PT, False))
    _label_rows(ax, timeline, rows)
    ax.set_xlim(0, max(timeline.iteration_s * scale, 1e-9) * 1.01)
    ax.set_ylim(rows.bottom - 0.2, 0.2)
    ax.set_xlabel("time (ms); thin rows: transfers arriving at the stage, numbered by micro-batch (blue forward, green gradient)")
    title_text = ax.set_title(title, fontsize=TITLE_PT, loc="left", pad=16)  # room below the title for the legend row
    kinds = [k for k in LEGEND if any(c.action.kind == k for c in timeline.compute)]  # "B" or "I" and "W"
    ax.legend([_rect(0, 0, 1, 1, COLORS[k]) for k in kinds], [LEGEND[k] for k in kinds], loc="lower left",
              bbox_to_anchor=(0.0, 1.0), fontsize=COMPUTE_PT[0], ncol=len(kinds), frameon=False)
    for _ in range(2):  # the layout moves the title's left edge; fit it, lay out, fit again
        _fit_title(fig, title_text, title)
        fig.set_size_inches(width, height + 0.16 * title_text.get_text().count("\n"))
        fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for text, box, sizes, upright in labels:
        _fit_label(text, box, renderer, sizes, upright)
    return fig


def _label_rows(ax, timeline: Timeline, rows: Rows) -> None:
    """Stage names beside compute rows; beside each lane, the tensor arriving there and the stage it comes from."""
    ticks = [(bottom + ROW / 2, f"stage {s}", COMPUTE_PT[0] + 2) for s, bottom in enumerate(rows.stage_bottom)]
    ticks += [(bottom + LANE / 2, lane_name(route), LANE_PT[0]) for (_, route), bottom in rows.lane_bottom.items()]
    ax.set_yticks([y for y, _, _ in ticks], [name for _, name, _ in ticks])
    for label, (_, _, size) in zip(ax.get_yticklabels(), ticks):
        label.set_fontsize(size)
