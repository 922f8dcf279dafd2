"""What each rank of a weight sync says about its tensors, and the one problem every rank agrees on from those rows.

Each rank describes what it holds as a plain JSON row (`describe`): on a trainer rank each DTensor's name,
global shape, dtype, mesh (as transfer ranks) and spec (or each rank's box, where DTensor's layout is one
no spec says: strided shards of FSDP over TP, uneven splits over several mesh dims), and its local shard's shape; on an inference rank
each destination tensor's name, the trainer tensor it takes, its spec on the inference mesh (or its box rule, e.g.
`PADDED_VOCAB`, lowered to boxes once the trainer's shape is known), its dtype and
its shape. A rank that cannot describe its tensors sends its error instead. Every rank then reads every
row (`agree`) and either builds the same `TransferProblem` or raises the same `WeightSyncError`, naming
the tensor, the rank and the cause, before any byte moves. Plan device ids are ranks of the transfer group.

>>> rows = [{"rank": 0, "src": {"mesh": [[1], [0]], "tensors": [["w", [4, 2], "float32", "S0 R", [4, 2]]]}},
...         {"rank": 1, "dst": {"mesh": [[1], [1]], "tensors": [["w", "w", "R S0", "float32", [4, 2]]]}}]
>>> problem, sources = agree(rows, None)
>>> [(t.name, str(t.src), str(t.dst)) for t in problem.tensors], sources
([('w', 'S0 R', 'R S0')], {'w': 'w'})
>>> rows[1]["dst"]["tensors"][0][3] = "float16"
>>> agree(rows, None)
Traceback (most recent call last):
...
xmesh_plan.weight_sync_layouts.WeightSyncError: inference tensor 'w' on rank 1 is float16 but the trainer's 'w' is float32; give the destination the trainer's dtype, or convert at the sender with Target(..., dtype='float16')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from xmesh_plan.schemas import Cluster, DeviceMesh
from xmesh_plan.schemas.convert import fused_block_scales
from xmesh_plan.schemas.dtypes import canonical_dtype
from xmesh_plan.schemas.fused import FusedTensor
from xmesh_plan.schemas.spec import ShardingSpec
from xmesh_plan.schemas.transfer import TensorTransfer, TransferProblem, scale_tensor, single_problem
from xmesh_plan.schemas.validation import describe_validation_error

from .engine_layouts import KvHeads, layout_row, rule_of_row
from .sides import FrontendError, dtype_name


class WeightSyncError(FrontendError):
    """A weight sync the ranks cannot run as given: the same line on every rank, naming the tensor, rank and cause."""


@dataclass(frozen=True)
class Target:
    """One destination tensor of an inference rank: the engine's own tensor (this rank's part of it), its layout
    (a rule of `xmesh_plan.engine_layouts` or spec text) and the trainer tensor it takes (default: its own name).
    `dtype`: the destination's element type where it is not the trainer's ("float16", "bfloat16", "float32",
    "float8_e4m3fn", "float8_e5m2"; the tensor must be of it), converted by the senders (`schemas.convert`);
    `scale`: an FP8 destination's scales, "block" (128x128) or "tensor"; `scales`: the engine's tensor that
    receives this rank's part of them (float32; WeightSync allocates one where none is given)."""

    tensor: Any
    layout: object
    source: str | None = None
    dtype: str | None = None
    scale: str | None = None
    scales: Any = None


@dataclass(frozen=True)
class Fused:
    """A destination that concatenates trainer tensors along `dim` (vLLM's `qkv_proj` = cat(q, k, v), `gate_up_proj` =
    cat(gate, up)). Where the layout splits `dim` over T ranks, rank t holds cat(q_t, k_t, v_t), each part's t-th of T
    equal shares (`QKVParallelLinear`, `MergedColumnParallelLinear`); where it does not, the whole concatenation.
    `rules`: None, or one per part: None (that equal share) or a box rule splitting dim 0 (`engine_layouts.kv_heads(n)`),
    whose box on TP rank t is that part's share there, e.g. `Fused((q, k, v), rules=(None, kv_heads(2), kv_heads(2)))`
    for KV heads replicated when TP exceeds their count."""

    parts: tuple[str, ...]
    dim: int = 0
    rules: tuple | None = None


