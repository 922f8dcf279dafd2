"""A timeline as Chrome / Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

Process 0 holds one row per stage (compute, and the time it stands waiting); process 1 one row
per transfer route (tensor and direction), so overlapping transfers stay readable.
"""

from __future__ import annotations

import json

from .simulate import Timeline

CATEGORY = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _meta(pid: int, tid: int | None, kind: str, name: str) -> dict:
    event = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    return event | ({"tid": tid} if tid is not None else {})


def _slice(name: str, cat: str, pid: int, tid: int, start_s: float, end_s: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": _us(start_s), "dur": _us(end_s - start_s), "args": args}


def route_name(tensor: str, direction: str, src: int, dst: int) -> str:
    return f"{tensor}{'.grad' if direction == 'B' else ''} s{src}->s{dst}"


def trace_events(timeline: Timeline) -> list[dict]:
    events = [_meta(0, None, "process_name", "stages"), _meta(1, None, "process_name", "network")]
    events += [_meta(0, s, "thread_name", f"stage {s}") for s in range(timeline.stages)]
    for span in timeline.compute:
        a = span.action
        events.append(_slice(f"{a.kind}{a.micro_batch}", CATEGORY[a.kind], 0, a.stage, span.start_s, span.end_s,
                             {"action": str(a), "micro_batch": a.micro_batch}))
    for span in timeline.waits:
        events.append(_slice(f"wait {span.action.kind}", "wait", 0, span.action.stage, span.start_s, span.end_s, {"action": str(span.action)}))
    routes = sorted({(t.direction, t.src_stage, t.dst_stage, t.tensor) for t in timeline.transfers})
    lane = {r: i for i, r in enumerate(routes)}
    events += [_meta(1, i, "thread_name", route_name(r[3], r[0], r[1], r[2])) for r, i in lane.items()]
    for t in timeline.transfers:
        args = {"tensor": t.tensor, "direction": t.direction, "micro_batch": t.micro_batch, "issued_us": _us(t.issued_s)}
        events.append(_slice(f"{t.tensor}{'.grad' if t.direction == 'B' else ''} {t.micro_batch}", "transfer", 1,
                             lane[(t.direction, t.src_stage, t.dst_stage, t.tensor)], t.start_s, t.end_s, args))
    return events


def trace_json(timeline: Timeline, metadata: dict | None = None) -> str:
    """Deterministic trace text: same timeline, same bytes."""
    doc = {"traceEvents": trace_events(timeline), "displayTimeUnit": "ms", "metadata": metadata or {}}
    return json.dumps(doc, indent=None, sort_keys=True, separators=(",", ":")).replace('},{"', '},\n{"') + "\n"
