"""`WeightSync`: a trainer's state dict into an inference engine's tensors, every step, with one plan.

    # trainer ranks (FSDP2 / TP model):                 # inference ranks (the engine's own tensors):
    sync = WeightSync(trainer=model.state_dict())       sync = WeightSync(inference={"model.norm.weight": (norm, REPLICATED),
                                                                                     "lm_head.weight": (head, VOCAB), ...},
                                                                          inference_mesh=[[4, 5], [6, 7]])
    sync.run()                                          sync.run()   # every step, on every rank: the new weights land in the engine's tensors
    sync.start(); ...; sync.wait()                      # the same, overlapped with other work

Every rank of the transfer group builds one `WeightSync` together (a collective) and then calls `run()`
(or `start()` then `wait()`) together each step. A fused destination (qkv, gate_up) names its parts with
`Fused`; the plan moves each part into its rows of the fused tensor. A destination of another dtype
says it with `Target(..., dtype=, scale=)` (float16, bfloat16, float32, FP8 with "block" or "tensor" scales): the
trainer ranks convert before sending, and an FP8 destination's scales land in `sync.scales[name]` (or the
`Target`'s `scales` tensor), this rank's part of them, float32. A rank that is both trainer
and inference (colocated) passes both mappings; its part moves by local copies.

On construction the ranks agree before any byte moves: each sends one row describing its tensors (names,
global shapes, dtypes, layouts, local shapes; `weight_sync_layouts.describe`) as JSON bytes in a uint8
all-gather, and every rank checks every row (`weight_sync_layouts.agree`). A mismatch (a dtype, a shape,
a tensor a rank does not pass, another mesh) raises the same `WeightSyncError` on every rank, naming the
tensor, the rank and the cause, as soon as the rows are in (no timeout). The agreed problem's fingerprint
(SHA-256 of its JSON) keys a cache of plans (the `PLAN_CACHE_SIZE` most recently used, 8 unless
`set_plan_cache_size(n)`); on a miss the lowest
rank compiles the plan once and broadcasts its JSON bytes (a uint8 tensor, never pickle), since compiling
costs seconds of CPU on big models that the other ranks need not spend, and one compile is one answer
whatever each rank runs; every rank then checks that the plan's problem is the one it agreed on, and
`TransferExecutor.prepare()` compares the plan's fingerprint on every rank before allocating.

Each `run()` first checks this rank's tensors against the plan (a trainer may pass a new state dict) in
one small all-gather, so a wrong shard fails every rank with its cause, then moves the bytes straight into
the caller's tensors: each destination shard is written in place (`TransferExecutor.run(..., into=...)`,
`executor.destinations`), a fused one through the view of each part's rows (`schemas.fused.fused_views`);
only a tensor that is two parts of one fused shard (two ranges) lands in the executor's buffer and is
copied into place. The executor keeps no reference to the caller's tensors between calls.

Plan devices are ranks of the transfer group. By default that is torch's default group, and a mesh's
ranks are its ranks. For separate launches (trainer and inference started apart), pass
`group=transfer_group(host, port, rank, world_size)` and `ranks=` (this launch's rank -> its rank in the
transfer group) on every process.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from xmesh_plan.executor import TransferExecutor
from xmesh_plan.executor.executor import DEFAULT_POLL_S
from xmesh_plan.executor.worlds import TorchWorld, poll_until
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Cluster, Plan
from xmesh_plan.schemas.convert import scale_name
from xmesh_plan.schemas.fused import fused_pieces, fused_views

from .engine_layouts import COLUMN, EXPERT, REPLICATED, ROW, VOCAB
from .weight_sync_layouts import Fused, Target, WeightSyncError, agree, describe, engine_targets

__all__ = ["WeightSync", "Target", "Fused", "WeightSyncError", "COLUMN", "ROW", "VOCAB", "REPLICATED", "EXPERT", "PLAN_CACHE_SIZE",
           "set_plan_cache_size"]

PLAN_CACHE_SIZE = 8  # plans kept by fingerprint, least recently used dropped first; set_plan_cache_size
_PLANS: OrderedDict[str, Plan] = OrderedDict()


def set_plan_cache_size(size: int) -> None:
    """Keep the `size` most recently used plans (8 by default); call it on every rank, before building `WeightSync`s.

    A layout whose plan the cache holds on every rank is never compiled again (`WeightSync(...).compiled` is False):
    a job that syncs 12 layouts in turn (several models, or a model's shards by stage) compiles each once with
    `set_plan_cache_size(12)`. Each plan is held as parsed (its operations: megabytes for a large model). A smaller
    size drops the least recently used plans at once."""
    global PLAN_CACHE_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise WeightSyncError(f"set_plan_cache_size: size={size!r}; give a whole number of plans to keep, at least 1 (8 by default)")
    PLAN_CACHE_SIZE = size
    _trim()


def _trim() -> None:
    while len(_PLANS) > PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)


class WeightSync:
    """Moves a trainer's DTensors into inference tensors with one plan; see the module docstring.

    `trainer`: name -> DTensor on trainer ranks (a model's `state_dict()`). `inference`: name -> (tensor, layout)
    or `Target(tensor, layout, source=...)` on inference ranks (source: a trainer name, or `Fused((names...), dim)`),
    each tensor this rank's part under the layout (`engine_layouts`: COLUMN, ROW, VOCAB, REPLICATED, EXPERT, or
    spec text) on `inference_mesh` (a nested list of ranks: rows the replicas, columns the TP ranks). `group`: the
    transfer group (None: torch's default). `ranks`: this side's rank -> its rank in `group` (None: each global
    rank's rank in `group`, for a group torch made; a group made by `transfer_group` needs it). `cluster`: the
    machines, for the planner (default: as many devices per host as the group has ranks). `timeout_s`: how long a
    rank waits for the others at each step."""

    def __init__(self, trainer: Mapping[str, Any] | None = None, inference: Mapping[str, Any] | None = None, *,
                 inference_mesh: object = None, group=None, ranks: Mapping[int, int] | None = None,
                 cluster: Cluster | None = None, timeout_s: float = 60.0):
        self.group = dist.group.WORLD if group is None else group
        self.world = TorchWorld(group)
        self.timeout_s = float(timeout_s)
        self.rank, size = self.world.rank, self.world.size
        self.trainer = dict(trainer or {})
        self.inference = dict(inference or {})
        mapping = _group_ranks(group) if ranks is None else dict(ranks)
        row = describe(self.rank, self.trainer, self.inference, inference_mesh, mapping, cluster or Cluster(devices_per_host=size))
        rows = [json.loads(b) for b in self._allgather_bytes(json.dumps(row).encode(), "WeightSync() on every rank")]
        self.problem, self.sources = agree(rows, size)
        self.fingerprint = hashlib.sha256(self.problem.model_dump_json().encode()).hexdigest()
        self.plan, self.compiled = self._shared_plan()
        self.targets = engine_targets(self.problem, {name: _target(value) for name, value in self.inference.items()}, self.rank)
        self._agree_step(self._scales_problem())
        self.scales = {name: self._scales_of(name, target) for name, target in self.targets.items() if target.scale is not None}
        self.into, self.copied = self._destinations()
        self.executor = TransferExecutor(self.plan, self.group, backend="torch", timeout_s=self.timeout_s).prepare()

    def run(self, trainer: Mapping[str, Any] | None = None) -> None:
        """Move the weights once (every rank): the trainer's current values land in the inference tensors.
        `trainer`: a new name -> DTensor mapping to read this time and from now on (None: the one given before)."""
        self.start(trainer)
        self.wait()

    def start(self, trainer: Mapping[str, Any] | None = None) -> None:
        """Check every rank's tensors against the plan, then start moving; do not modify them until `wait()`."""
        if trainer is not None:
            self.trainer = dict(trainer)
        self._agree_step(self._local_problem())
        in_src = self.rank in self.problem.src_mesh.devices
        self.executor.start({name: self.trainer[source].to_local() for name, source in self.sources.items()} if in_src else None,
                            into=self.into)

    def wait(self) -> None:
        """Finish the move begun by `start()`; every destination tensor of this rank holds the trainer's values."""
        results = self.executor.wait()
        for name, where, out, inside in self.copied:  # a tensor that is two parts of a fused shard, from where it landed
            out[where] = results[name][inside]

    def _destinations(self) -> tuple[dict[str, Any], list]:
        """Where each plan tensor's destination shard on this rank is written (scales included): name -> the caller's
        tensor, or the view of a fused tensor that is exactly that shard (`fused_views`); and the pieces of fused tensors that no such view
        covers (a tensor that is two parts of one fused shard), to copy after each move from where that tensor landed."""
        fused = {f.name: j for j, f in enumerate(self.problem.fused)}
        outputs = {name: target.tensor for name, target in self.targets.items()}
        outputs |= {scale_name(name): out for name, out in self.scales.items()}  # an FP8 destination's scales, fused as it is
        into = {name: tensor for name, tensor in outputs.items() if name not in fused}
        copied = []
        for name, tensor in outputs.items():
            if name not in fused:
                continue
            views = fused_views(self.problem, fused[name], self.rank, tensor)
            for part, piece, where in fused_pieces(self.problem, fused[name], self.rank):
                view = views.get(part)
                if view is not None and part not in into and tuple(view.shape) == _extent(self._box(part, "dst")):
                    into[part] = view
                else:
                    inside = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(piece, self._box(part, "dst")))
                    copied.append((part, where, tensor, inside))
        return into, copied

    def _scales_of(self, name: str, target: Target):
        """The tensor that receives this rank's part of destination `name`'s FP8 scales: the Target's, else a new one."""
        if target.scales is not None:
            return target.scales
        return torch.zeros(self._scales_shape(name), dtype=torch.float32)

    def _scales_shape(self, name: str) -> tuple[int, ...]:
        """The shape of this rank's part of destination `name`'s scales (the plan's `<name>.scale`, fused as its tensor is)."""
        scale = scale_name(name)
        fused = {f.name: j for j, f in enumerate(self.problem.fused)}
        box = self.problem.fused_blocks(fused[scale])[self.rank] if scale in fused else self._box(scale, "dst")
        return tuple(b - a for a, b in box)

    def _scales_problem(self) -> str | None:
        """Why a `Target.scales` tensor of this rank cannot receive its scales (None when every one can): float32 of
        this rank's part's shape, so no scale is rounded and none fails to land after the bytes moved."""
        for name, target in self.targets.items():
            given = target.scales
            if target.scale is None or given is None:
                continue
            want = self._scales_shape(name)
            if not isinstance(given, torch.Tensor):
                return f"inference[{name!r}].scales on rank {self.rank} is a {type(given).__name__}; pass a float32 torch tensor of shape {want}"
            if given.dtype != torch.float32 or tuple(given.shape) != want:
                return (f"inference[{name!r}].scales on rank {self.rank} is {str(given.dtype).removeprefix('torch.')} of shape "
                        f"{tuple(given.shape)}; pass float32 of shape {want} (this rank's part of the scales), or leave it out")
        return None

    def close(self) -> None:
        """Release the executor's buffers and thread (every rank); the object cannot run again."""
        self.executor.close()

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _local_problem(self) -> str | None:
        """Why this rank's tensors no longer fit the plan (None when they do): a missing name, a shape or dtype."""
        in_src = self.rank in self.problem.src_mesh.devices
        index = {t.name: t for t in self.problem.tensors}
        for name, source in self.sources.items() if in_src else ():
            value = self.trainer.get(source)
            if value is None or not hasattr(value, "to_local"):
                return f"trainer tensor {source!r} is not passed (or not a DTensor) on rank {self.rank}; pass it every step"
            why = _mismatch(value.to_local(), index[name], self._box(name, "src"))
            if why:
                return f"trainer tensor {source!r} on rank {self.rank} {why}"
        fused = {f.name: j for j, f in enumerate(self.problem.fused)}
        for name, target in self.targets.items():
            if name in fused:  # the fused box, the parts' dtype
                part = self.problem.fused[fused[name]].refs()[0][0]
                why = _mismatch(target.tensor, index[part], self.problem.fused_blocks(fused[name])[self.rank], "dst")
            else:
                why = _mismatch(target.tensor, index[name], self._box(name, "dst"), "dst")
            if why:
                return f"inference tensor {name!r} on rank {self.rank} {why}"
        return None

    def _box(self, name: str, side: str):
        """This rank's box of the plan's tensor `name` on `side`."""
        return self.problem.tensor_problem(self.problem.index_of(name)).blocks(side)[self.rank]

    def _agree_step(self, problem: str | None) -> None:
        """One all-gather of a flag per rank; if any rank's tensors do not fit, every rank raises that rank's cause."""
        flags = self.world.allgather(np.array([problem is not None], np.int64), self.timeout_s, DEFAULT_POLL_S,
                                     "WeightSync.run() on every rank")
        if flags.any():
            texts = self._allgather_bytes((problem or "").encode(), "WeightSync.run() on every rank")
            causes = [t.decode() for t in texts if t]
            raise WeightSyncError(causes[0] + (f" (and {len(causes) - 1} more)" if len(causes) > 1 else "") + "; nothing was moved")

    def _shared_plan(self) -> tuple[Plan, bool]:
        """The agreed problem's plan: from every rank's cache, or compiled once by the lowest rank and broadcast as
        JSON bytes; True where it was compiled or broadcast rather than found in every rank's cache."""
        have = self.world.allgather(np.array([self.fingerprint in _PLANS], np.int64), self.timeout_s, DEFAULT_POLL_S,
                                    "WeightSync() on every rank")
        if have.all():
            _PLANS.move_to_end(self.fingerprint)
            return _PLANS[self.fingerprint], False
        text, failed = b"", 0
        if self.rank == 0:
            try:
                plan = _PLANS.get(self.fingerprint) or compile_plan(self.problem)
                text = plan.to_json().encode()
            except Exception as err:  # every rank must hear of it, or they wait for the plan until the timeout
                text, failed = f"{type(err).__name__}: {err}".encode(), 1
        text, failed = self._broadcast_bytes(text, failed)
        if failed:
            raise WeightSyncError(f"rank 0 could not compile the plan: {text.decode()}")
        plan = Plan.from_json(text.decode())
        if hashlib.sha256(plan.problem.model_dump_json().encode()).hexdigest() != self.fingerprint:
            raise WeightSyncError(f"rank 0 sent a plan of another problem than rank {self.rank} agreed on; run one "
                                  "xmesh-plan version on every rank")
        _PLANS[self.fingerprint] = plan
        _trim()
        return plan, True

    def _allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's bytes, in rank order: an all-gather of lengths, then of the bytes padded to the longest."""
        lengths = self.world.allgather(np.array([len(data)], np.int64), self.timeout_s, DEFAULT_POLL_S, what)[:, 0]
        device = self.world.tensor_device()
        mine = torch.zeros(max(1, int(lengths.max())), dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(device)
        every = [torch.empty_like(mine) for _ in lengths]
        self._wait(self.group.allgather([every], [mine]), what)
        return [bytes(t[:int(n)].cpu().numpy()) for t, n in zip(every, lengths)]

    def _broadcast_bytes(self, data: bytes, flag: int) -> tuple[bytes, int]:
        """Rank 0's bytes and flag on every rank: a header (length, flag), then the bytes."""
        device = self.world.tensor_device()
        head = torch.tensor([len(data), flag], dtype=torch.int64, device=device)
        self._wait(self.group.broadcast(head, 0), "WeightSync() on every rank (the plan from rank 0)")
        body = torch.zeros(int(head[0]), dtype=torch.uint8)
        if self.rank == 0 and data:
            body[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        body = body.to(device)
        self._wait(self.group.broadcast(body, 0), "WeightSync() on every rank (the plan from rank 0)")
        return bytes(body.cpu().numpy()), int(head[1])

    def _wait(self, work, what: str) -> None:
        poll_until(work.is_completed, self.timeout_s, DEFAULT_POLL_S, what)
        work.wait()


def _group_ranks(group) -> dict[int, int] | None:
    """The default `ranks`: each global rank of a group torch made (the default one, `new_group`'s) -> its rank in the
    group; None for a group made from its own store (`transfer_group`), whose ranks only the caller knows."""
    try:
        return {g: r for r, g in enumerate(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))}
    except KeyError:
        return None


def _target(value: object) -> Target:
    return value if isinstance(value, Target) else Target(*value)


def _extent(box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _mismatch(tensor, transfer, box, side: str = "src") -> str | None:
    """How `tensor` differs from `box` of the plan's tensor `transfer` on `side` (shape or dtype), or None."""
    want = _extent(box)
    if tuple(tensor.shape) != want:
        return f"has shape {tuple(tensor.shape)}, not {want} as agreed"
    dtype = str(tensor.dtype).removeprefix("torch.")
    agreed = transfer.dst_dtype or transfer.dtype if side == "dst" else transfer.dtype
    if dtype != agreed:
        return f"is {dtype}, not {agreed} as agreed"
    return None
