"""Fused destinations (`schemas.fused`): a destination tensor that concatenates source tensors along a dim, then is
sharded, planned as its parts' boxes, verified element by element, run bit for bit and assembled on every device."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import InputError
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.verify import PlanError, fused_provenance, verify_plan
from xmesh_plan.schemas import Plan, ShardingSpec
from xmesh_plan.schemas.fused import assemble_fused, fused_pieces, fused_views
from xmesh_plan.schemas.plan_check import check_plan
from tests.support.cases import STRATEGIES
from tests.support.cli import run_cli
from tests.support.transfer import fake_executors, full_tensors, run_everywhere, slice_box

TP_QKV = ["q[0:8]", "k[0:2]", "v[0:2]", "q[8:16]", "k[2:4]", "v[2:4]"]


def fused_raw(**extra) -> dict:
    """A layer as an FSDP trainer (4 ranks, q sharded unevenly by boxes) and two TP=2 inference replicas hold it:
    qkv as each TP rank keeps it (its own rows of q, k and v), gate_up as cat(gate, up) split in two."""
    return {
        "src_mesh": {"shape": [4], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [2, 2], "devices": [4, 5, 6, 7]},
        "cluster": {"devices_per_host": 2}, "dtype": "bfloat16",
        "rules": [{"match": "*", "src": "S0 R"}],
        "tensors": [
            {"name": "q", "shape": [16, 6], "src_boxes": [[[0, 5], [0, 6]], [[5, 9], [0, 6]], [[9, 13], [0, 6]], [[13, 16], [0, 6]]]},
            {"name": "k", "shape": [4, 6]}, {"name": "v", "shape": [4, 6], "src": "R S0"},
            {"name": "gate", "shape": [10, 6]}, {"name": "up", "shape": [10, 6]},
            {"name": "o", "shape": [6, 16], "dst": "R S1"},
            {"name": "qkv", "fuse": TP_QKV, "dim": 0, "dst": "S1 R"},
            {"name": "gate_up", "fuse": ["gate", "up"], "dim": 0, "dst": "R S1"} | extra,
        ]}


def fused_global(full: dict[str, np.ndarray], parts: list[str]) -> np.ndarray:
    """The fused tensor by numpy: its parts (ranges cut out) concatenated along dim 0."""
    pieces = []
    for part in parts:
        found = re.fullmatch(r"(.+)\[(\d+):(\d+)\]", part)
        pieces.append(full[found.group(1)][int(found.group(2)):int(found.group(3))] if found else full[part])
    return np.concatenate(pieces, axis=0)


@pytest.mark.parametrize("strategy", STRATEGIES + ("auto",))
def test_fused_destinations_verify_run_and_assemble_bit_exact(strategy):
    problem = build_transfer(fused_raw())
    plan = compile_plan(problem, strategy=strategy, solver="greedy")
    report = verify_plan(plan)
    assert report.fused == 2 and plan.schema_version == 2
    full = full_tensors(plan, seed=11)
    out = run_everywhere(plan, fake_executors(plan), full)
    for j, parts in enumerate((TP_QKV, ["gate", "up"])):
        reference = fused_global(full, parts)
        for device, box in problem.fused_blocks(j).items():
            want = slice_box(reference, box)
            got = assemble_fused(problem, j, device, out[device], np.empty_like(want))
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (j, device)
            shard = np.zeros_like(want)
            views = fused_views(problem, j, device, shard)
            for name, view in views.items():  # each tensor one part here: its received shard is exactly its view
                view[...] = out[device][name]
            assert np.array_equal(shard.view(np.uint8), want.view(np.uint8)), (j, device)
            tensors, index = fused_provenance(plan, problem.fused[j].name, device)
            traced = np.array([full[problem.tensors[t].name].flat[i] for t, i in zip(tensors.flat, index.flat)]).reshape(want.shape)
            assert np.array_equal(traced.view(np.uint8), want.view(np.uint8)), (j, device)


def test_a_tp_rank_holds_its_own_rows_of_q_k_and_v():
    problem = build_transfer(fused_raw())
    qkv = problem.fused[0]
    assert problem.fused_shape(0) == (24, 6) and qkv.refs()[3] == ("q", (8, 16))
    # mesh 2x2, S1 R: TP rank 0 (devices 4 and 6) holds fused rows 0:12 = q[0:8], k[0:2], v[0:2]
    assert [(n, p[0]) for n, p, _ in fused_pieces(problem, 0, 6)] == [("q", (0, 8)), ("k", (0, 2)), ("v", (0, 2))]
    assert [(n, p[0]) for n, p, _ in fused_pieces(problem, 0, 5)] == [("q", (8, 16)), ("k", (2, 4)), ("v", (2, 4))]
    q = problem.tensor_problem(problem.index_of("q"))
    assert q.blocks("dst") == {4: ((0, 8), (0, 6)), 5: ((8, 16), (0, 6)), 6: ((0, 8), (0, 6)), 7: ((8, 16), (0, 6))}


def test_the_verifier_reads_the_fused_layout_a_plan_states():
    """A plan whose fused tensor's layout is edited after compiling no longer delivers what it says: refused."""
    plan = compile_plan(build_transfer(fused_raw()), solver="greedy")
    fused = plan.problem.fused
    edited = plan.problem.model_copy(update={"fused": (fused[0].model_copy(update={"dst": ShardingSpec.parse("R R")}),) + fused[1:]})
    with pytest.raises(PlanError, match="tensor 'q': destination device .* never receives"):
        verify_plan(plan.model_copy(update={"problem": edited}))


