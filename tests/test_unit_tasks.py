"""Unit-task decomposition: paper case counts, senders hold and receivers need each cell, exact tiling,
uneven and empty shards, and overlapping meshes (local copies instead of receiving)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xmesh_plan.planner.unit_tasks import cut_points, decompose
from xmesh_plan.schemas.geometry import intersect, region_size
from xmesh_plan.schemas.plan import format_region


def check_cells(problem, cells):
    """Every cell lies wholly inside or wholly outside each block; senders are exactly the source devices
    holding it; receivers + local copies exactly the destination devices needing it; cells tile the tensor."""
    src, dst = problem.blocks("src"), problem.blocks("dst")
    for cell in cells:
        assert region_size(cell.region) > 0, f"empty cell {cell}"
        for d, block in list(src.items()) + list(dst.items()):
            overlap = intersect(cell.region, block)
            assert overlap is None or overlap == cell.region, f"cell {cell} straddles block {block} of device {d}"
        holders = {d for d, b in src.items() if intersect(cell.region, b) == cell.region}
        needers = {d for d, b in dst.items() if intersect(cell.region, b) == cell.region}
        assert set(cell.senders) == holders, f"{cell}: senders {cell.senders} but holders {sorted(holders)}"
        assert set(cell.receivers) | set(cell.local_copies) == needers
        assert not set(cell.receivers) & set(cell.local_copies)
        assert set(cell.local_copies) == needers & holders, "a device holding what it needs copies locally"
        assert not set(cell.receivers) & holders, "a receiver must not already hold the cell"
        assert list(cell.senders) == sorted(cell.senders)
    count = np.zeros(problem.shape, dtype=np.int64)
    for cell in cells:
        count[tuple(slice(a, b) for a, b in cell.region)] += 1
    assert (count == 1).all(), "cells must tile the tensor exactly once"


@pytest.mark.parametrize("name, expected", [
    ("case1", 2), ("case2", 2), ("case3", 4), ("case4", 64), ("case5", 4),
    ("case6", 4), ("case7", 4), ("case8", 1), ("case9", 4), ("one_to_2x2", 1),
])
def test_paper_case_unit_task_counts(case, name, expected):
    problem = case(name)
    assert len(decompose(problem)) == expected
    assert len(decompose(problem, merge=False)) >= expected


@pytest.mark.parametrize("name", ["case1", "case2", "case3", "case5", "case6", "case7", "case9"])
def test_paper_case_cells_match_blocks(case, name):
    problem = case(name)
    # the checks are exact on a 1/64-scale tensor with the same cut structure (all dims divide by 8)
    small = problem.model_copy(update={"shape": tuple(n // 64 for n in problem.shape)})
    check_cells(small, decompose(small))


def test_case4_has_64_cells_each_from_one_device_to_one_device(case):
    cells = decompose(case("case4"))
    assert len(cells) == 64
    for cell in cells:
        # R S01 R -> S01 R R: each 128x128x512 cell is held by one source device, needed by one destination device
        assert region_size(cell.region) == 128 * 128 * 512
        assert len(cell.senders) == 1 and len(cell.receivers) == 1 and cell.local_copies == ()
    assert len({c.senders for c in cells}) == 8 and len({c.receivers for c in cells}) == 8


def test_case3_cells_come_from_the_host_holding_their_column_half(case):
    problem = case("case3")
    cells = decompose(problem)
    assert sorted(format_region(c.region) for c in cells) == [
        "[0:512, 0:512, 0:512]", "[0:512, 512:1024, 0:512]", "[512:1024, 0:512, 0:512]", "[512:1024, 512:1024, 0:512]"]
    hosts = problem.cluster.host_of
    for cell in cells:
        # R S0 R on 2x4: mesh axis 0 (hosts) splits dim 1, so a column half lives on the 4 devices of one host
        assert {hosts(d) for d in cell.senders} == {0 if cell.region[1] == (0, 512) else 1}
        assert len(cell.senders) == 4
        # S0 R R: a row half goes to the 4 devices of one destination host
        assert {hosts(d) for d in cell.receivers} == {2 if cell.region[0] == (0, 512) else 3}
        assert len(cell.receivers) == 4


def test_case6_uneven_padding_342_342_340(case):
    problem = case("case6")
    assert [b[0] for b in problem.blocks("dst").values()][::4] == [(0, 342), (342, 684), (684, 1024)]
    cells = decompose(problem)
    assert [c.region[0] for c in cells] == [(0, 342), (342, 512), (512, 684), (684, 1024)]
    hosts = problem.cluster.host_of
    assert [({hosts(d) for d in c.senders}, {hosts(d) for d in c.receivers}) for c in cells] == [
        ({0}, {2}), ({0}, {3}), ({1}, {3}), ({1}, {4})]
    assert sum(c.nbytes(problem.itemsize) for c in cells) == problem.nbytes
    small = problem.model_copy(update={"shape": (1024, 2, 2)})
    check_cells(small, decompose(small))


def test_empty_destination_shards_receive_nothing(problem):
    # dim 0 has 3 elements split 4 ways on the destination: the fourth device's shard is empty
    p = problem((3, 5), "1x2", "S1 R", "1x4", "S1 R")
    empty = [d for d, b in p.blocks("dst").items() if region_size(b) == 0]
    assert len(empty) == 1
    cells = decompose(p)
    check_cells(p, cells)
    assert all(empty[0] not in c.receivers + c.local_copies for c in cells)


def test_empty_source_shards_send_nothing(problem):
    p = problem((2, 3), "1x4", "S1 R", "1x1", "R R")
    empty = [d for d, b in p.blocks("src").items() if region_size(b) == 0]
    assert len(empty) == 2  # 2 elements over 4 devices
    cells = decompose(p)
    check_cells(p, cells)
    assert all(not set(empty) & set(c.senders) for c in cells)


def test_zero_length_dim_has_no_cells(problem):
    assert decompose(problem((0, 8), "2x2", "S0 R", "2x2", "R S1")) == []


def test_cut_points_are_the_union_of_both_sides(problem):
    p = problem((10, 6), "1x4", "S1 R", "1x3", "R S1")
    assert cut_points(p) == [[0, 3, 6, 9, 10], [0, 2, 4, 6]]


def test_cells_are_in_row_major_order(case):
    cells = decompose(case("case4"))
    starts = [tuple(a for a, _ in c.region) for c in cells]
    assert starts == sorted(starts)


def test_overlapping_meshes_local_copy_instead_of_receive(problem):
    # source: devices 0,1 split dim 0; destination: devices 0 and 2 both want everything.
    p = problem((4,), {"shape": [2], "devices": [0, 1]}, "S0", {"shape": [2], "devices": [0, 2]}, "R")
    cells = {format_region(c.region): c for c in decompose(p)}
    assert set(cells) == {"[0:2]", "[2:4]"}
    assert cells["[0:2]"].local_copies == (0,) and cells["[0:2]"].receivers == (2,)
    assert cells["[2:4]"].local_copies == () and cells["[2:4]"].receivers == (0, 2)
    check_cells(p, list(cells.values()))


def test_identical_meshes_and_specs_are_all_local_copies(problem):
    mesh = {"shape": [2, 2], "first_host": 0}
    p = problem((4, 4), mesh, "S0 S1", mesh, "S0 S1")
    cells = decompose(p)
    check_cells(p, cells)
    assert len(cells) == 4
    assert all(c.receivers == () and len(c.local_copies) == 1 and c.senders == c.local_copies for c in cells)


def test_merge_does_not_change_what_moves(case, problem):
    for p in (case("case9").model_copy(update={"shape": (16, 16, 16)}), problem((10, 7), "1x4", "S1 R", "1x3", "S1 S0")):
        merged, split = decompose(p), decompose(p, merge=False)
        check_cells(p, merged)
        check_cells(p, split)
        assert sum(c.merged_cells for c in merged) == len(split)


def test_cell_nbytes_and_str():
    from xmesh_plan.planner.unit_tasks import Cell
    cell = Cell(region=((0, 2), (4, 8)), senders=(0, 1), receivers=(8,), local_copies=())
    assert cell.nbytes(4) == 2 * 4 * 4
    assert str(cell) == "[0:2, 4:8] from [0, 1] to [8]"


# --- property: decomposition is exact on random small problems --------------------------------------

@st.composite
def small_problems(draw):
    from xmesh_plan.planner.problem_io import build_problem
    rank = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 9)) for _ in range(rank)]

    def side():
        mesh = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
        owner = [draw(st.integers(-1, rank - 1)) for _ in mesh]
        spec = " ".join("S" + "".join(str(a) for a, o in enumerate(owner) if o == d) if d in owner else "R" for d in range(rank))
        return mesh, spec

    (src_mesh, src_spec), (dst_mesh, dst_spec) = side(), side()
    dst = {"shape": dst_mesh}
    if draw(st.booleans()):  # overlap: destination drawn from the same device ids
        pool = range(math.prod(src_mesh) + math.prod(dst_mesh))
        dst["devices"] = draw(st.permutations(list(pool)))[: math.prod(dst_mesh)]
    widest = max([m[1] for m in (src_mesh, dst_mesh) if len(m) == 2], default=1)  # (A, B): hosts of >= B devices
    per_host = draw(st.sampled_from([n for n in (1, 2, 4) if n >= widest]))
    return build_problem({"shape": shape, "dtype": "int8", "cluster": {"devices_per_host": per_host},
                          "src": {"mesh": {"shape": src_mesh}, "spec": src_spec}, "dst": {"mesh": dst, "spec": dst_spec}})


@settings(max_examples=120, deadline=None)
@given(small_problems(), st.booleans())
def test_decomposition_is_exact_on_random_problems(p, merge):
    cells = decompose(p, merge=merge)
    if math.prod(p.shape) == 0:
        assert cells == []
    else:
        check_cells(p, cells)
        assert sum(c.nbytes(p.itemsize) for c in cells) == p.nbytes
    assert all(math.prod(b - a for a, b in c.region) > 0 for c in cells)
