"""Layouts as per-device boxes (`schemas.boxes`): validated at the door, cut, planned by every strategy, verified
and run bit for bit, in single- and multi-tensor problems and problem files."""

from __future__ import annotations

import re
import tomllib
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import InputError, build_problem
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.unit_tasks import decompose, task_count_bound
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import Cluster, DeviceMesh, Placement, ReshardingProblem
from xmesh_plan.schemas.validation import describe_validation_error
from tests.support.builders import compile_fast
from tests.support.cases import STRATEGIES, random_problem
from tests.support.cli import assert_user_error, run_cli
from tests.support.fake_mpi import simulate
from tests.support.transfer import assert_every_shard, fake_executors, full_tensors, run_everywhere

FORMAT_DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"


def as_boxes(problem: ReshardingProblem, sides=("src", "dst")) -> ReshardingProblem:
    """The same problem with each side in `sides` written as its devices' boxes instead of its spec."""
    update = {}
    for side in sides:
        placement = getattr(problem, side)
        blocks = problem.blocks(side)
        update[side] = Placement(mesh=placement.mesh, boxes=tuple(blocks[d] for d in placement.mesh.devices))
    return ReshardingProblem.model_validate(problem.model_dump() | {k: v.model_dump() for k, v in update.items()})


def cell_set(cells) -> set:
    return {(c.region, c.senders, c.receivers, c.local_copies, c.merged_cells) for c in cells}


@pytest.mark.parametrize("sides", [("src",), ("dst",), ("src", "dst")])
def test_a_spec_written_as_boxes_cuts_into_the_same_cells(sides):
    for seed in range(60):
        problem = random_problem(seed, max_devices=8, exact=False)
        boxed = as_boxes(problem, sides)
        assert boxed.has_boxes and boxed.blocks("src") == problem.blocks("src") and boxed.blocks("dst") == problem.blocks("dst")
        for merge in (True, False):
            assert cell_set(decompose(boxed, merge=merge)) == cell_set(decompose(problem, merge=merge)), (seed, merge)
        assert task_count_bound(boxed) == task_count_bound(problem)