def describe(rank: int, trainer: Mapping[str, Any] | None, inference: Mapping[str, Any] | None,
             inference_mesh: object, ranks: Mapping[int, int] | None, cluster: Cluster) -> dict[str, Any]:
    """This rank's row (JSON data): its trainer tensors' layouts, its destination tensors' layouts, the cluster."""
    row: dict[str, Any] = {"rank": rank, "cluster": cluster.model_dump(mode="json")}
    try:
        if trainer:
            row["src"] = _trainer_side(trainer, ranks)
        if inference:
            row["dst"] = _inference_side(inference, inference_mesh, ranks)
    except FrontendError as err:
        return {"rank": rank, "error": str(err)}
    return row


def transfer_ranks(mesh_ranks: Sequence[int], ranks: Mapping[int, int] | None, field: str) -> list[int]:
    """A mesh's ranks (this side's numbering) as ranks of the transfer group, through `ranks` (None: not given)."""
    if ranks is None:
        raise FrontendError("ranks: missing; a group made by transfer_group needs ranks= on every process (this launch's "
                            "rank -> its rank in the transfer group, e.g. {r: 4 + r for r in range(4)})")
    missing = [r for r in mesh_ranks if r not in ranks]
    if missing:
        raise FrontendError(f"{field}: rank {missing[0]} of the mesh has no rank in the transfer group; add it to ranks= "
                            "(this side's rank -> its rank in the transfer group)")
    return [ranks[r] for r in mesh_ranks]


