"""Passes over one device's lowered program (`lower.RankProgram` -> `RankProgram`), and the pipeline of them
that turns a plan into what an engine replays.

`lower(plan, device)` gives every operation of every tensor the device takes part in, posted: every
operation at once, each operation's staging after the one before. The passes then shape it:

- `share_messages`: the bundles of several tensors that share one cross-host message
  (`schemas.carriers`), lowered together (`lower.lower(..., share=True)`: one message per pair of devices,
  the relays moving pieces between the message and per-peer side areas), get every operation's staging
  laid out one after another (each at a multiple of the largest element size), a shared message's as one
  range. The program remembers the groups (`RankProgram.carriers`) for engines that replay the
  collectives instead of the steps (NCCL, `nccl_plan.nccl_program`, which replays a shared message as its
  group lowering: each message a broadcast in a group of two, each move a copy inside staging).
- `lower.in_device_order`: each operation's messages wait for the device's earlier operations, and
  staging is re-used run after run.
- `window.in_window`: posted, where the plan states a staging limit: each operation's staging is a range of a
  ring of the limit's bytes, and its messages wait for the earlier operations it overlaps there.
- `one_tensor_at_a_time`: every tensor's steps after the previous tensor's, each tensor's staging from
  byte 0 (for engines that do not run several reshards in flight, posted).

- `with_receipts`: in device order, on a transport that ends a send once it is buffered (gloo), each
  operation's large messages to one peer end for the sender when the receiver's 1-byte receipt arrives
  (an engine capability, `engines.EngineEntry.receipts`; the torch engine replays them).

`rank_program` applies them in the order the executor's `order` and the engine's capabilities ask.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.carriers import group_key
from xmesh_plan.schemas.plan_tensors import is_multi
from xmesh_plan.schemas.staging import aligned, stage_budget

from .lower import Action, Bytes, RankProgram, Step, in_device_order, stage_ranges
from .plan_file import PlanFile, collector_paused, lower_part
from .window import in_window


def rank_program(plan: Plan | PlanFile, device: int, order: str, concurrent: bool, tag_limit: int | None = None,
                 receipt_bytes: int | None = None, collectives: bool = True) -> RankProgram:
    """What `device` replays of `plan` in `order` on an engine that can (`concurrent`) or cannot run several
    reshards in flight (`engines.EngineEntry.concurrent`): the lowering, then the passes (module docstring).
    Posted on an engine that is not concurrent, a multi-tensor plan runs one tensor after another, each
    bundle with its own message; otherwise the bundles sharing a message send it once. `receipt_bytes`: in
    device order, messages this large get receipts (`with_receipts`); None: none. `collectives`: with the
    program's group calls (`RankProgram.collectives`), which only engines built on them replay
    (`engines.EngineEntry.collectives`); without, a rank makes half the objects."""
    with collector_paused():
        return _rank_program(plan, device, order, concurrent, tag_limit, receipt_bytes, collectives)


def _rank_program(plan: Plan | PlanFile, device: int, order: str, concurrent: bool, tag_limit: int | None,
                  receipt_bytes: int | None, collectives: bool) -> RankProgram:
    if is_multi(plan) and order == "posted" and not concurrent:
        return one_tensor_at_a_time(lower_part(plan, device, tag_limit, collectives, share=False)[1])
    program, carriers = shared_program(plan, device, tag_limit, collectives)
    if order == "device":
        program = in_device_order(program, stage_budget(plan), program.align, carriers)
        if receipt_bytes is not None:
            program = with_receipts(program, receipt_bytes)
    elif stage_budget(plan) is not None:  # posted within the plan's staging limit
        program = in_window(program, stage_budget(plan), program.align, carriers)
    return program


def shared_program(plan: Plan | PlanFile, device: int, tag_limit: int | None, collectives: bool = False
                   ) -> tuple[RankProgram, dict[int, int]]:
    """`device`'s program with every tensor's operations in one staging area and its shared messages together
    (`share_messages`), before an order's pass, and its carriers (bundle -> the operation whose message carries it)."""
    ops, program = lower_part(plan, device, tag_limit, collectives, share=True)
    carriers = {op.id: group_key(op) for op in ops.operations if op.carrier is not None}
    return (share_messages(program, carriers) if carriers else program), carriers


def share_messages(program: RankProgram, carriers: Mapping[int, int]) -> RankProgram:
    """A program lowered with its shared messages together (`lower.lower(..., share=True)`: one message per pair of
    devices and one cross-host message per shared message) with every operation's staging in one area, one after
    another in step order, each at a multiple of `program.align`, a shared message's staging one range
    (`carriers`: bundle -> the operation whose message carries it, for this device's bundles that ride in another's
    message). The program remembers the groups for engines that replay the collectives instead (NCCL,
    `nccl_plan.nccl_program`)."""
    steps, stage_bytes = _one_area(program.steps, program.align, carriers)
    return replace(program, steps=steps, stage_bytes=stage_bytes, carriers=tuple(sorted(carriers.items())))