def random_boxes(rng: np.random.Generator, shape, devices: int, cover: bool):
    """One box per device; with `cover`, the first devices tile the tensor (a random grid, every tile on some device)
    and the rest hold random boxes (replicas, overlaps, empties)."""
    boxes = [_random_box(rng, shape) for _ in range(devices)]
    if cover:
        cuts = [sorted({0, n} | set(rng.integers(0, n + 1, size=int(rng.integers(0, 3))).tolist())) for n in shape]
        tiles_list = list(product(*[list(zip(c[:-1], c[1:])) for c in cuts]))
        while len(tiles_list) > devices:  # fewer devices than tiles: two tiles become their hull (which covers both)
            a, b = tiles_list.pop(), tiles_list.pop()
            tiles_list.append(tuple((min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(a, b)))
        for k, tile in enumerate(tiles_list):
            boxes[k] = tuple((int(a), int(b)) for a, b in tile)
    order = rng.permutation(devices)
    return tuple(boxes[i] for i in order)


def _random_box(rng, shape):
    out = []
    for n in shape:
        a, b = sorted(int(x) for x in rng.integers(0, n + 1, size=2))
        out.append((a, b))
    return tuple(out)


def random_box_problem(seed: int) -> ReshardingProblem:
    base = random_problem(seed, max_devices=7, exact=False)
    rng = np.random.default_rng(seed)
    src = random_boxes(rng, base.shape, len(base.src.mesh.devices), cover=True)
    dst = random_boxes(rng, base.shape, len(base.dst.mesh.devices), cover=rng.random() < 0.5)
    data = base.model_dump()
    data["src"] = {"mesh": data["src"]["mesh"], "boxes": src}
    data["dst"] = {"mesh": data["dst"]["mesh"], "boxes": dst}
    return ReshardingProblem.model_validate(data)


@pytest.mark.parametrize("seed", range(40))
def test_random_box_layouts_plan_verify_and_run_bit_exact(seed):
    problem = random_box_problem(seed)
    for strategy in STRATEGIES + ("auto",):
        plan = compile_fast(problem, strategy=strategy)
        verify_plan(plan)
        out = simulate(plan, iterations=2)
        wanted = {d for d, b in problem.blocks("dst").items() if not any(hi <= lo for lo, hi in b)}
        assert wanted <= set(out)


def test_a_destination_listing_part_of_the_tensor_gets_only_that_part():
    problem = ReshardingProblem(shape=(8, 4), src=Placement(mesh=DeviceMesh(shape=(2,), devices=(0, 1)), spec="S0 R"),
                                dst=Placement(mesh=DeviceMesh(shape=(2,), devices=(4, 5)), boxes=(((2, 3), (1, 4)), ((0, 0), (0, 4)))),
                                cluster=Cluster(devices_per_host=2))
    plan = compile_fast(problem, strategy="send_recv")
    assert {op.region for op in plan.operations} == {((2, 3), (1, 4))}
    verify_plan(plan)
    simulate(plan, iterations=1)


def test_the_verifier_refuses_a_box_plan_that_leaves_a_box_short():
    problem = random_box_problem(3)
    plan = compile_fast(problem, strategy="send_recv")
    short = plan.model_copy(update={"operations": plan.operations[:-1]})
    with pytest.raises(PlanError, match="never receives"):
        verify_plan(short)


MESH2 = {"shape": [2], "devices": [0, 1]}


@pytest.mark.parametrize("src, message", [
    ({"mesh": MESH2, "spec": "S0", "boxes": [[[0, 4]], [[4, 8]]]}, "src: give spec .* or boxes .*, not both or neither"),
    ({"mesh": MESH2}, r'src: give an object with "mesh" .* and "spec" .* or "boxes"'),
    ({"mesh": MESH2, "boxes": [[[0, 8]]]}, r"src.boxes: 1 boxes for a mesh of 2 devices; give one box per device"),
    ({"mesh": MESH2, "boxes": [[[0, 8]], [[0, 8], [0, 1]]]}, r"src.boxes\[1\]: 2 \[start, stop\] pairs but the tensor has 1 dims"),
    ({"mesh": MESH2, "boxes": [[[0, 9]], [[0, 8]]]}, r"src.boxes\[0\]: dim 0 is \[0, 9\), not inside \[0, 8\); give 0 <= start <= stop <= 8"),
    ({"mesh": MESH2, "boxes": [[[5, 4]], [[0, 8]]]}, r"src.boxes\[0\]: dim 0 is \[5, 4\)"),
    ({"mesh": MESH2, "boxes": [[[0, 3]], [[4, 8]]]}, r"src.boxes: no source device holds \[3:4\] of the tensor; .*widen a box"),
    ({"mesh": MESH2, "boxes": [[[0, 4]], "4:8"]}, r"src.boxes.1: '4:8' is not a box; write one \[start, stop\] per tensor dim"),
    ({"mesh": MESH2, "boxes": [[[0, 4]], {"offset": [4]}]}, r"src.boxes.1: .* is not a box; write .* or \{offset"),
    ({"mesh": MESH2, "boxes": [[[0, 4]], {"offset": [4], "size": [-1]}]}, "offset and size must be lists of integers of one length, sizes >= 0"),
])
def test_bad_boxes_get_one_line_naming_the_field_and_the_fix(src, message):
    raw = {"shape": [8], "src": src, "dst": {"mesh": {"shape": [1], "devices": [4]}, "spec": "R"}}
    with pytest.raises((ValidationError, InputError)) as info:
        build_problem(raw)
    text = describe_validation_error(info.value) if isinstance(info.value, ValidationError) else str(info.value)
    assert re.search(message, text) and "\n" not in text, text


def test_offset_and_size_read_as_start_and_stop_and_a_plan_round_trips_its_boxes():
    raw = {"shape": [8, 2], "src": {"mesh": MESH2, "boxes": [{"offset": [0, 0], "size": [5, 2]}, [[5, 8], [0, 2]]]},
           "dst": {"mesh": {"shape": [1], "devices": [4]}, "spec": "R R"}}
    problem = build_problem(raw)
    assert problem.src.boxes == (((0, 5), (0, 2)), ((5, 8), (0, 2))) and problem.src.spec is None
    plan = compile_fast(problem)
    again = type(plan).model_validate_json(plan.model_dump_json())
    assert again.problem.src.boxes == problem.src.boxes and again == plan
    assert "boxes" not in ReshardingProblem.model_validate(raw | {"src": {"mesh": MESH2, "spec": "S0 R"}}).model_dump_json()


def doc_box_toml() -> str:
    """The TOML example of format.md's "Box layouts" section."""
    text = FORMAT_DOC.read_text()
    block = text[text.index("### Box layouts"):]
    start = block.index("```toml") + len("```toml")
    return block[start:block.index("```", start)]


def test_the_format_doc_example_compiles_verifies_and_runs(tmp_path):
    problem = build_problem(tomllib.loads(doc_box_toml()))
    assert problem.blocks("dst")[problem.dst.mesh.devices[1]] == ((0, 3), (0, 4))
    for strategy in STRATEGIES:
        plan = compile_fast(problem, strategy=strategy)
        verify_plan(plan)
        simulate(plan, iterations=1)
    path = tmp_path / "boxes.toml"
    path.write_text(doc_box_toml())
    result = run_cli("compile", path, "-o", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    result = run_cli("verify", tmp_path / "plan.json")
    assert result.exit_code == 0 and "ok:" in result.output, result.output


def test_a_cli_problem_file_with_a_hole_in_its_source_boxes_is_one_user_error(tmp_path):
    path = tmp_path / "hole.toml"
    path.write_text(doc_box_toml().replace("[[7, 9], [0, 4]]]", "[[8, 9], [0, 4]]]", 1))
    assert_user_error(run_cli("compile", path), "src.boxes: no source device holds [7:8, 0:4]")


def box_transfer():
    """Two tensors of one transfer: one with boxes on both sides (a nested uneven split to replicated KV heads),
    one with specs, on overlapping meshes."""
    return build_transfer({
        "src_mesh": {"shape": [2, 2], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [3], "devices": [3, 4, 5]},
        "cluster": {"devices_per_host": 2},
        "rules": [{"match": "*", "src": "S0 R", "dst": "R S0"}],
        "tensors": [{"name": "kv", "shape": [9, 4], "dtype": "bfloat16",
                     "src_boxes": [[[0, 3], [0, 4]], [[3, 5], [0, 4]], [[5, 7], [0, 4]], [[7, 9], [0, 4]]],
                     "dst_boxes": [[[0, 5], [0, 4]], [[0, 5], [0, 4]], [[5, 9], [0, 4]]]},
                    {"name": "w", "shape": [6, 6]}]})


def test_a_multi_tensor_problem_with_boxes_plans_verifies_and_runs_bit_exact():
    problem = box_transfer()
    kv = problem.tensor_problem(0)
    assert kv.src.spec is None and kv.blocks("dst")[4] == ((0, 5), (0, 4)) and str(problem.tensor_problem(1).dst.spec) == "R S0"
    plan = compile_plan(problem, solver="greedy")
    verify_plan(plan)
    assert type(plan).model_validate_json(plan.model_dump_json()) == plan
    full = full_tensors(plan, seed=5)
    out = run_everywhere(plan, fake_executors(plan), full)
    assert_every_shard(plan, out, full)


def test_a_tensor_giving_a_spec_and_boxes_for_one_side_is_refused():
    with pytest.raises(InputError, match=r"tensors\[0\].src_boxes \(w\): give src or src_boxes, not both"):
        build_transfer({"src_mesh": "1x2", "dst_mesh": "1x1",
                        "tensors": [{"name": "w", "shape": [4], "src": "S0", "src_boxes": [[[0, 4]], [[0, 4]]], "dst": "R"}]})
    with pytest.raises(InputError, match=r"tensors\[0\] \(w\): src.boxes: no source device holds \[2:4\]"):
        build_transfer({"src_mesh": "1x2", "dst_mesh": "1x1",
                        "tensors": [{"name": "w", "shape": [4], "src_boxes": [[[0, 2]], [[0, 1]]], "dst": "R"}]})


def test_the_validated_box_lists_kept_for_reuse_are_bounded_by_their_boxes(monkeypatch):
    """`boxes._MADE` keeps the box lists it made so a list passed on is not walked again; it lets them all go before
    it would hold more than `_MADE_MOST_BOXES` boxes."""
    from pydantic import TypeAdapter

    from xmesh_plan.schemas import boxes

    monkeypatch.setattr(boxes, "_MADE_MOST_BOXES", 10)
    monkeypatch.setattr(boxes, "_MADE", {})
    monkeypatch.setattr(boxes, "_made_boxes", 0)
    adapter = TypeAdapter(boxes.Boxes)
    made = [adapter.validate_python([[[k, k + 1]]] * 4) for k in range(5)]
    assert made[-1] == (((4, 5),),) * 4 and adapter.validate_python(made[-1]) is made[-1]
    assert sum(map(len, boxes._MADE.values())) <= 10 and boxes._made_boxes <= 10


@pytest.mark.parametrize("bad", [[[0, 4.0], [0, 8]], [[0, True], [0, 8]], [[0, 4, 5], [0, 8]], [(0, 4), "ab"], 7])
def test_a_box_list_with_one_box_not_of_integer_pairs_is_refused_naming_that_box(bad):
    """`Boxes` takes a list of plain boxes at once (`boxes._plain_boxes`) only where every pair is two plain ints (not
    floats or bools): one box that is not sends the list to the box-by-box validation, whose error names it."""
    from pydantic import TypeAdapter

    from xmesh_plan.schemas.boxes import Boxes

    with pytest.raises(ValidationError, match=re.escape(f"{bad!r} is not a box")):
        TypeAdapter(Boxes).validate_python([[[0, 4], [0, 8]], bad, [[4, 8], [0, 8]]])


def test_a_box_list_mixing_pairs_and_offset_size_boxes_gives_each_box_as_pairs():
    from pydantic import TypeAdapter

    from xmesh_plan.schemas.boxes import Boxes

    boxes = TypeAdapter(Boxes).validate_python([[[0, 4], [0, 8]], {"offset": [4, 0], "size": [4, 8]}, ((0, 4), (0, 8))])
    assert boxes == (((0, 4), (0, 8)), ((4, 8), (0, 8)), ((0, 4), (0, 8)))
    assert all(type(pair) is tuple for box in boxes for pair in box)


def test_a_box_list_equal_by_value_to_one_taken_before_but_not_of_ints_is_still_refused():
    """A box list equal to one validated before gives that one's boxes (`boxes._LISTS`, a model's scale tensors repeat
    a few lists), but only where its values are plain ints as well: 4.0 and True equal 4 and 1, and are refused."""
    from pydantic import TypeAdapter

    from xmesh_plan.schemas.boxes import Boxes

    boxes = TypeAdapter(Boxes)
    first = boxes.validate_python([[[0, 4], [0, 1]], [[4, 8], [0, 1]]])
    assert boxes.validate_python([[[0, 4], [0, 1]], [[4, 8], [0, 1]]]) is first
    for bad in ([[[0, 4.0], [0, 1]], [[4, 8], [0, 1]]], [[[0, 4], [0, True]], [[4, 8], [0, 1]]]):
        with pytest.raises(ValidationError, match="is not a box"):
            boxes.validate_python(bad)
    assert boxes.validate_python([[[0, 4]], [[0, 1]], [[4, 8]], [[0, 1]]]) == (((0, 4),), ((0, 1),), ((4, 8),), ((0, 1),))


def test_the_kept_box_lists_stay_bounded_also_for_boxes_of_no_dims(monkeypatch):
    """`boxes._LISTS` is let go past `_LISTED_MOST` lists, boxes and ints together: lists of boxes of no dims hold no
    ints, so counting ints alone kept every one of them (a reader fed many such files grew without bound)."""
    from pydantic import TypeAdapter

    from xmesh_plan.schemas import boxes as box_module

    monkeypatch.setattr(box_module, "_LISTED_MOST", 1000)
    monkeypatch.setattr(box_module, "_LISTS", {})
    monkeypatch.setattr(box_module, "_listed_ints", 0)
    adapter = TypeAdapter(box_module.Boxes)
    for k in range(1, 200):
        assert adapter.validate_python([[]] * k) == ((),) * k
        held = sum(1 + len(boxes) for boxes in box_module._LISTS.values())
        assert held <= 1000
