"""Read a transfer problem (many named tensors between two shared meshes) from JSON/TOML data.

A tensor gives its name, shape and optionally dtype (else the file's `dtype`, else float32) and its
`src` / `dst` specs; a spec it leaves out comes from the first entry of `rules` whose `match` (a
shell pattern, `*` and `?`, over the whole name) fits the name and that gives that side. A
`tensors` entry with `repeat = N` and a `group` of tensors stands for the group N times, `{i}` in
each name replaced by 0 .. N-1 (layer by layer; from `first` on where it gives one), so a model's hundreds of parameters take a few lines:

>>> p = build_transfer({"src_mesh": "1x4", "dst_mesh": "1x2", "dtype": "bfloat16",
...     "rules": [{"match": "*.norm", "src": "S1", "dst": "R"}, {"match": "*", "src": "S1 R", "dst": "R S1"}],
...     "tensors": [{"repeat": 2, "group": [{"name": "l{i}.w", "shape": [8, 8]}, {"name": "l{i}.norm", "shape": [8]}]}]})
>>> [(t.name, str(t.src), str(t.dst)) for t in p.tensors]
[('l0.w', 'S1 R', 'R S1'), ('l0.norm', 'S1', 'R'), ('l1.w', 'S1 R', 'R S1'), ('l1.norm', 'S1', 'R')]

Meshes take shorthand like single-tensor problems (`"2x4"`: 2 hosts of 4 devices), the source
from host 0 and the destination on the hosts after it, or objects with `devices` / `first_host`.
"""

from __future__ import annotations

import re
from fnmatch import translate
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from xmesh_plan.schemas import Placement, ReshardingProblem
from xmesh_plan.schemas.boxes import box_field
from xmesh_plan.schemas.dtypes import DTYPE_SIZES, canonical_dtype
from xmesh_plan.schemas.convert import fused_block_scales
from xmesh_plan.schemas.fused import FusedTensor, part_ref
from xmesh_plan.schemas.limits import quoted, shown
from xmesh_plan.schemas.transfer import MAX_TENSORS, TensorTransfer, TransferProblem, scale_tensor, single_problem
from xmesh_plan.schemas.validation import describe_validation_error

from .compile_defaults import defaults_for_kind
from .problem_io import InputError, build_problem, hosts_used, parse_cluster, parse_mesh, parse_shape, read_data_file
from .unit_tasks import TaskCount, check_kinds_total, count_tasks

TOP_KEYS = ("name", "dtype", "src_mesh", "dst_mesh", "cluster", "rules", "tensors")
TENSOR_KEYS = ("name", "shape", "dtype", "src", "dst", "src_boxes", "dst_boxes", "dst_dtype", "scale")
FUSED_KEYS = ("name", "fuse", "dim", "dst", "dst_boxes", "dst_dtype", "scale")
RULE_KEYS = ("match", "src", "dst")
GROUP_KEYS = ("repeat", "first", "group")
MAX_REPEAT = MAX_TENSORS
MAX_RULES = 256  # every rule is matched against every tensor name once at most; a model needs a few dozen


def is_transfer(raw: Any) -> bool:
    """Whether parsed problem data describes many tensors (it has a `tensors` list)."""
    return isinstance(raw, dict) and "tensors" in raw


def build_any_problem(raw: Any, max_tasks: int | None = None, split_hosts: bool | None = None,
                      merge: bool = True) -> ReshardingProblem | TransferProblem:
    """A transfer problem from data with `tensors`, a single-tensor problem otherwise; a transfer that could cut into
    more than `max_tasks` unit tasks (compiled with `split_hosts` and `merge`) is refused as it is read
    (`build_transfer`)."""
    if isinstance(raw, dict) and "schema_version" in raw and "operations" in raw:
        raise InputError("this is a plan file (it has schema_version and operations), not a problem; give the problem file "
                         "it was compiled from (its `problem` section is one), e.g. plans/case3.problem.json")
    return build_transfer(raw, max_tasks, split_hosts, merge) if is_transfer(raw) else build_problem(raw)