def _trainer_side(trainer: Mapping[str, Any], ranks: Mapping[int, int] | None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from .dtensor import _mesh_ranks, _side

    tensors, meshes = [], {}
    for name, value in trainer.items():
        field = f"trainer[{name!r}]"
        if not isinstance(value, DTensor):
            raise FrontendError(f"{field} is a {type(value).__name__}, not a DTensor; pass the trainer's state_dict() "
                                "(FSDP2 or TP parameters are DTensors) or make one with distribute_tensor")
        if value.dim() == 0:
            raise FrontendError(f"{field} is a 0-dim tensor (a scalar); leave it out or move it as shape (1,)")
        if value.device_mesh.get_coordinate() is None:
            raise FrontendError(f"{field}: this rank is not in the tensor's mesh; pass trainer tensors only on their mesh's ranks")
        mesh = _mesh_ranks(value.device_mesh, f"{field}.device_mesh")
        side = _side(tuple(value.shape), mesh, value.placements, field)
        devices = transfer_ranks(side.devices, ranks, f"{field}.device_mesh")
        meshes[name] = [list(side.mesh_shape), devices]
        layout = str(side.spec) if side.boxes is None else [[list(dim) for dim in box] for box in side.boxes]
        tensors.append([name, list(value.shape), dtype_name(value.dtype, f"{field}.dtype"), layout, list(value.to_local().shape)])
    return {"mesh": _one_mesh(meshes, "trainer"), "tensors": tensors}


def _inference_side(inference: Mapping[str, Any], mesh: object, ranks: Mapping[int, int] | None) -> dict[str, Any]:
    from .dtensor import _mesh_ranks

    if mesh is None:
        raise FrontendError("inference_mesh: missing; give the inference engine's ranks as a nested list, rows the replicas "
                            "and columns the TP ranks, e.g. [[4, 5], [6, 7]]")
    grid = _mesh_ranks(mesh, "inference_mesh")
    devices = transfer_ranks([int(r) for r in grid.flat], ranks, "inference_mesh")
    tensors, converts = [], {}
    for name, value in inference.items():
        target = value if isinstance(value, Target) else _target(name, value)
        field = f"inference[{name!r}]"
        if not hasattr(target.tensor, "shape") or not hasattr(target.tensor, "dtype"):
            raise FrontendError(f"{field}: the tensor is a {type(target.tensor).__name__}; pass this rank's torch tensor")
        if target.tensor.dim() == 0:
            raise FrontendError(f"{field} is a 0-dim tensor (a scalar); leave it out or move it as shape (1,)")
        source = name if target.source is None else target.source
        if isinstance(source, Fused):
            if not source.parts or not all(isinstance(p, str) for p in source.parts) or not 0 <= source.dim < target.tensor.dim():
                raise FrontendError(f"{field}.source: {source!r}; give Fused((trainer names...), dim) with a dim of the tensor")
            source = {"parts": list(source.parts), "dim": source.dim, "rules": _part_rules(source, field)}
        elif not isinstance(source, str):
            raise FrontendError(f"{field}.source: {source!r}; give the trainer tensor's name as text, or Fused((names...))")
        spec = layout_row(target.layout, target.tensor.dim(), grid.ndim, name)
        dtype = dtype_name(target.tensor.dtype, f"{field}.dtype")
        if target.dtype is not None or target.scale is not None:
            converts[name] = _conversion(target, dtype, field)
        tensors.append([name, source, spec, dtype, list(target.tensor.shape)])
    return {"mesh": [list(grid.shape), devices], "tensors": tensors} | ({"convert": converts} if converts else {})


def _conversion(target: Target, dtype: str, field: str) -> list:
    """A Target's conversion at the sender as row data [dst_dtype, scale]; FrontendError unless its tensor is of that dtype."""
    if target.dtype is None:
        raise FrontendError(f"{field}.scale: {target.scale!r} without dtype; scales belong to an FP8 destination "
                            "(Target(..., dtype=\"float8_e4m3fn\", scale=\"block\"))")
    want = canonical_dtype(str(target.dtype))
    if want != dtype:
        raise FrontendError(f"{field}: the tensor is {dtype} but dtype={target.dtype!r}; pass the engine's tensor of the "
                            "destination dtype (the senders convert to it)")
    return [want, target.scale]


def _part_rules(fused: Fused, field: str) -> list | None:
    """Each part's rule as the row says it (None: the fused layout's equal share; a box rule's row), or None."""
    if fused.rules is None:
        return None
    if not isinstance(fused.rules, (tuple, list)) or len(fused.rules) != len(fused.parts):
        raise FrontendError(f"{field}.source.rules: {fused.rules!r}; give one rule per part (None for an equal share), "
                            f"{len(fused.parts)} in all")
    rows = []
    for k, rule in enumerate(fused.rules):
        if rule is not None and not isinstance(rule, KvHeads):
            raise FrontendError(f"{field}.source.rules[{k}]: {rule}; a part takes None (its equal share) or kv_heads(n)")
        rows.append(None if rule is None else rule.row())
    return rows


def _target(name: str, value: object) -> Target:
    if isinstance(value, tuple) and len(value) == 2:
        return Target(*value)
    raise FrontendError(f"inference[{name!r}]: {type(value).__name__}; give (tensor, layout), e.g. (q_proj, COLUMN), or a Target")


def _one_mesh(meshes: dict[str, list], side: str) -> list:
    """The one mesh every tensor of a side is on (a plan has one source and one destination mesh)."""
    first = next(iter(meshes))
    for name, mesh in meshes.items():
        if mesh != meshes[first]:
            raise FrontendError(f"{side}[{name!r}] is on mesh {_shown(mesh)} but {side}[{first!r}] on {_shown(meshes[first])}; "
                                "one WeightSync moves tensors of one mesh: make one per mesh")
    return meshes[first]


def _shown(mesh: list) -> str:
    return f"{'x'.join(map(str, mesh[0]))} of ranks {','.join(map(str, mesh[1]))}"


def agree(rows: list[dict[str, Any]], group_size: int | None) -> tuple[TransferProblem, dict[str, str]]:
    """The problem every rank will run (destination name -> trainer name alongside), read from every rank's row;
    WeightSyncError, the same on every rank, where the rows do not fit together."""
    for row in rows:
        if row.get("error"):
            others = [r["rank"] for r in rows if r.get("error") and r is not row]
            also = f" (ranks {','.join(map(str, others))} failed too)" if others else ""
            raise WeightSyncError(f"rank {row['rank']}: {row['error']}{also}")
    clusters = {repr(r["cluster"]) for r in rows if "cluster" in r}
    if len(clusters) > 1:
        raise WeightSyncError("the ranks were given different clusters (cluster=); give every rank the same one")
    src_rows, dst_rows = [r for r in rows if r.get("src")], [r for r in rows if r.get("dst")]
    if not src_rows or not dst_rows:
        raise WeightSyncError(f"no rank passes {'trainer' if not src_rows else 'inference'} tensors; trainer ranks pass "
                              "trainer=state_dict and inference ranks inference={name: (tensor, layout)}")
    src_mesh, trained = _side_of(src_rows, "src", "trainer")
    dst_mesh, wanted = _side_of(dst_rows, "dst", "inference")
    _check_members(src_rows, src_mesh, trained, "trainer", "src")
    _check_members(dst_rows, dst_mesh, wanted, "inference", "dst")
    converts = _conversions(dst_rows, wanted)
    tensors, sources = [], {}
    fused = []
    for name, (source, spec, dtype, _) in wanted.items():
        convert = converts.get(name)
        for part in source["parts"] if isinstance(source, dict) else [source]:
            _check_source(name, part, dtype if convert is None else None, trained, dst_rows)
        if isinstance(source, dict):
            if isinstance(spec, dict):
                raise WeightSyncError(f"inference tensor {name!r} is fused (Fused(...)) and laid out by {rule_of_row(spec)}, which "
                                      "fused tensors do not take; give it a spec rule (COLUMN, EXPERT, ...) and a part's own rule in "
                                      "Fused(parts, rules=(None, kv_heads(n), ...))")
            if convert is not None and convert[1] not in (None, "block"):
                raise WeightSyncError(f"inference tensor {name!r} is fused (Fused(...)) with scale={convert[1]!r}; a fused FP8 tensor "
                                      "takes block scales (each part on 128x128 blocks): give Target(..., scale=\"block\"), or "
                                      "convert to float16/bfloat16")
            fused.append(_fused(name, source, spec, trained, dst_mesh))
            for part in source["parts"]:
                tensors.append(_transfer(part, trained[part], None, convert=convert, dest=name))
                sources[part] = part
            continue
        tensors.append(_transfer(name, trained[source], spec, dst_mesh, convert))
        sources[name] = source
    cluster = Cluster.model_validate(next((r["cluster"] for r in rows if "cluster" in r), {}))
    try:
        tensors, fused = _with_scales(tensors, fused, src_mesh, dst_mesh, cluster)
        problem = TransferProblem(name="weight_sync", src_mesh=src_mesh, dst_mesh=dst_mesh, cluster=cluster, tensors=tuple(tensors),
                                  fused=tuple(fused))
    except ValidationError as err:
        raise WeightSyncError(f"the agreed layouts do not make a plan: {describe_validation_error(err)}") from None
    except ValueError as err:
        raise WeightSyncError(f"the agreed layouts do not make a plan: {err}") from None
    _check_shards(problem, sources, src_rows, dst_rows)
    _check_group(problem, group_size)
    return problem, sources


def _conversions(dst_rows: list[dict], wanted: dict[str, tuple]) -> dict[str, tuple[str, str | None]]:
    """Destination name -> (dst_dtype, scale) the senders convert it to, the same on every inference rank that passes it."""
    out: dict[str, tuple] = {}
    said: dict[str, int] = {}
    for row in dst_rows:
        given = row["dst"].get("convert", {})
        for name, *_ in row["dst"]["tensors"]:
            mine = tuple(given[name]) if name in given else None
            if name in said and out.get(name) != mine:
                raise WeightSyncError(f"inference tensor {name!r}: rank {row['rank']} {_converts(mine)} but rank {said[name]} "
                                      f"{_converts(out.get(name))}; give it the same Target(dtype=, scale=) on every rank")
            said.setdefault(name, row["rank"])
            if mine is not None:
                out[name] = mine
    return out


def _converts(convert: tuple | None) -> str:
    if convert is None:
        return "takes the trainer's dtype"
    return f"converts to {convert[0]}" + (f" with {convert[1]} scales" if convert[1] else "")


def _with_scales(tensors: list[TensorTransfer], fused: list[FusedTensor], src_mesh: DeviceMesh, dst_mesh: DeviceMesh,
                 cluster: Cluster) -> tuple[list[TensorTransfer], list[FusedTensor]]:
    """The tensors with each FP8 tensor's scale tensor after it, and each FP8 fused tensor's fused scales
    (`schemas.transfer.scale_tensor`, `schemas.convert.fused_block_scales`), as problem files get them."""
    parts = {name for f in fused for name, _ in f.refs()}
    out = []
    for tensor in tensors:
        out.append(tensor)
        if tensor.scale is not None:
            part = tensor.name in parts
            laid = tensor.model_copy(update={"dst": " ".join("R" * len(tensor.shape))}) if part else tensor
            out.append(scale_tensor(tensor, single_problem(laid, src_mesh, dst_mesh, cluster), fused_part=part))
    shapes = {t.name: tuple(t.shape) for t in tensors}
    scaled = {t.name for t in tensors if t.scale is not None}
    extra = [fused_block_scales(f, shapes, dst_mesh) for f in fused if any(name in scaled for name, _ in f.refs())]
    return out, fused + extra


def _check_source(name: str, source: str, dtype: str | None, trained: dict[str, tuple], dst_rows: list[dict]) -> None:
    """Destination `name` may take trainer tensor `source`: some trainer rank passes it, of the destination's dtype
    (None: any, the senders convert it)."""
    if source not in trained:
        shown = ", ".join(list(trained)[:3]) + (", ..." if len(trained) > 3 else "")
        raise WeightSyncError(f"inference tensor {name!r} takes trainer tensor {source!r}, which no trainer rank passes "
                              f"(the trainer passes {shown}); fix the name or its Target(source=...)")
    src_dtype = trained[source][1]
    if dtype is not None and dtype != src_dtype:
        holders = [str(r["rank"]) for r in dst_rows if any(t[0] == name for t in r["dst"]["tensors"])]
        raise WeightSyncError(f"inference tensor {name!r} on rank{'s' if len(holders) > 1 else ''} {','.join(holders)} "
                              f"is {dtype} but the trainer's {source!r} is {src_dtype}; give the destination the trainer's dtype, "
                              f"or convert at the sender with Target(..., dtype={dtype!r})")


def _transfer(name: str, trained: tuple, dst_spec: str | dict | None, dst_mesh: DeviceMesh | None = None,
              convert: tuple | None = None, dest: str | None = None) -> TensorTransfer:
    """Trainer tensor `trained` (shape, dtype, layout, ...) as the plan's tensor `name`, to `dst_spec` (None: a fused part;
    a dict: a box rule of `engine_layouts`, lowered to each device's box of the trainer's shape on `dst_mesh`), converted
    by the senders to `convert` (dst_dtype, scale) where given; WeightSyncError naming destination `dest` (default: `name`)
    and its Target where the conversion is not one the senders make."""
    shape, dtype, layout = trained[:3]
    given = {"src": layout} if isinstance(layout, str) else {"src_boxes": _boxes(layout)}
    if isinstance(dst_spec, dict):
        rule = rule_of_row(dst_spec)
        try:
            given["dst_boxes"] = rule.boxes(tuple(shape), tuple(dst_mesh.shape))
        except ValueError as err:
            raise WeightSyncError(f"inference tensor {name!r} ({rule}) of the trainer's shape {tuple(shape)}: {err}") from None
    elif dst_spec is not None:
        given["dst"] = dst_spec
    if convert is None:
        return TensorTransfer(name=name, shape=tuple(shape), dtype=dtype, **given)
    given["dst_dtype"], given["scale"] = convert
    try:
        return TensorTransfer(name=name, shape=tuple(shape), dtype=dtype, **given)
    except ValidationError as err:
        raise WeightSyncError(f"inference tensor {dest or name!r} (Target(dtype={convert[0]!r}, scale={convert[1]!r}) of the "
                              f"trainer's {dtype}): {describe_validation_error(err)}") from None


def _fused(name: str, source: dict, spec: str, trained: dict[str, tuple], mesh: DeviceMesh) -> FusedTensor:
    """The fused destination `name`: its parts cut into T equal shares where `spec` splits the fused dim T ways, share
    t of every part in turn (rank t's concatenation), else the parts whole."""
    dim = source["dim"]
    shares = ShardingSpec.parse(spec).shard_counts(tuple(mesh.shape))[dim]
    rules = source.get("rules") or [None] * len(source["parts"])
    ranges = []
    for t in range(shares):
        for part, rule in zip(source["parts"], rules):
            length = trained[part][0][dim]
            if rule is not None:  # rank t's box of the part by its rule (its TP position t, the first replica's)
                lo, hi = _rule_range(name, part, rule_of_row(rule), tuple(trained[part][0]), dim, shares, mesh)[t]
                ranges.append(f"{part}[{lo}:{hi}]")
                continue
            if length % shares:
                raise WeightSyncError(f"inference tensor {name!r}: part {part!r} has length {length} along dim {dim}, not a "
                                      f"multiple of the {shares} ranks that split it; each rank holds an equal share of every part")
            step = length // shares
            ranges.append(part if shares == 1 else f"{part}[{t * step}:{(t + 1) * step}]")
    return FusedTensor(name=name, parts=tuple(ranges), dim=dim, dst=spec)


def _rule_range(name: str, part: str, rule, shape: tuple[int, ...], dim: int, shares: int, mesh: DeviceMesh) -> list[tuple[int, int]]:
    """Each TP rank's range of `part` along the fused dim by a box rule of that part (which splits dim 0)."""
    if dim != 0 or shares != mesh.shape[-1]:
        raise WeightSyncError(f"inference tensor {name!r}: part {part!r} takes {rule}, which splits dim 0 over the TP ranks; fuse "
                              "along dim 0 with a layout that splits it over the TP ranks (COLUMN)")
    try:
        boxes = rule.boxes(shape, (shares,))
    except ValueError as err:
        raise WeightSyncError(f"inference tensor {name!r}: part {part!r} ({rule}) of the trainer's shape {shape}: {err}") from None
    return [box[0] for box in boxes]


def _boxes(layout: list) -> tuple:
    """Each device's box as JSON gave it ([[start, stop], ...] per device) as the schema's tuples."""
    return tuple(tuple(tuple(dim) for dim in box) for box in layout)


def _side_of(rows: list[dict], key: str, label: str) -> tuple[DeviceMesh, dict[str, tuple]]:
    """One side's mesh and its tensors by name (the fields every rank must agree on), the first rank's as the reference."""
    first = rows[0]
    for row in rows[1:]:
        if row[key]["mesh"] != first[key]["mesh"]:
            raise WeightSyncError(f"rank {row['rank']} puts its {label} tensors on mesh {_shown(row[key]['mesh'])} but rank "
                                  f"{first['rank']} on {_shown(first[key]['mesh'])}; give every {label} rank the same mesh")
    tensors: dict[str, tuple] = {}
    said: dict[str, int] = {}
    names = ("shape", "dtype", "layout") if label == "trainer" else ("source", "layout", "dtype")
    for row in rows:
        for name, *fields in row[key]["tensors"]:
            agreed = tuple(fields[:-1])
            if name in tensors and tensors[name][:-1] != agreed:
                k = next(k for k, (a, b) in enumerate(zip(agreed, tensors[name])) if a != b)
                raise WeightSyncError(f"{label} tensor {name!r}: rank {row['rank']} has {names[k]} {_value(names[k], agreed[k])} but rank "
                                      f"{said[name]} has {_value(names[k], tensors[name][k])}; give it the same {names[k]} on every rank")
            tensors.setdefault(name, (*agreed, fields[-1]))
            said.setdefault(name, row["rank"])
    shape, devices = first[key]["mesh"]
    try:
        mesh = DeviceMesh(shape=tuple(shape), devices=tuple(devices))
    except ValidationError as err:
        raise WeightSyncError(f"the {label} mesh: {describe_validation_error(err)}; check ranks=") from None
    return mesh, tensors


def _value(field: str, value: object) -> str:
    """A field of a tensor as an error shows it: a shape as a tuple, a source name quoted, a dtype or spec as is."""
    if isinstance(value, dict) and "rule" in value:
        return str(rule_of_row(value))
    return str(tuple(value)) if field == "shape" else repr(value) if field == "source" else str(value)


def _check_members(rows: list[dict], mesh: DeviceMesh, tensors: dict[str, tuple], label: str, key: str) -> None:
    """Every rank of a side's mesh passes every tensor of that side, and no rank outside it passes any."""
    by_rank = {row["rank"]: {t[0] for t in row[key]["tensors"]} for row in rows}
    for rank in mesh.devices:
        if rank not in by_rank:
            raise WeightSyncError(f"rank {rank} is in the {label} mesh but passes no {label} tensors; pass them on every rank "
                                  f"of the mesh (or fix ranks=)")
        missing = [name for name in tensors if name not in by_rank[rank]]
        if missing:
            raise WeightSyncError(f"{label} tensor {missing[0]!r} is not passed on rank {rank} (its other ranks pass it); "
                                  f"pass every {label} tensor on every rank of the {label} mesh")
    outside = sorted(set(by_rank) - set(mesh.devices))
    if outside:
        raise WeightSyncError(f"rank {outside[0]} passes {label} tensors but is not in the {label} mesh "
                              f"({','.join(map(str, mesh.devices))}); fix ranks= or the mesh")


def _check_shards(problem: TransferProblem, sources: dict[str, str], src_rows: list[dict], dst_rows: list[dict]) -> None:
    """Every rank's local tensor has the shape of its box: the trainer's shards and the engine's tensors."""
    index = {t.name: i for i, t in enumerate(problem.tensors)}
    fused = {f.name: j for j, f in enumerate(problem.fused)}
    for side, rows, label in (("src", src_rows, "trainer"), ("dst", dst_rows, "inference")):
        for row in rows:
            for name, *fields in row[side]["tensors"]:
                if side == "dst" and name in fused:
                    box = problem.fused_blocks(fused[name])[row["rank"]]
                    if list(fields[-1]) != [stop - start for start, stop in box]:
                        raise WeightSyncError(
                            f"inference tensor {name!r} on rank {row['rank']} has shape {tuple(fields[-1])} but its fused "
                            f"layout gives that rank {tuple(b - a for a, b in box)}; give it the shape of its part")
                    continue
                targets = [n for n, s in sources.items() if s == name] if side == "src" else [name]
                for target in targets:
                    box = problem.tensor_problem(index[target]).blocks(side)[row["rank"]]
                    want = [stop - start for start, stop in box]
                    tensor = problem.tensors[index[target]]
                    rule = rule_of_row(fields[1]) if side == "dst" and isinstance(fields[1], dict) else None
                    if rule is not None:  # the engine's tensor, padding rows included
                        want = list(rule.local_shape(tuple(tensor.shape), tuple(problem.dst_mesh.shape)))
                    if list(fields[-1]) != want:
                        spec = (tensor.src or "its boxes") if side == "src" else rule or tensor.dst
                        raise WeightSyncError(
                            f"{label} tensor {name!r} on rank {row['rank']} has shape {tuple(fields[-1])} but {spec} of the "
                            f"global {tuple(problem.tensors[index[target]].shape)} gives that rank {tuple(want)}; "
                            f"give it the shape of its part")


def _check_group(problem: TransferProblem, group_size: int | None) -> None:
    """The plan's devices are ranks 0 .. size-1 of the transfer group, every one of them (rank r plays device r)."""
    if group_size is None:
        return
    used = set(problem.src_mesh.devices) | set(problem.dst_mesh.devices)
    if used != set(range(group_size)):
        spare = sorted(set(range(group_size)) - used)
        raise WeightSyncError(f"rank {spare[0]} of the transfer group is in neither mesh; make the group of the trainer and "
                              f"inference ranks only" if spare else
                              f"the meshes name ranks {sorted(used - set(range(group_size)))[:3]} beyond the transfer group's "
                              f"{group_size}; fix ranks=")


def engine_targets(problem: TransferProblem, targets: Mapping[str, Target], rank: int) -> dict[str, Target]:
    """`targets` with each tensor replaced by the part of it the plan writes on `rank` (`engine_view`); fused ones whole."""
    fused = {f.name for f in problem.fused}
    return {name: target if name in fused else replace(target, tensor=engine_view(target.tensor, problem.tensor_problem(
        problem.index_of(name)).blocks("dst")[rank])) for name, target in targets.items()}


def engine_view(tensor, box):
    """The part of an engine's tensor the plan writes for `box` (its box of the trainer's tensor): its first rows, the
    whole tensor unless the layout pads it (`engine_layouts.PADDED_VOCAB`); the padding is left as it is."""
    return tensor[tuple(slice(0, stop - start) for start, stop in box)]
