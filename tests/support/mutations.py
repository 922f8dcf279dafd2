"""Random schema-valid edits of a plan (as JSON lists), for the tests that check verify and the lowering refuse them."""

from __future__ import annotations

import math
import random

from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.schemas import Plan

SUMMARY: list[str] = []  # printed at the end of the run by conftest's terminal summary


def box_field(rng: random.Random, op: dict) -> tuple[list, int]:
    """A (mutable) box of the operation, the region or one of its parts, and a dim of it."""
    boxes = [op["region"]] + list(op["parts"])
    box = rng.choice(boxes)
    return box, rng.randrange(len(box)) if box else 0


def random_device(rng: random.Random, plan: dict) -> int:
    devices = plan_devices(Plan.model_validate(plan))
    return rng.choice([*devices, -1, max(devices) + 1, max(devices) + 7, rng.choice(devices)])


def mutate(rng: random.Random, plan: dict) -> str:
    """Apply one random mutation in place; return its name (for the summary)."""
    ops = plan["operations"]
    i = rng.randrange(len(ops))
    op = ops[i]
    kind = rng.choice(["device", "bound", "chunks", "kind", "order", "time", "drop", "duplicate", "chain", "plan-number", "part",
                       "host-order", "shape"])
    if kind == "device":
        if op["src"] is not None and rng.random() < 0.5:
            op["src"] = random_device(rng, plan)
        elif op["dsts"]:
            op["dsts"][rng.randrange(len(op["dsts"]))] = random_device(rng, plan)
    elif kind in ("bound", "part"):
        box, d = box_field(rng, op) if kind == "bound" else (rng.choice(op["parts"] or [op["region"]]), 0)
        d = rng.randrange(len(box))
        lo, hi = box[d]
        box[d] = rng.choice([(lo - 1, hi), (lo + 1, hi), (lo, hi + 1), (lo, hi - 1), (hi, hi), (hi, lo), (0, hi), (lo, 10**6)])
    elif kind == "chunks":
        op["chunks"] = rng.choice([2, 3, op["chunks"] + 1, 1024, 1025, 10**9, 2**40, max(1, op["chunks"] - 1)])
    elif kind == "kind":
        op["kind"] = rng.choice(["copy", "send", "broadcast", "allgather"])
    elif kind == "order":
        j = rng.randrange(len(ops))
        ops[i], ops[j] = ops[j], ops[i]
    elif kind == "time":
        field = rng.choice(["start_s", "end_s"])
        op[field] = rng.choice([math.nan, math.inf, -math.inf, -1.0, op[field] * 0.5, op[field] + 1e-3, 0.0])
    elif kind == "drop":
        ops.pop(i)
    elif kind == "duplicate":
        twin = {**op, "dsts": list(op["dsts"]), "region": [list(b) for b in op["region"]], "parts": [[list(b) for b in p] for p in op["parts"]]}
        if rng.random() < 0.5:
            twin["id"] = max(o["id"] for o in ops) + 1
        ops.insert(i + 1, twin)
    elif kind == "host-order":
        entry = rng.choice(plan["host_order"] or [{"host": 0, "side": "send", "tasks": []}])
        what = rng.choice(["side", "host", "task", "twice"])
        if what == "side":
            entry["side"] = rng.choice(["send:", "send:00", "recv:1", "recv:9", "both", "recv", "send:0"])
        elif what == "host":
            entry["host"] = rng.choice([-1, 99, entry["host"] + 1])
        elif what == "task":
            entry["tasks"].append(rng.choice([-5, 10**6]))
        else:
            plan["host_order"].append({**entry, "tasks": list(entry["tasks"])})
    elif kind == "shape":
        shape = plan["problem"]["shape"]
        d = rng.randrange(len(shape))
        shape[d] = max(0, shape[d] + rng.choice([-1, 1, 7]))
    elif kind == "chain":
        op["dsts"] = [] if rng.random() < 0.5 else op["dsts"][:1]
    else:
        field = rng.choice(["predicted_seconds", "lower_bound_seconds"])
        plan[field] = rng.choice([math.nan, math.inf, -1.0, plan["predicted_seconds"] * 2, 0.0])
    return kind