def load_any_problem(path: str | Path, max_tasks: int | None = None, split_hosts: bool | None = None,
                     merge: bool = True) -> ReshardingProblem | TransferProblem:
    """Read a `.json` or `.toml` problem file of either kind; errors name the file and field. `max_tasks`,
    `split_hosts`, `merge`: as `build_transfer`."""
    return build_any_problem(read_data_file(path, "problem file"), max_tasks, split_hosts, merge)


def build_transfer(raw: dict[str, Any], max_tasks: int | None = None, split_hosts: bool | None = None,
                   merge: bool = True) -> TransferProblem:
    """A transfer problem from plain data (see the module docstring); InputError naming the field otherwise.
    With `max_tasks`, tensors that compile into more unit tasks together are refused (TooManyTasksError) from
    their counts, before the problem is built: each distinct (shape, dtype, specs) is counted once, split by
    receiving host unless `split_hosts` is False (None: the multi-tensor default, `compile_defaults`), so the
    limit the refusal names is the one the compile passes."""
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise InputError(f"{quoted(unknown[0])}: not a field of a multi-tensor problem; use {', '.join(TOP_KEYS)}")
    cluster = parse_cluster(raw.get("cluster", {}))
    for side in ("src_mesh", "dst_mesh"):
        if side not in raw:
            raise InputError(f"{side}: missing; give the shared {side[:3]} mesh, e.g. \"2x4\" (2 hosts of 4 devices)")
    src_mesh = parse_mesh(raw["src_mesh"], "src_mesh", 0, cluster.devices_per_host)
    dst_mesh = parse_mesh(raw["dst_mesh"], "dst_mesh", hosts_used(src_mesh, cluster.devices_per_host), cluster.devices_per_host)
    rules = _rules(raw.get("rules", []))
    default_dtype = raw.get("dtype", "float32")
    if "dtype" in raw and not _known_dtype(default_dtype):
        raise InputError(f"dtype: unknown dtype {shown(default_dtype)} (the default of every tensor); use one of "
                         f"{', '.join(sorted(DTYPE_SIZES))}")
    if "tensors" not in raw:
        raise InputError("tensors: missing; give a list of tensors, each with name and shape")
    matcher = _RuleMatcher(rules)
    if max_tasks is not None:  # from the entries as written, before a repeated group is unrolled
        split = defaults_for_kind(multi_tensor=True).split_hosts if split_hosts is None else split_hosts
        _TaskCount(src_mesh, dst_mesh, cluster, matcher, default_dtype, split, merge).of_entries(raw["tensors"], max_tasks)
    entries = _expand(raw["tensors"])
    known = {entry.get("name") for entry, _ in entries if isinstance(entry, dict) and "fuse" not in entry}
    fused = [_fused(entry, where, matcher, known) for entry, where in entries if isinstance(entry, dict) and "fuse" in entry]
    parts = {part_ref(part)[0] for f in fused for part in f["parts"]}
    tensors = [_tensor(entry, where, matcher, default_dtype, parts) for entry, where in entries
               if not (isinstance(entry, dict) and "fuse" in entry)]
    scaled = _fused_dtypes(tensors, fused)
    unused = matcher.fitting_none([t["name"] for t in tensors])  # _tensor made each a dict with a text name
    if unused is not None:  # a typo in a pattern would silently leave its tensors to a later rule
        raise InputError(f"rules[{unused}] (match {rules[unused][0]!r}) fits no tensor's name; fix the pattern or remove the rule")
    if not tensors:
        raise InputError("tensors: no tensor is left once repeated groups are unrolled (repeat = 0 everywhere?); "
                         "give at least one tensor")
    name = raw.get("name", "")
    tensors = _with_scales(tensors, src_mesh, dst_mesh, cluster, parts)
    fused = fused + _fused_scales(fused, scaled, tensors, dst_mesh)
    try:
        return TransferProblem(name=name, src_mesh=src_mesh, dst_mesh=dst_mesh, cluster=cluster, tensors=tuple(tensors),
                               fused=tuple(fused))
    except ValidationError as err:
        raise InputError(_named(describe_validation_error(err), tensors)) from None


