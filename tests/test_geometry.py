"""Geometry: GSPMD ceil-division shards (even, uneven, empty), boxes, intersections, local indexing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xmesh_plan.schemas.geometry import (Layout, intersect, local_slices, region_shape, region_size, shard_boundaries,
                              shard_interval, split_region)
from xmesh_plan.schemas.spec import ShardingSpec


@pytest.mark.parametrize("length, shards, expected", [
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),        # even
    (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),      # uneven: last shard short
    (3, 4, [(0, 1), (1, 2), (2, 3), (3, 3)]),        # fewer elements than shards: last empty
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),        # ceil chunk 2 leaves the last shard empty
    (1, 3, [(0, 1), (1, 1), (1, 1)]),
    (0, 4, [(0, 0)] * 4),                            # zero-length dim: all empty
    (1024, 3, [(0, 342), (342, 684), (684, 1024)]),  # the paper's case 6 padding
    (7, 1, [(0, 7)]),
])
def test_shard_interval(length, shards, expected):
    assert [shard_interval(length, shards, k) for k in range(shards)] == expected


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(1, 40))
def test_shards_tile_the_dim_exactly(length, shards):
    intervals = [shard_interval(length, shards, k) for k in range(shards)]
    assert intervals[0][0] == 0 and intervals[-1][1] == length
    for (a0, a1), (b0, b1) in zip(intervals, intervals[1:]):
        assert a1 == b0  # contiguous, no gap, no overlap
    assert all(0 <= a <= b <= length for a, b in intervals)
    chunk = math.ceil(length / shards) if length else 0
    assert all(b - a <= chunk for a, b in intervals)
    assert sum(b - a for a, b in intervals) == length
    # only trailing shards can be short
    sizes = [b - a for a, b in intervals]
    assert sizes == sorted(sizes, reverse=True)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(1, 40))
def test_shard_boundaries_are_the_distinct_cut_points(length, shards):
    cuts = shard_boundaries(length, shards)
    expected = sorted({a for k in range(shards) for a in shard_interval(length, shards, k)})
    assert cuts == expected
    assert cuts[0] == 0 and cuts[-1] == length


def test_region_shape_and_size():
    box = ((0, 512), (256, 1024), (3, 3))
    assert region_shape(box) == (512, 768, 0)
    assert region_size(box) == 0
    assert region_size(((1, 3), (2, 5))) == 6


@pytest.mark.parametrize("a, b, expected", [
    (((0, 4), (0, 4)), ((2, 6), (1, 3)), ((2, 4), (1, 3))),
    (((0, 4), (0, 4)), ((0, 4), (0, 4)), ((0, 4), (0, 4))),
    (((0, 4), (0, 4)), ((4, 8), (0, 4)), None),            # touching is empty
    (((0, 4), (0, 4)), ((1, 2), (5, 6)), None),            # disjoint along one dim
    (((0, 4),), ((2, 2),), None),                           # empty box
])
def test_intersect(a, b, expected):
    assert intersect(a, b) == expected
    assert intersect(b, a) == expected


@pytest.mark.parametrize("region, parts", [
    (((0, 10), (0, 4)), 4),
    (((0, 3), (0, 3)), 4),       # fewer rows than parts: empty pieces dropped
    (((5, 6), (2, 9)), 3),       # longest dim is the second one
    (((0, 8), (0, 8)), 1),
    (((2, 9), (0, 1), (4, 5)), 7),
])
def test_split_region_pieces_tile_the_box_along_its_longest_dim(region, parts):
    pieces = split_region(region, parts)
    assert 1 <= len(pieces) <= parts
    assert all(region_size(p) > 0 for p in pieces)
    assert sum(region_size(p) for p in pieces) == region_size(region)
    for p, q in itertools.combinations(pieces, 2):
        assert intersect(p, q) is None
    shape = region_shape(region)
    longest = max(range(len(shape)), key=lambda d: (shape[d], -d))
    for p in pieces:
        assert all(p[d] == region[d] for d in range(len(region)) if d != longest)


def test_split_region_of_three_rows_in_four():
    assert split_region(((0, 3), (0, 2)), 4) == [((0, 1), (0, 2)), ((1, 2), (0, 2)), ((2, 3), (0, 2))]


def test_local_slices_index_a_region_inside_its_block():
    block = ((512, 1024), (0, 1024))
    region = ((600, 700), (10, 20))
    buffer = np.arange(512 * 1024).reshape(512, 1024)
    full = np.zeros((1024, 1024), dtype=buffer.dtype)
    full[512:1024, :] = buffer
    assert local_slices(region, block) == (slice(88, 188), slice(10, 20))
    np.testing.assert_array_equal(buffer[local_slices(region, block)], full[600:700, 10:20])


def test_layout_blocks_for_r_s01_r_on_2x4():
    layout = Layout((1024, 1024, 512), (2, 4), ShardingSpec.parse("R S01 R"))
    # device (i, j) holds shard i*4+j of dim 1: 128 columns each
    assert layout.shard_index((1, 2)) == (0, 6, 0)
    assert layout.block((1, 2)) == ((0, 1024), (768, 896), (0, 512))
    assert layout.block((0, 0)) == ((0, 1024), (0, 128), (0, 512))


def test_layout_major_axis_order_matters():
    s01 = Layout((8,), (2, 4), ShardingSpec.parse("S01"))
    s10 = Layout((8,), (2, 4), ShardingSpec.parse("S10"))
    assert s01.block((1, 0)) == ((4, 5),)
    assert s10.block((1, 0)) == ((1, 2),)


def test_layout_uneven_and_empty_blocks():
    layout = Layout((3, 5), (4, 1), ShardingSpec.parse("S0 R"))
    assert [layout.block((i, 0)) for i in range(4)] == [((0, 1), (0, 5)), ((1, 2), (0, 5)), ((2, 3), (0, 5)), ((3, 3), (0, 5))]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=3), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_layout_blocks_cover_the_tensor_replication_times(shape, mesh, data):
    """Every element is held by exactly prod(mesh) / prod(shard counts) devices."""
    rank = len(shape)
    owner = [data.draw(st.integers(-1, rank - 1)) for _ in mesh]
    text = " ".join("S" + "".join(str(a) for a, o in enumerate(owner) if o == d) if d in owner else "R" for d in range(rank))
    spec = ShardingSpec.parse(text)
    layout = Layout(tuple(shape), tuple(mesh), spec)
    count = np.zeros(shape, dtype=int)
    for coord in itertools.product(*(range(m) for m in mesh)):
        count[tuple(slice(a, b) for a, b in layout.block(coord))] += 1
    replicas = math.prod(mesh) // math.prod(spec.shard_counts(tuple(mesh)))
    assert (count == replicas).all()


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 100), st.integers(1, 12), st.lists(st.integers(0, 120), min_size=1, max_size=10))
def test_shard_of_points_agrees_with_shard_interval(length, shards, points):
    layout = Layout((length,), (shards,), ShardingSpec.parse("S0"))
    points = [p for p in points if p < length]
    got = layout.shard_of_points(0, np.array(points, dtype=np.int64))
    for p, k in zip(points, got):
        lo, hi = shard_interval(length, shards, int(k))
        assert lo <= p < hi