def _one_area(steps: tuple[Step, ...], align: int, key: Mapping[int, int]) -> tuple[tuple[Step, ...], int]:
    """The steps with every operation's staging (a shared message's, keyed by its carrier: `key`) moved into one area,
    one after another in step order, each starting at a multiple of `align` (`schemas.staging.chained`); and the
    area's size."""
    keys = [key.get(s.op, s.op) for s in steps]
    spans = stage_ranges(steps, keys)
    shift, at = {}, 0
    for op, (lo, hi) in spans.items():  # dicts keep the order of first appearance: step order
        if hi > lo:
            start = aligned(at, align)
            if lo != start:  # most operations already start where the area puts them: their steps stay as they are
                shift[op] = lo - start
            at = start + hi - lo
    if not shift:
        return steps, at
    moved = tuple(s.shifted(s.index, s.deps, shift[k]) if k in shift and s.data is not None and s.data.buffer == "stage" else s
                  for s, k in zip(steps, keys))
    return moved, at


def one_tensor_at_a_time(program: RankProgram) -> RankProgram:
    """The same steps, tensor after tensor: each tensor's messages and packs wait for every step of the tensor
    before it, so this device runs one tensor's reshard at a time (in tensor order, as every rank does), and each
    tensor's staging starts at byte 0 (`stage_bytes`: the largest tensor's). The collectives go tensor by tensor
    too. Dependencies stay within a tensor, so the steps can be reordered tensor by tensor."""
    old = sorted(range(len(program.steps)), key=lambda i: program.steps[i].tensor)  # stable: plan order within a tensor
    new_index = {i: k for k, i in enumerate(old)}
    spans = stage_ranges(program.steps, [s.op for s in program.steps])
    shift, used = {}, {}
    for i in old:
        s = program.steps[i]
        if s.op not in shift:
            lo, hi = spans[s.op]
            start = used.get(s.tensor, 0)
            shift[s.op], used[s.tensor] = lo - start, start + hi - lo
    steps: list[Step] = []
    barrier: tuple[int, ...] = ()  # the previous tensor's steps (with its own barrier where none of them waited for it)
    run: list[int] = []
    current, gated = None, False
    for i in old:
        s = program.steps[i]
        if s.tensor != current:
            if run:
                barrier = tuple(run) if gated else tuple(sorted(set(barrier) | set(run)))
            run, current, gated = [], s.tensor, False
        deps = tuple(new_index[d] for d in s.deps)
        if barrier and s.action.reads_staging_first:
            deps, gated = tuple(sorted(set(deps) | set(barrier))), True
        steps.append(s.shifted(len(steps), deps, shift[s.op]))
        run.append(len(steps) - 1)
    collectives = tuple(sorted(program.collectives, key=lambda c: c.tensor))
    return replace(program, steps=tuple(steps), stage_bytes=max(used.values(), default=0), collectives=collectives)


def with_receipts(program: RankProgram, min_bytes: int) -> RankProgram:
    """The program with a receipt for each operation's messages of `min_bytes` or more from one device to another: a
    1-byte message back from the receiver once the last of them has arrived (`Step.acks`: the messages it says
    arrived), which the sender's next steps wait for instead of those sends (a pair's messages arrive in the order
    they were sent).

    Gloo ends a send once the kernel's socket buffer holds what is left (megabytes), so without it a device would
    start its next operation while the last one is still on the wire, and device order would not be the plan's;
    the MPI engine sends these messages synchronously for the same reason (docs/executor.md, "Order"). One receipt
    per operation and pair, after all of that operation's messages between the two, keeps a broadcast's chunks
    pipelined: a receipt per chunk, posted before the next chunk's receive, held each hop to one chunk. Both ends
    must use the same `min_bytes`: a rank that expects a receipt the other never sends waits until its timeout."""
    steps = list(program.steps)
    ordinal, count, last_op = [], -1, None  # each step's operation counted in step order, as the engines order messages
    for s in steps:
        count += s.op != last_op
        ordinal.append(count)
        last_op = s.op
    groups: dict[tuple[int, int, str], list[int]] = {}  # (operation, peer, send or recv) -> its large messages
    for s in steps:
        if s.action.is_message and s.data.nbytes >= min_bytes:
            groups.setdefault((s.op, s.peer, s.action), []).append(s.index)
    for k, ((op, peer, action), members) in enumerate(sorted(groups.items())):
        last = steps[max(members, key=lambda i: (ordinal[i], steps[i].tag, i))]
        back = Action.RECV if action is Action.SEND else Action.SEND  # the receiver sends it once `last` is in, the sender waits for it
        steps.append(Step(len(steps), back, op, last.task, f"receipt of {last.kind}", () if back is Action.RECV else (last.index,),
                          peer, last.tag, Bytes("receipt", k, k + 1), piece=last.piece, tensor=last.tensor, acks=tuple(members)))
    return replace(program, steps=tuple(steps))