class _TaskCount:
    """The unit tasks tensor entries could cut into, counted as written: a repeated group's tensor that gives both
    specs itself counts once for all its copies, one whose specs come from the rules is matched name by name (one
    regular expression each); each distinct (shape, dtype, specs) is counted from its cut points once (`count_tasks`:
    split by receiving host when `split_hosts`), and refused as `unit_tasks.check_kinds_task_count` refuses. Anything malformed,
    or more tensors than a problem may hold, stops the count (`of_entries` then refuses nothing): reading the entries
    in full names the fault."""

    def __init__(self, src_mesh, dst_mesh, cluster, rules: "_RuleMatcher", default_dtype: Any, split_hosts: bool, merge: bool):
        self.src_mesh, self.dst_mesh, self.cluster, self.rules, self.default_dtype = src_mesh, dst_mesh, cluster, rules, default_dtype
        self.split_hosts, self.merge = split_hosts, merge
        self.known: dict[tuple, TaskCount | None] = {}
        self.total = TaskCount(0, 0 if split_hosts else None)
        self.tensors = self.written = 0
        self.used: dict[tuple, TaskCount] = {}  # (shape, specs) -> its count, for the tensors counted so far

    def of_entries(self, entries: Any, max_tasks: int) -> None:
        """TooManyTasksError where the entries (a problem's `tensors`) could cut into more than `max_tasks` unit tasks."""
        if not isinstance(entries, list):
            return
        for entry in entries:
            if not isinstance(entry, dict):
                return
            repeat, group = (entry.get("repeat"), entry.get("group")) if "repeat" in entry or "group" in entry else (None, [entry])
            if repeat is not None and (not isinstance(repeat, int) or isinstance(repeat, bool) or not 0 <= repeat <= MAX_REPEAT):
                return
            if not isinstance(group, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in group):
                return
            self.written += len(group) * (1 if repeat is None else repeat)
            if self.written > MAX_TENSORS:  # unrolling refuses this entry by name; counting past it only takes time
                return
            first = entry.get("first", 0)
            if not isinstance(first, int) or isinstance(first, bool):
                return
            for tensor in group:
                if not self._add_copies(tensor, repeat, first):
                    return
        if self.tensors:  # as `unit_tasks.check_kinds_task_count`: each kind (shape and specs) is cut once
            check_kinds_total(len(self.used), sum(c.needed for c in self.used.values()), self.tensors, self.total, max_tasks)

    def _add_copies(self, tensor: dict, repeat: int | None, first: int = 0) -> bool:
        """Count `tensor` (`repeat` copies named by {i} from `first`, or itself when None); False where something is
        malformed."""
        if repeat is None or ("src" in tensor and "dst" in tensor):
            return self._add(tensor["name"].replace("{i}", str(first)) if repeat else tensor["name"], tensor,
                             1 if repeat is None else repeat)
        return all(self._add(tensor["name"].replace("{i}", str(i)), tensor, 1) for i in range(first, first + repeat))

    def _add(self, name: str, tensor: dict, copies: int) -> bool:
        """Count `copies` of `tensor`, the first called `name`."""
        shape = tensor.get("shape")
        try:
            layouts = [_layout(tensor, side, lambda: self.rules.spec(name, side)) for side in ("src", "dst")]
            key = (parse_shape(shape) if isinstance(shape, str) else tuple(shape), tensor.get("dtype", self.default_dtype), *layouts)
            hash(key)
        except (InputError, TypeError, ValueError):
            return False
        if key not in self.known:
            try:
                single = ReshardingProblem(name=name, shape=key[0], dtype=key[1], cluster=self.cluster,
                                           src=Placement(mesh=self.src_mesh, **dict([key[2]])),
                                           dst=Placement(mesh=self.dst_mesh, **dict([key[3]])))
                self.known[key] = count_tasks(single, self.split_hosts, self.merge)
            except (ValidationError, ValueError, TypeError):
                self.known[key] = None
        count = self.known[key]
        if count is None or not copies:
            return count is not None
        self.tensors += copies
        self.total += count.times(copies)
        self.used[(key[0], *key[2:])] = count
        return True