def test_a_fused_plan_must_say_schema_2_and_old_plans_stay_schema_1():
    plan = compile_plan(build_transfer(fused_raw()), solver="greedy")
    with pytest.raises(PlanError, match="schema_version 1, but the problem lists boxes, fused destinations or conversions, which need schema 2"):
        check_plan(plan.model_copy(update={"schema_version": 1}))
    assert Plan.from_json(plan.to_json()) == plan
    assert '"schema_version": 1' in (Path(__file__).resolve().parent.parent / "plans" / "weight_sync_small.plan.json").read_text()


def _tensor(raw: dict, name: str) -> dict:
    return next(t for t in raw["tensors"] if t["name"] == name)


def _edited(edit) -> dict:
    raw = fused_raw()
    edit(raw)
    return raw


@pytest.mark.parametrize("edit, message", [
    (lambda r: _tensor(r, "qkv").update(fuse=["q", "kk"]), r"tensors\[6\].fuse \(qkv\): no tensor is called 'kk'; list tensors of the problem"),
    (lambda r: _tensor(r, "gate_up").update(fuse=["gate", "up", "k"]), r"fused\[1\] \(gate_up\).parts\[2\]: 'k' is also a part of fused\[0\]"),
    (lambda r: _tensor(r, "k").update(dst="S0 R"), r"parts\[1\]: tensor 'k' gives its own destination layout; .* drop its dst"),
    (lambda r: _tensor(r, "up").update(dtype="float32"), r"parts\[1\]: 'up' is float32 but 'gate' is bfloat16"),
    (lambda r: _tensor(r, "up").update(shape=[10, 7]), r"parts\[1\]: 'up' has shape \[10, 7\] and 'gate' \[10, 6\]; parts may differ only along dim 0"),
    (lambda r: _tensor(r, "qkv").update(fuse=["q[0:8]", "k[0:5]", "v"]), r"'k\[0:5\]' reaches past 'k''s length 4 along dim 0"),
    (lambda r: _tensor(r, "qkv").update(fuse=["q[8:8]", "k", "v"]), r"'q\[8:8\]' is an empty range"),
    (lambda r: _tensor(r, "qkv").update(fuse=["q[0:4]", "k", "q[8:16]", "v"], dst="R R"),
     r"device 4 needs \[0:4, 0:6\] and \[8:16, 0:6\] of 'q', two separate boxes; .*split the tensor in two"),
    (lambda r: _tensor(r, "qkv").update(fuse=["q[0:8]", "k[0:2]", "v[0:2]", "q[0:8]", "k[2:4]", "v[2:4]"]),
     r"fused\[0\] \(qkv\).parts: no part covers rows 8:16 of 'q' along dim 0, so they reach no device; list every range of 'q'"),
    (lambda r: _tensor(r, "qkv").update(fuse=["q[0:8]", "k[0:2]", "v", "q[8:16]", "k[0:2]", "v"]),
     r"fused\[0\] \(qkv\).parts: no part covers rows 2:4 of 'k' along dim 0"),
    (lambda r: _tensor(r, "qkv").update(name="o"), r"fused\[0\] \(o\).name: 'o' is also another tensor's name"),
    (lambda r: _tensor(r, "qkv").update(dst_boxes=[[[0, 1], [0, 6]]] * 4), r"tensors\[6\].dst_boxes \(qkv\): give dst or dst_boxes, not both"),
    (lambda r: _tensor(r, "qkv").update(dst="S0 S1 R"), r"fused\[0\] \(qkv\): dst 'S0 S1 R' has 3 entries but the tensor has 2 dims"),
    (lambda r: _tensor(r, "qkv").pop("dim"), r"dim \(qkv\): missing; give the dim its parts are concatenated along"),
    (lambda r: _tensor(r, "qkv").update(dim=2), r"fused\[0\] \(qkv\).dim: 2 but 'q' has 2 dims"),
    (lambda r: _tensor(r, "qkv").update(fuse="q"), r"fuse \(qkv\): give the names of the tensors it concatenates"),
    (lambda r: _tensor(r, "qkv").update(shape=[4]), r"tensors\[6\].shape: not a field of a fused tensor; use name, fuse, dim, dst, dst_boxes"),
])
def test_bad_fused_tensors_get_one_line_naming_the_field_and_the_fix(edit, message):
    with pytest.raises(InputError) as info:
        build_transfer(_edited(edit))
    assert re.search(message, str(info.value)) and "\n" not in str(info.value), str(info.value)


