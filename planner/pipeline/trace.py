"""A timeline as Chrome / Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

Process 0 holds one row per stage (compute, and the time it stands waiting); process 1 one row
per transfer route (tensor and direction; a second row when transfers on one route overlap), so
no two slices on a row overlap. Slice ends are rounded to whole nanoseconds first and `dur` is
end - start, so a slice that ends when the next begins never overlaps it. A flow arrow goes from
each transfer's sending compute (the slice that made the data) to the compute that receives it.
"""

from __future__ import annotations

import json

from .simulate import ComputeSpan, Timeline, TransferSpan

CATEGORY = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}
STAGES_PID, NETWORK_PID = 0, 1


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _us(ns: int) -> float:
    """Whole nanoseconds as microseconds (the trace's unit), exact to the three decimals printed."""
    return ns / 1000


def _meta(pid: int, tid: int | None, kind: str, name: str) -> dict:
    event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    return event | ({"tid": tid} if tid is not None else {})


def _slice(name: str, cat: str, pid: int, tid: int, start_s: float, end_s: float, args: dict) -> dict:
    start, end = _ns(start_s), _ns(end_s)
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": _us(start), "dur": _us(end - start), "args": args}


def route_name(tensor: str, direction: str, src: int, dst: int) -> str:
    return f"{tensor}{'.grad' if direction == 'B' else ''} s{src}->s{dst}"


def _route(t: TransferSpan) -> tuple:
    return (t.direction, t.src_stage, t.dst_stage, t.tensor)


def transfer_lanes(transfers: tuple[TransferSpan, ...]) -> tuple[list[tuple[tuple, int]], dict[int, int]]:
    """Rows of process 1: (route, copy) in route order, and each transfer's row (by index); a transfer goes to the
    route's first row whose last slice has ended (in whole ns), so slices on a row never overlap."""
    row_number: dict[tuple[tuple, int], int] = {}
    row_of: dict[int, int] = {}
    free_at: dict[tuple, list[int]] = {}  # route -> end (ns) of the last slice on each of its rows
    for i in sorted(range(len(transfers)), key=lambda i: (_route(transfers[i]), _ns(transfers[i].start_s), i)):
        t, ends = transfers[i], free_at.setdefault(_route(transfers[i]), [])
        copy = next((c for c, end in enumerate(ends) if end <= _ns(t.start_s)), len(ends))
        if copy == len(ends):
            ends.append(0)
            row_number[(_route(t), copy)] = len(row_number)
        ends[copy] = _ns(t.end_s)
        row_of[i] = row_number[(_route(t), copy)]
    return list(row_number), row_of


def _lane_name(route: tuple, copy: int) -> str:
    return route_name(route[3], route[0], route[1], route[2]) + (f" ({copy + 1})" if copy else "")


def _inside(span: ComputeSpan) -> float:
    """A time strictly inside the slice where it has room (its middle nanosecond), so a flow binds to it alone."""
    start, end = _ns(span.start_s), _ns(span.end_s)
    return _us(start + (end - start) // 2)


def flow_events(timeline: Timeline) -> list[dict]:
    """One flow per transfer, ids from 1: "s" inside the compute that made the data, "f" bound to the compute that
    uses it (the forward for an activation, the I or B for a gradient)."""
    by_step = {(c.action.stage, c.action.kind, c.action.micro_batch): c for c in timeline.compute}
    events = []
    for flow_id, t in enumerate(timeline.transfers, start=1):
        kinds = ("F",) if t.direction == "F" else ("I", "B")
        made = next((by_step[k] for k in ((t.src_stage, kind, t.micro_batch) for kind in kinds) if k in by_step), None)
        used = next((by_step[k] for k in ((t.dst_stage, kind, t.micro_batch) for kind in kinds) if k in by_step), None)
        if made is None or used is None:
            continue
        common = {"name": f"{t.tensor}{'.grad' if t.direction == 'B' else ''} {t.micro_batch}", "cat": "transfer",
                  "id": flow_id, "pid": STAGES_PID}
        events.append({"ph": "s", "tid": made.action.stage, "ts": _inside(made), **common})
        events.append({"ph": "f", "bp": "e", "tid": used.action.stage, "ts": _inside(used), **common})
    return events


def trace_events(timeline: Timeline) -> list[dict]:
    events = [_meta(STAGES_PID, None, "process_name", "stages"), _meta(NETWORK_PID, None, "process_name", "network")]
    events += [_meta(STAGES_PID, s, "thread_name", f"stage {s}") for s in range(timeline.stages)]
    for span in timeline.compute:
        a = span.action
        events.append(_slice(f"{a.kind}{a.micro_batch}", CATEGORY[a.kind], STAGES_PID, a.stage, span.start_s, span.end_s,
                             {"action": str(a), "micro_batch": a.micro_batch}))
    for span in timeline.waits:
        events.append(_slice(f"wait {span.action.kind}", "wait", STAGES_PID, span.action.stage, span.start_s, span.end_s,
                             {"action": str(span.action)}))
    rows, row_of = transfer_lanes(timeline.transfers)
    events += [_meta(NETWORK_PID, row, "thread_name", _lane_name(route, copy)) for row, (route, copy) in enumerate(rows)]
    for i, t in enumerate(timeline.transfers):
        args = {"tensor": t.tensor, "direction": t.direction, "micro_batch": t.micro_batch, "issued_us": _us(_ns(t.issued_s))}
        events.append(_slice(f"{t.tensor}{'.grad' if t.direction == 'B' else ''} {t.micro_batch}", "transfer", NETWORK_PID,
                             row_of[i], t.start_s, t.end_s, args))
    return events + flow_events(timeline)


def trace_json(timeline: Timeline, metadata: dict | None = None) -> str:
    """Deterministic trace text: same timeline, same bytes."""
    doc = {"traceEvents": trace_events(timeline), "displayTimeUnit": "ms", "metadata": metadata or {}}
    return json.dumps(doc, indent=None, sort_keys=True, separators=(",", ":")).replace('},{"', '},\n{"') + "\n"