def _layout(tensor: dict, side: str, rule_spec) -> tuple[str, Any]:
    """("boxes", the boxes as tuples) where the tensor lists `<side>_boxes`, else ("spec", its spec or the rule's)."""
    if tensor.get(f"{side}_boxes") is not None:
        return "boxes", tuple(box_field(b) for b in tensor[f"{side}_boxes"])
    return "spec", tensor[side] if tensor.get(side) is not None else rule_spec()


class _RuleMatcher:
    """The rules' shell patterns compiled once: per side, one regular expression whose first alternative to match a
    name is the first rule giving that side whose pattern fits it (so a tensor costs one match, not one per rule)."""

    def __init__(self, rules: list[tuple[str, dict[str, Any]]]):
        self.rules = rules
        self.patterns = [re.compile(translate(p)) for p, _ in rules]
        self.side = {side: re.compile("|".join(f"(?P<r{k}>{translate(p)})" for k, (p, given) in enumerate(rules)
                                               if side in given) or "(?!)")
                     for side in ("src", "dst")}
        self.used: set[int] = set()

    def spec(self, name: str, side: str) -> Any:
        """The spec of the first rule giving `side` whose pattern fits `name`, or None."""
        found = self.side[side].match(name)
        if found is None:
            return None
        k = int(found.lastgroup[1:])
        self.used.add(k)
        return self.rules[k][1][side]

    def fitting_none(self, names: list[str]) -> int | None:
        """The first rule whose pattern fits none of `names`; only rules never picked need a look."""
        for k, pattern in enumerate(self.patterns):
            if k not in self.used and not any(pattern.match(n) for n in names):
                return k
        return None


def _named(message: str, tensors: list[dict[str, Any]]) -> str:
    """`tensors.3.dst: ...` as `tensors[3] (name).dst: ...`, the form the other errors use."""
    found = re.match(r"tensors\.(\d+)(\.|:)", message)
    if not found or int(found.group(1)) >= len(tensors):
        return message
    k = int(found.group(1))
    rest = message[found.end() - 1:] if found.group(2) == ":" else "." + message[found.end():]
    return f"tensors[{k}] ({quoted(tensors[k].get('name'))}){rest}"


def _known_dtype(value: Any) -> bool:
    return isinstance(value, str) and canonical_dtype(value) in DTYPE_SIZES


def _rules(raw: Any) -> list[tuple[str, dict[str, Any]]]:
    """(pattern, {side: spec}) per rule, in file order."""
    if not isinstance(raw, list):
        raise InputError("rules: give a list of {match = \"*.q_proj.weight\", src = \"S01 R\", dst = \"S1 R\"} entries")
    if len(raw) > MAX_RULES:
        raise InputError(f"rules: {len(raw):,} rules; give at most {MAX_RULES} (a pattern such as \"layers.*.mlp.*\" covers "
                         "many tensors, and a tensor may give its own src and dst)")
    out = []
    for k, rule in enumerate(raw):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str) or not ({"src", "dst"} & set(rule)):
            raise InputError(f"rules[{k}]: give match (a name pattern such as \"*.q_proj.weight\") and src and/or dst specs")
        extra = sorted(set(rule) - set(RULE_KEYS))
        if extra:
            raise InputError(f"rules[{k}].{quoted(extra[0])}: not a field of a rule; use {', '.join(RULE_KEYS)}")
        for side in ("src", "dst"):
            if side in rule and not isinstance(rule[side], str):
                raise InputError(f"rules[{k}].{side}: {shown(rule[side])} is not a sharding spec; give text such as \"S0 R\"")
        out.append((rule["match"], {s: rule[s] for s in ("src", "dst") if s in rule}))
    return out


