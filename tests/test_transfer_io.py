"""Reading multi-tensor problems: rules by name pattern, repeated groups, the example files, and errors."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from xmesh_plan.planner.cli import main
from xmesh_plan.planner.problem_io import InputError, load_problem
from xmesh_plan.planner.transfer_io import build_any_problem, build_transfer, load_any_problem
from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.transfer import TransferProblem, single_problem

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "plans" / "weight_sync_llama3_8b.problem.toml"
SMALL = ROOT / "plans" / "weight_sync_small.problem.toml"


def raw(**changes):
    data = {"src_mesh": "2x2", "dst_mesh": "1x2", "cluster": {"devices_per_host": 2},
            "tensors": [{"name": "a", "shape": [8, 4], "src": "S0 R", "dst": "R S1"},
                        {"name": "b", "shape": [6], "dtype": "int16", "src": "S01", "dst": "R"}]}
    data.update(changes)
    return data


def test_tensors_keep_their_order_dtype_and_specs_and_share_the_meshes():
    p = build_transfer(raw(dtype="bfloat16"))
    assert [(t.name, t.shape, t.dtype, str(t.src), str(t.dst)) for t in p.tensors] == [
        ("a", (8, 4), "bfloat16", "S0 R", "R S1"), ("b", (6,), "int16", "S01", "R")]
    assert p.src_mesh.devices == (0, 1, 2, 3) and p.dst_mesh.devices == (4, 5)  # destination on the hosts after the source
    single = p.tensor_problem(1)
    assert isinstance(single, ReshardingProblem) and single.src.mesh == p.src_mesh and single.nbytes == 12


def test_the_first_rule_that_fits_and_gives_the_side_wins_and_the_tensor_own_spec_beats_rules():
    rules = [{"match": "*.w", "dst": "S1 R"}, {"match": "x.*", "src": "R R", "dst": "R R"}, {"match": "*", "src": "S0 R", "dst": "R S1"}]
    tensors = [{"name": "x.w", "shape": [4, 4]}, {"name": "x.v", "shape": [4, 4]}, {"name": "y.v", "shape": [4, 4]},
               {"name": "y.w", "shape": [4, 4], "src": "S1 R"}]
    p = build_transfer(raw(rules=rules, tensors=tensors))
    assert [(str(t.src), str(t.dst)) for t in p.tensors] == [("R R", "S1 R"), ("R R", "R R"), ("S0 R", "R S1"), ("S1 R", "S1 R")]


def test_a_pattern_matches_the_whole_name_not_a_part_of_it():
    rules = [{"match": "q_proj.weight", "src": "R R", "dst": "R R"}, {"match": "*", "src": "S0 R", "dst": "S0 R"}]
    p = build_transfer(raw(rules=rules, tensors=[{"name": "layers.0.q_proj.weight", "shape": [4, 4]}, {"name": "q_proj.weight", "shape": [4, 4]}]))
    assert [str(t.src) for t in p.tensors] == ["S0 R", "R R"]


def test_a_rule_that_fits_no_tensor_is_refused_naming_it():
    """A typo in a pattern would leave its tensors to a later rule and give a wrong layout without a word."""
    rules = [{"match": "*.o_prj.weight", "dst": "R S1"}, {"match": "*", "src": "S0 R", "dst": "S0 R"}]
    with pytest.raises(InputError, match=r"rules\[0\] \(match '\*\.o_prj\.weight'\) fits no tensor's name"):
        build_transfer(raw(rules=rules, tensors=[{"name": "l.0.o_proj.weight", "shape": [4, 4]}]))


def test_a_plan_file_given_as_a_problem_says_so(tmp_path):
    result = CliRunner().invoke(main, ["compile", str(ROOT / "plans" / "weight_sync_small.plan.json"), "-o", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "this is a plan file" in result.output and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("flag", ["--max-staging-mb", "--bucket-mb"])
def test_a_nan_size_flag_is_refused_with_exit_2(flag, tmp_path):
    result = CliRunner().invoke(main, ["compile", str(SMALL), flag, "nan", "-o", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "'nan' must be a finite number" in result.output and "Traceback" not in result.output


def test_a_repeated_group_unrolls_layer_by_layer():
    group = [{"name": "l.{i}.w", "shape": [4, 2], "src": "S0 R", "dst": "R R"}, {"name": "l.{i}.n", "shape": [4], "src": "R", "dst": "R"}]
    p = build_transfer(raw(tensors=[{"name": "e", "shape": [2], "src": "R", "dst": "R"}, {"repeat": 3, "group": group}]))
    assert p.names == ("e", "l.0.w", "l.0.n", "l.1.w", "l.1.n", "l.2.w", "l.2.n")


def test_a_repeated_group_numbers_its_layers_from_first():
    group = [{"name": "l.{i}.w", "shape": [4], "src": "R", "dst": "R"}]
    p = build_transfer(raw(tensors=[{"repeat": 1, "group": group}, {"repeat": 2, "first": 1, "group": group}]))
    assert p.names == ("l.0.w", "l.1.w", "l.2.w")


@pytest.mark.parametrize("change, words", [
    ({"tensors": [{"name": "a", "shape": [8, 4], "src": "S0 R"}]}, ["tensors[0] (a)", "dst", "rule"]),
    ({"tensors": [{"name": "a", "shape": [4], "src": "R", "dst": "R"}, {"name": "a", "shape": [4], "src": "R", "dst": "R"}]},
     ["tensors[1].name", "'a'", "tensors[0]"]),
    ({"tensors": [{"repeat": 2, "group": [{"name": "w", "shape": [4], "src": "R", "dst": "R"}]}]}, ["tensors[0].group[0].name", "{i}"]),
    ({"tensors": [{"repeat": -1, "group": [{"name": "w{i}", "shape": [4]}]}]}, ["tensors[0].repeat"]),
    ({"tensors": [{"repeat": 2, "first": -3, "group": [{"name": "w{i}", "shape": [4]}]}]}, ["tensors[0].first", "-3"]),
    ({"tensors": [{"repeat": 2, "last": 3, "group": [{"name": "w{i}", "shape": [4]}]}]}, ["tensors[0].last", "repeat, first, group"]),
    ({"tensors": [{"repeat": 100_000, "group": [{"name": "w{i}", "shape": [4]}] * 1000}]}, ["tensors[0]", "100,000", "split"]),
    ({"tensors": [{"name": "a", "shape": [8, 4], "src": "S0 R", "dst": "R S2"}]}, ["tensors[0] (a)", "R S2", "axis 2"]),
    ({"tensors": [{"name": "a", "shape": [8, 4], "src": "S0", "dst": "R R"}]}, ["tensors[0] (a)", "src.spec"]),
    ({"tensors": [{"name": "a", "shape": [8, 4], "src": "S0 R", "dst": "R R", "spec": "R"}]}, ["tensors[0].spec"]),
    ({"tensors": []}, ["tensors", "non-empty"]),
    ({"tensors": [{"name": "s", "shape": [], "src": "R", "dst": "R"}]}, ["tensors[0].shape (s)", "0-d", "shape [1]"]),
    ({"tensors": [{"name": "d", "shape": [4, 4], "src": "R R", "dst": "S0 S0"}]}, ["tensors[0] (d).dst", "more than once"]),
    ({"tensors": [{"name": "f", "shape": [4.5], "src": "R", "dst": "R"}]}, ["tensors[0] (f).shape"]),
    ({"rules": [{"match": "*"}]}, ["rules[0]", "src and/or dst"]),
    ({"rules": [{"match": "*", "src": "R", "when": 1}]}, ["rules[0].when"]),
    ({"src_mes": "2x2"}, ["src_mes", "src_mesh"]),
    ({"dst_mesh": "1x4"}, ["dst_mesh", "devices_per_host"]),
    ({"tensors": [{"name": "a", "shape": "8,x", "src": "R", "dst": "R"}]}, ["tensors[0].shape"]),
    ({"dtype": "bf16x"}, ["dtype:", "'bf16x'", "default of every tensor"]),
    ({"tensors": [{"name": "a", "dtype": "bf16x", "shape": [4], "src": "R", "dst": "R"}]}, ["tensors[0].dtype (a)", "'bf16x'"]),
    ({"rules": [{"match": "*", "src": 5}]}, ["rules[0].src", "not a sharding spec"]),
    ({"tensors": [{"repeat": 0, "group": [{"name": "w{i}", "shape": [4], "src": "R", "dst": "R"}]}]}, ["tensors", "no tensor is left"]),
    ({"tensors": [{"repeat": 2, "group": [{"repeat": 2, "group": [{"name": "w{i}", "shape": [4]}]}]}]},
     ["tensors[0].group[0]", "cannot hold another"]),
])
def test_bad_input_is_one_line_naming_the_field(change, words):
    data = raw(**change)
    with pytest.raises(InputError) as err:
        build_transfer(data)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_the_cli_refuses_a_bad_multi_tensor_file_with_one_line_and_exit_2(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw(tensors=[{"name": "layers.3.mlp.w", "shape": [8, 4], "src": "S0 R"}])))
    result = CliRunner().invoke(main, ["compile", str(path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "layers.3.mlp.w" in lines[0] and "Traceback" not in result.output


def test_a_copy_with_other_tensors_does_not_reuse_the_original_per_tensor_problems():
    p = build_transfer(raw(tensors=[{"name": "a", "shape": [8, 4], "src": "S0 R", "dst": "R R"}]))
    assert p.tensor_problem(0).shape == (8, 4)  # fills the per-tensor cache
    q = p.model_copy(update={"tensors": (p.tensors[0].model_copy(update={"shape": (4, 4)}),)})
    assert q.tensor_problem(0).shape == (4, 4) and p.tensor_problem(0).shape == (8, 4)


def test_tensors_of_one_layout_share_one_validated_problem_each_under_its_own_name():
    p = load_any_problem(LLAMA)
    singles = p.tensor_problems()
    q, k = (p.index_of(f"model.layers.7.self_attn.{w}_proj.weight") for w in ("q", "k"))
    assert singles[q].src is singles[p.index_of("model.layers.3.self_attn.q_proj.weight")].src  # one layout: validated once
    assert singles[q].src is not singles[k].src  # another shape: its own
    for t, single in zip(p.tensors, singles):  # each as made alone, its name included
        assert single == single_problem(t, p.src_mesh, p.dst_mesh, p.cluster), t.name
        assert single.model_fields_set == single_problem(t, p.src_mesh, p.dst_mesh, p.cluster).model_fields_set


def test_a_single_tensor_problem_stays_valid_as_it_is():
    path = ROOT / "plans" / "case3.problem.json"
    assert load_any_problem(path) == load_problem(path)
    assert isinstance(build_any_problem(json.loads(path.read_text())), ReshardingProblem)


def test_toml_and_json_forms_give_the_same_problem(tmp_path):
    data = tomllib.loads(SMALL.read_text())
    path = tmp_path / "small.json"
    path.write_text(json.dumps(data))
    assert load_any_problem(path) == load_any_problem(SMALL)


def test_the_llama_example_has_every_parameter_of_llama3_8b():
    p = load_any_problem(LLAMA)
    assert isinstance(p, TransferProblem) and len(p.tensors) == 1 + 32 * 9 + 2
    assert sum(t.nbytes for t in p.tensors) == 2 * 8_030_261_248  # Llama-3-8B's published parameter count, bfloat16
    assert p.src_mesh.shape == (4, 8) and p.dst_mesh.shape == (2, 8) and not set(p.src_mesh.devices) & set(p.dst_mesh.devices)
    specs = {t.name: (str(t.src), str(t.dst)) for t in p.tensors}
    for name, dst in [("model.embed_tokens.weight", "S1 R"), ("lm_head.weight", "S1 R"), ("model.norm.weight", "R"),
                      ("model.layers.7.self_attn.q_proj.weight", "S1 R"), ("model.layers.7.self_attn.k_proj.weight", "S1 R"),
                      ("model.layers.31.mlp.up_proj.weight", "S1 R"), ("model.layers.0.self_attn.o_proj.weight", "R S1"),
                      ("model.layers.0.mlp.down_proj.weight", "R S1"), ("model.layers.5.input_layernorm.weight", "R")]:
        assert specs[name][1] == dst, name
    assert {src for src, _ in specs.values()} == {"S01 R", "S01"}  # FSDP: dim 0 over all 32 devices
    for i in (0, 1, 4):  # every sharded dim splits evenly on both sides
        single = p.tensor_problem(i)
        for side in ("src", "dst"):
            sizes = {tuple(b - a for a, b in box) for box in single.blocks(side).values()}
            assert len(sizes) == 1, (single.name, side, sizes)


def test_the_frontier_examples_hold_llama3_70b_and_deepseek_v3_as_laid_out():
    dense = load_any_problem(ROOT / "plans" / "weight_sync_llama3_70b.problem.toml")
    assert len(dense.tensors) == 1 + 80 * 9 + 2 and dense.nbytes == 2 * 70_553_706_496  # Llama-3-70B's parameters, bfloat16
    assert dense.src_mesh.shape == (8, 8) and dense.dst_mesh.shape == (2, 8) and len(dense.cluster.nics) == 8
    moe = load_any_problem(ROOT / "plans" / "weight_sync_deepseek_v3.problem.toml")
    assert moe.nbytes == 2 * 671_026_419_200 and moe.src_mesh.shape == (32, 8) and moe.dst_mesh.shape == (4, 4, 8)
    specs = {t.name: (t.shape, str(t.src), str(t.dst)) for t in moe.tensors}
    assert "model.layers.2.mlp.down_proj.weight" in specs and "model.layers.3.mlp.down_proj.weight" not in specs
    assert specs["model.layers.60.mlp.experts.down_proj.weight"] == ((256, 7168, 2048), "S0 S1 R", "S12 R R")
    assert specs["model.layers.3.self_attn.o_proj.weight"][1:] == ("S01 R", "R S2")
    assert specs["model.layers.3.mlp.shared_experts.gate_proj.weight"][1:] == ("S01 R", "S2 R")
    assert specs["model.layers.3.mlp.gate.weight"][1:] == ("S01 R", "R R")


def test_the_format_page_example_reads_as_it_says():
    text = (ROOT / "docs" / "format.md").read_text().split("```toml")[1].split("```")[0]
    p = build_transfer(tomllib.loads(text))
    assert p.names == ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                       "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight")
    assert [str(t.dst) for t in p.tensors] == ["S1 R", "R", "S1 R", "R", "S1 R"] and p.tensors[0].dtype == "bfloat16"


def test_a_bucket_size_without_coalescing_is_refused(tmp_path):
    """--bucket-mb only sizes bundles: given where nothing is coalesced it would be silently ignored."""
    for args in (["--no-coalesce"], []):
        problem = str(SMALL) if args else str(ROOT / "plans" / "case3.problem.json")  # a single tensor coalesces only when asked
        result = CliRunner().invoke(main, ["compile", problem, *args, "--bucket-mb", "2", "-o", str(tmp_path / "x.json")])
        assert result.exit_code == 2 and "--bucket-mb sizes coalesced bundles" in result.output and not (tmp_path / "x.json").exists()