def mutate_multi(rng: random.Random, plan: dict) -> str:
    """One mutation of what only multi-tensor plans have (else a generic one, `mutate`); returns its name."""
    ops = plan["operations"]
    bundles = [op for op in ops if op["kind"] == "bundle"]
    kind = rng.choice(["carrier", "carrier", "staging", "staging", "bundle", "bundle", "tensor", "host-order-empty", "generic",
                       "generic", "generic"])
    if kind == "carrier" and bundles:
        op = rng.choice(bundles)
        later = [o["id"] for o in ops[ops.index(op) + 1:]] or [op["id"]]
        op["carrier"] = rng.choice([rng.choice(later), op["id"], rng.choice(ops)["id"], None, max(o["id"] for o in ops) + 5,
                                    ops[max(0, ops.index(op) - 1)]["id"], ops[0]["id"], ops[-1]["id"]])
    elif kind == "staging" and plan.get("staging"):
        staging = plan["staging"]
        peaks = staging["peak_bytes"]
        what = rng.choice(["limit", "limit", "peak", "drop-device", "add-device", "drop"])
        if what == "limit":
            values = list(peaks.values()) or [1]
            staging["limit_bytes"] = rng.choice([1, max(1, min(values) - 1), max(1, max(values) - 1), max(values), staging["limit_bytes"] * 2])
        elif what == "peak" and peaks:
            device = rng.choice(list(peaks))
            peaks[device] = max(0, peaks[device] + rng.choice([-8, -1, 1, 8]))
        elif what == "drop-device" and peaks:
            peaks.pop(rng.choice(list(peaks)))
        elif what == "add-device":
            peaks[rng.choice([0, 1, 2, 3, 4, 5, 99])] = rng.choice([0, 8, 64])
        else:
            plan.pop("staging")
    elif kind == "bundle" and bundles:
        op = rng.choice(bundles)
        what = rng.choice(["src-null", "dsts-empty", "holder", "needers", "needers-twice", "part-dropped", "relay"])
        if what == "src-null":
            op["src"] = None
        elif what == "dsts-empty":
            op["dsts"] = []
        elif what == "holder":
            op["holders"][rng.randrange(len(op["holders"]))] = rng.choice([0, 1, 2, 3, 4, 5, -1, 64])
        elif what == "needers":
            op["needers"][rng.randrange(len(op["needers"]))] = rng.choice([[], [0], [5], [99]])
        elif what == "needers-twice":
            needers = op["needers"][rng.randrange(len(op["needers"]))]
            needers.append(needers[0])
        elif what == "part-dropped":
            k = rng.randrange(len(op["parts"]))
            for field in rng.choice([("parts",), ("parts", "holders", "needers")]):
                op[field].pop(k)
        else:
            op["dsts"] = [rng.choice([0, 1, 2, 3, 4, 5])]
    elif kind == "tensor":
        op = rng.choice(ops)
        op["tensor"] = rng.choice([0, 1, 2, len(plan["problem"]["tensors"]), op["tensor"] + 1])
    elif kind == "host-order-empty":
        plan["host_order"] = []
    else:
        try:
            return mutate(rng, plan)
        except KeyError:  # the single-tensor "shape" mutation: change one tensor's shape instead
            tensor = rng.choice(plan["problem"]["tensors"])
            tensor["shape"][0] = max(0, tensor["shape"][0] + rng.choice([-1, 1, 7]))
            return "shape"
    return kind


def as_lists(value):
    """model_dump gives tuples; mutations need lists (the JSON a user edits has lists too)."""
    if isinstance(value, (list, tuple)):
        return [as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    return value