def test_a_fused_tensor_may_list_a_range_once_per_rank():
    """Replicated KV heads: each TP rank's rows of the fused tensor hold all of k and v, so they are listed twice."""
    problem = build_transfer(_edited(lambda r: _tensor(r, "qkv").update(fuse=["q[0:8]", "k", "v", "q[8:16]", "k", "v"])))
    assert problem.fused_lengths(0) == [8, 4, 4, 8, 4, 4]


FUSED_TOML = '''
name = "fused_layers"
dtype = "bfloat16"
src_mesh = "1x4"
dst_mesh = "2x2"

[cluster]
devices_per_host = 4

[[rules]]
match = "*"
src = "S0 R"

[[tensors]]
repeat = 2
group = [
  { name = "layers.{i}.q_proj.weight", shape = [16, 8] },
  { name = "layers.{i}.k_proj.weight", shape = [4, 8] },
  { name = "layers.{i}.v_proj.weight", shape = [4, 8] },
  { name = "layers.{i}.qkv_proj.weight", dim = 0, dst = "S1 R", fuse = [
      "layers.{i}.q_proj.weight", "layers.{i}.k_proj.weight", "layers.{i}.v_proj.weight"] },
]
'''


def test_a_problem_file_fuses_repeated_layers_and_the_cli_verifies_the_plan(tmp_path):
    path = tmp_path / "fused.toml"
    path.write_text(FUSED_TOML)
    result = run_cli("compile", path, "-o", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert [f.name for f in plan.problem.fused] == ["layers.0.qkv_proj.weight", "layers.1.qkv_proj.weight"]
    assert plan.problem.fused[1].parts[2] == "layers.1.v_proj.weight"
    result = run_cli("verify", tmp_path / "plan.json")
    assert result.exit_code == 0 and "2 fused destination tensors" in result.output, result.output


def random_fused_raw(seed: int) -> tuple[dict, list[str]]:
    """A random fused destination: two to four tensors (some cut into two ranges, the ranges shuffled) concatenated
    along a random dim, on random meshes, the fused tensor laid out by a random spec or random boxes."""
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 3))
    dim = int(rng.integers(0, ndim))
    other = [int(n) for n in rng.integers(1, 5, size=ndim)]
    tensors, parts = [], []
    for k in range(int(rng.integers(2, 5))):
        shape = list(other)
        shape[dim] = int(rng.integers(1, 7))
        tensors.append({"name": f"t{k}", "shape": shape, "src": " ".join("S0" if d == 0 and rng.random() < 0.6 else "R"
                                                                         for d in range(ndim))})
        if shape[dim] > 1 and rng.random() < 0.4:
            cut = int(rng.integers(1, shape[dim]))
            parts += [f"t{k}[0:{cut}]", f"t{k}[{cut}:{shape[dim]}]"]
        else:
            parts.append(f"t{k}")
    order = [parts[i] for i in rng.permutation(len(parts))]
    fused = {"name": "fused", "fuse": order, "dim": dim}
    dst_devices = int(rng.integers(1, 5))
    length = sum((int(p.split("[")[1].split(":")[1][:-1]) - int(p.split("[")[1].split(":")[0]))
                 if "[" in p else tensors[int(p[1:])]["shape"][dim] for p in order)
    fused_shape = list(other)
    fused_shape[dim] = length
    if rng.random() < 0.5:
        fused["dst"] = " ".join("S0" if d == dim else "R" for d in range(ndim))
    else:
        fused["dst_boxes"] = [[sorted(int(x) for x in rng.integers(0, n + 1, size=2)) for n in fused_shape] for _ in range(dst_devices)]
    raw = {"src_mesh": {"shape": [3], "devices": [0, 1, 2]}, "dst_mesh": {"shape": [dst_devices], "devices": list(range(2, 2 + dst_devices))},
           "cluster": {"devices_per_host": 2}, "dtype": str(rng.choice(["int8", "bfloat16", "float32"])), "tensors": tensors + [fused]}
    return raw, order