def _expand(raw: Any) -> list[tuple[dict, str]]:
    """Tensor entries with repeated groups unrolled, each with the field path errors name."""
    if not isinstance(raw, list) or not raw:
        raise InputError("tensors: give a non-empty list of tensors, each with name and shape (and optionally dtype, src, dst)")
    out: list[tuple[dict, str]] = []
    for k, entry in enumerate(raw):
        if isinstance(entry, dict) and ("repeat" in entry or "group" in entry):
            out += _repeat(entry, f"tensors[{k}]", room=MAX_TENSORS - len(out))
        else:
            out.append((entry, f"tensors[{k}]"))
        if len(out) > MAX_TENSORS:
            raise InputError(f"tensors: more than {MAX_TENSORS:,} tensors; split the transfer into several problems")
    return out


def _repeat(entry: dict, where: str, room: int) -> list[tuple[dict, str]]:
    repeat, group, first = entry.get("repeat"), entry.get("group"), entry.get("first", 0)
    if set(entry) - set(GROUP_KEYS):
        raise InputError(f"{where}.{quoted(sorted(set(entry) - set(GROUP_KEYS))[0])}: a repeated group has only {', '.join(GROUP_KEYS)}")
    if not isinstance(repeat, int) or isinstance(repeat, bool) or not 0 <= repeat <= MAX_REPEAT:
        raise InputError(f"{where}.repeat: {shown(repeat)} must be a whole number of repetitions in 0 .. {MAX_REPEAT}")
    if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first <= MAX_REPEAT:
        raise InputError(f"{where}.first: {shown(first)} must be the whole number {{i}} starts from, in 0 .. {MAX_REPEAT}")
    if not isinstance(group, list) or not group or not all(isinstance(t, dict) for t in group):
        raise InputError(f"{where}.group: give a non-empty list of tensors whose names contain {{i}}, e.g. \"layers.{{i}}.mlp.weight\"")
    if repeat * len(group) > room:  # refused before anything is unrolled
        raise InputError(f"{where}: {repeat} x {len(group)} tensors would pass {MAX_TENSORS:,} in all; split the transfer into several problems")
    for j, tensor in enumerate(group):
        if "repeat" in tensor or "group" in tensor:
            raise InputError(f"{where}.group[{j}]: a repeated group cannot hold another; unroll the inner one by hand "
                             "or write its tensors with both indices")
        if not isinstance(tensor.get("name"), str):
            raise InputError(f"{where}.group[{j}].name: {shown(tensor.get('name'))} is not text; give a name containing {{i}}, "
                             "e.g. \"layers.{i}.mlp.weight\"")
        if "{i}" not in tensor["name"]:
            raise InputError(f"{where}.group[{j}].name: {shown(tensor.get('name'))} lacks {{i}}, so its {repeat} copies "
                             "would share a name; write e.g. \"layers.{i}.mlp.weight\"")
    return [(_numbered(t, i), f"{where}.group[{j}] (i={i})") for i in range(first, first + repeat) for j, t in enumerate(group)]


def _numbered(tensor: dict, i: int) -> dict:
    """A group's tensor as copy i: {i} in its name, and in the names a fused tensor lists, becomes i."""
    out = {**tensor, "name": tensor["name"].replace("{i}", str(i))}
    if isinstance(tensor.get("fuse"), list):
        out["fuse"] = [p.replace("{i}", str(i)) if isinstance(p, str) else p for p in tensor["fuse"]]
    return out


def _fused_dtypes(tensors: list[dict[str, Any]], fused: list[dict[str, Any]]) -> set[str]:
    """A fused tensor's `dst_dtype` and `scale` are its parts' (a part giving others is refused); the names of the
    fused tensors with scales."""
    by_name = {t["name"]: (i, t) for i, t in enumerate(tensors)}
    scaled = set()
    for f in fused:
        given = {key: f.pop(key) for key in ("dst_dtype", "scale") if f.get(key) is not None}
        if "scale" in given:
            scaled.add(f["name"])
        for part in dict.fromkeys(part_ref(p)[0] for p in f["parts"]):
            if part not in by_name:
                continue
            i, tensor = by_name[part]
            for key, value in given.items():
                if tensor.get(key) not in (None, value):
                    raise InputError(f"tensors[{i}] ({quoted(part)}).{key}: {tensor[key]!r}, but its fused tensor {quoted(f['name'])} "
                                     f"gives {value!r}; give it once, on the fused tensor")
                tensor[key] = value
    return scaled


def _fused_scales(fused: list[dict[str, Any]], scaled: set[str], tensors: list[dict[str, Any]], dst_mesh) -> list[dict[str, Any]]:
    """For each fused tensor with scales, the fused tensor of its parts' block scales (`schemas.convert.fused_block_scales`);
    one not valid as written is left for the problem's own checks to name."""
    out = []
    shapes = {t["name"]: tuple(t["shape"]) for t in tensors if isinstance(t.get("shape"), (list, tuple))}
    for k, f in enumerate(fused):
        if f["name"] not in scaled:
            continue
        try:
            made = FusedTensor.model_validate(f)
            if any(t.get("scale") != "block" for t in tensors if t["name"] in {n for n, _ in made.refs()}):
                continue  # the problem names the fault
            out.append(fused_block_scales(made, shapes, dst_mesh).model_dump())
        except (ValidationError, KeyError, IndexError, TypeError):
            continue
        except ValueError as err:
            raise InputError(f"fused tensor {quoted(f['name'])}: {err}") from None
    return out


def _with_scales(tensors: list[dict[str, Any]], src_mesh, dst_mesh, cluster, parts: set[str]) -> list[dict[str, Any]]:
    """The tensors with each FP8 tensor's scale tensor after it (`schemas.transfer.scale_tensor`); a tensor that is
    not valid as written is left for the problem's own checks to name."""
    out = []
    for i, t in enumerate(tensors):
        out.append(t)
        if t.get("scale") is None:
            continue
        fused = t["name"] in parts  # no destination layout of its own: any stands in, only the source's is read
        if fused and t["scale"] != "block":
            continue  # a fused tensor takes block scales only: the problem says so
        try:
            tensor = TensorTransfer.model_validate(t | ({"dst": " ".join("R" * len(t["shape"]))} if fused else {}))
            single = single_problem(tensor, src_mesh, dst_mesh, cluster)
        except (ValidationError, ValueError, TypeError):
            continue
        try:
            out.append(scale_tensor(tensor, single, fused_part=fused).model_dump(exclude_none=True))
        except ValueError as err:
            raise InputError(f"tensors[{i}] ({quoted(tensor.name)}).scale: {err}") from None
    return out