def test_random_fused_destinations_run_bit_exact_and_trace_every_element():
    built = refused = 0
    for seed in range(60):
        raw, parts = random_fused_raw(seed)
        try:
            problem = build_transfer(raw)
        except InputError as err:
            assert "two separate boxes" in str(err), (seed, str(err))
            refused += 1
            continue
        built += 1
        plan = compile_plan(problem, strategy=STRATEGIES[seed % len(STRATEGIES)], solver="greedy")
        assert verify_plan(plan).fused == 1
        full = full_tensors(plan, seed=seed)
        out = run_everywhere(plan, fake_executors(plan), full)
        dim = problem.fused[0].dim
        pieces = []
        for part in parts:
            name, span = (part.split("[")[0], part.split("[")[1][:-1]) if "[" in part else (part, None)
            whole = full[name]
            pieces.append(whole if span is None else np.take(whole, range(*map(int, span.split(":"))), axis=dim))
        reference = np.concatenate(pieces, axis=dim)
        for device, box in problem.fused_blocks(0).items():
            want = slice_box(reference, box)
            got = assemble_fused(problem, 0, device, out.get(device, {}), np.zeros_like(want))
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (seed, device)
            tensors, index = fused_provenance(plan, "fused", device)
            traced = np.array([full[problem.tensors[t].name].flat[i] for t, i in zip(tensors.flat, index.flat)],
                              dtype=want.dtype).reshape(want.shape)
            assert np.array_equal(traced.view(np.uint8), want.view(np.uint8)), (seed, device)
    assert built >= 40 and refused >= 2, (built, refused)