def _fused(entry: dict, where: str, rules: _RuleMatcher, known: set) -> dict[str, Any]:
    """One fused destination (`fuse = [parts...]`, `dim`, and `dst` or `dst_boxes`, or a rule's dst) as FusedTensor data."""
    extra = sorted(set(entry) - set(FUSED_KEYS))
    if extra:
        raise InputError(f"{where}.{quoted(extra[0])}: not a field of a fused tensor; use {', '.join(FUSED_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: give a fused tensor a name (text), e.g. {{name = \"qkv\", fuse = [\"q\", \"k\", \"v\"], dim = 0}}")
    fuse = entry["fuse"]
    if not isinstance(fuse, list) or not fuse or not all(isinstance(p, str) for p in fuse):
        raise InputError(f"{where}.fuse ({quoted(name)}): give the names of the tensors it concatenates, in order, e.g. [\"q\", \"k\", \"v\"]")
    missing = next((p for p in fuse if part_ref(p)[0] not in known), None)
    if missing is not None:
        raise InputError(f"{where}.fuse ({quoted(name)}): no tensor is called {part_ref(missing)[0]!r}; list tensors of the problem")
    if "dim" not in entry:
        raise InputError(f"{where}.dim ({quoted(name)}): missing; give the dim its parts are concatenated along, e.g. dim = 0")
    out = {"name": name, "parts": fuse, "dim": entry["dim"]}
    out |= {key: entry[key] for key in ("dst_dtype", "scale") if entry.get(key) is not None}
    if entry.get("dst_boxes") is not None and entry.get("dst") is not None:
        raise InputError(f"{where}.dst_boxes ({quoted(name)}): give dst or dst_boxes, not both")
    if entry.get("dst_boxes") is not None:
        out["dst_boxes"] = entry["dst_boxes"]
    else:
        spec = entry["dst"] if entry.get("dst") is not None else rules.spec(name, "dst")
        if spec is None:
            raise InputError(f"{where} ({quoted(name)}): no rule gives its dst spec; give dst (the fused tensor's spec) or dst_boxes")
        out["dst"] = spec
    return out


def _tensor(entry: Any, where: str, rules: _RuleMatcher, default_dtype: Any, parts: set[str] = frozenset()) -> dict[str, Any]:
    """One tensor as TensorTransfer data, specs filled in from the rules (a part of a fused tensor takes no dst)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"] or "shape" not in entry:
        raise InputError(f"{where}: give a tensor as an object with name (text) and shape, e.g. {{name = \"w\", shape = [1024, 512]}}")
    extra = sorted(set(entry) - set(TENSOR_KEYS))
    if extra:
        raise InputError(f"{where}.{quoted(extra[0])}: not a field of a tensor; use {', '.join(TENSOR_KEYS)}")
    name = entry["name"]
    if "dtype" in entry and not _known_dtype(entry["dtype"]):
        raise InputError(f"{where}.dtype ({quoted(name)}): unknown dtype {shown(entry['dtype'])}; use one of {', '.join(sorted(DTYPE_SIZES))}")
    out = {"name": name, "dtype": entry.get("dtype", default_dtype), "shape": entry["shape"]}
    out |= {key: entry[key] for key in ("dst_dtype", "scale") if entry.get(key) is not None}
    if isinstance(out["shape"], str):
        out["shape"] = parse_shape(out["shape"], f"{where}.shape")
    if isinstance(out["shape"], (list, tuple)) and not out["shape"]:
        raise InputError(f"{where}.shape ({quoted(name)}): a 0-d tensor (a scalar) has no dim to shard; give it as shape [1]")
    for side in ("src", "dst"):
        if side == "dst" and name in parts and entry.get("dst") is None and entry.get("dst_boxes") is None:
            continue  # its destination layout is the fused tensor's
        if entry.get(f"{side}_boxes") is not None:
            if entry.get(side) is not None:
                raise InputError(f"{where}.{side}_boxes ({quoted(name)}): give {side} or {side}_boxes, not both")
            out[f"{side}_boxes"] = entry[f"{side}_boxes"]
            continue
        spec = entry.get(side)
        if spec is None:
            spec = rules.spec(name, side)
        if spec is None:
            raise InputError(f"{where} ({quoted(name)}): no rule gives its {side} spec; add a rule whose match fits {name!r} "
                             f"(match = \"*\" as the last rule catches every tensor) or give {side} on the tensor")
        out[side] = spec
    return out
