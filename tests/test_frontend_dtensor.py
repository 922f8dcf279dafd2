"""The DTensor front end against DTensor itself: every rank's box equals `compute_local_shape_and_global_offset`.

Meshes are built under torch's fake process group (any world size in one process). DTensor's public
function answers for the calling rank only; the random cases ask the function it delegates to
(`_compute_local_shape_and_global_offset`) with each rank's mesh coordinate, and a separate test
shows the two agree by asking the public one on a view of the mesh as each rank (`_rank`).
"""

from __future__ import annotations

import random
from itertools import product

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset, compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.support.builders import compile_fast
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas import Layout, ShardingSpec
from xmesh_plan.schemas.spec import DimSharding
from xmesh_plan import FrontendError, problem_from_dtensor

WORLD = 64
CASES = 300


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    """A fake process group of WORLD ranks (this process is rank 0), torn down after the module."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def box(local, offset) -> tuple | None:
    return None if 0 in local else tuple((o, o + n) for o, n in zip(offset, local))


def coordinates(mesh: DeviceMesh) -> dict[int, list[int]]:
    """Rank -> its coordinate in the mesh, read off the rank tensor."""
    ranks = mesh.mesh.tolist()  # DeviceMesh.mesh is rebuilt on every access: read it once
    return {int(_at(ranks, coord)): list(coord) for coord in product(*(range(n) for n in mesh.shape))}


def _at(nested: list, coord: tuple[int, ...]):
    for index in coord:
        nested = nested[index]
    return nested


def dtensor_boxes(shape, mesh: DeviceMesh, placements) -> dict[int, tuple | None]:
    """Rank -> the box DTensor gives that rank (None when empty), from DTensor's own shape and offset."""
    return {rank: box(*_compute_local_shape_and_global_offset(shape, tuple(mesh.shape), coord, placements))
            for rank, coord in coordinates(mesh).items()}


def dtensor_boxes_per_rank(shape, mesh: DeviceMesh, placements) -> dict[int, tuple | None]:
    """The same through DTensor's public function, asked on a view of the mesh as each rank in turn."""
    out = {}
    for rank in mesh.mesh.flatten().tolist():
        view = DeviceMesh(mesh.device_type, mesh.mesh, _init_backend=False, _rank=rank)
        out[rank] = box(*compute_local_shape_and_global_offset(shape, view, placements))
    return out


def our_boxes(problem, side: str) -> dict[int, tuple | None]:
    return {d: None if any(hi <= lo for lo, hi in box) else box for d, box in problem.blocks(side).items()}


def gspmd_boxes(shape, mesh: DeviceMesh, placements) -> dict[int, tuple | None]:
    """What our ceil-split layout would give for these placements (earlier mesh dim major), without the front end."""
    axes = [tuple(m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d) for d in range(len(shape))]
    layout = Layout(tuple(shape), tuple(mesh.shape), ShardingSpec(tuple(DimSharding(a) for a in axes)))
    boxes = {rank: layout.block(tuple(coord)) for rank, coord in coordinates(mesh).items()}
    return {r: None if any(hi <= lo for lo, hi in b) else b for r, b in boxes.items()}


def random_side(rng: random.Random, ndim: int, strided: bool = False):
    """A random mesh of 1-3 dims over distinct random ranks, and random Shard/Replicate placements (and, when
    `strided`, strided shards of random split factors)."""
    mesh_shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
    size = 1
    for s in mesh_shape:
        size *= s
    ranks = torch.tensor(rng.sample(range(WORLD), size)).reshape(mesh_shape)

    def placement():
        if rng.random() < 0.3:
            return Replicate()
        if strided and rng.random() < 0.4:
            return _StridedShard(rng.randrange(ndim), split_factor=rng.randint(1, 4))
        return Shard(rng.randrange(ndim))
    return DeviceMesh("cpu", ranks, _init_backend=False), [placement() for _ in mesh_shape]


def random_case(rng: random.Random, strided: bool = False):
    shape = tuple(rng.randint(0, 13) for _ in range(rng.randint(1, 3)))
    return shape, random_side(rng, len(shape), strided), random_side(rng, len(shape), strided)


def torch_local(shape, mesh: DeviceMesh, placements, coord) -> torch.Tensor:
    """The local tensor DTensor's own splitting (`_split_tensor`, as `distribute_tensor` does) gives the rank at
    `coord` of a tensor holding each element's flat index."""
    local = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            local = placement._split_tensor(local, mesh.shape[mesh_dim], with_padding=False)[0][coord[mesh_dim]]
    return local


def holds_its_box(problem, side: str, shape, mesh: DeviceMesh, placements) -> bool:
    """Every rank's box cut out of the flat-index tensor equals what DTensor's splitting gives that rank."""
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    boxes = problem.blocks(side)
    return all(_same_elements(full[tuple(slice(a, b) for a, b in boxes[rank])], torch_local(shape, mesh, placements, coord))
               for rank, coord in coordinates(mesh).items())


def _same_elements(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal tensors, or both empty (an empty shard's other dims are whatever the split left)."""
    return (ours.numel() == theirs.numel() == 0) or torch.equal(ours, theirs)


def test_every_box_matches_dtensor_for_random_layouts():
    """Every layout is accepted (as a spec, or as boxes where the spec cannot say it) and every rank's box is
    DTensor's, strided shards included; only a strided shard that interleaves a rank's indices is refused."""
    rng = random.Random(20261010)
    as_spec = as_boxes = refused = 0
    for case in range(CASES):
        shape, (src_mesh, src_pl), (dst_mesh, dst_pl) = random_case(rng, strided=case % 2 == 1)
        where = f"case {case}: shape {shape}, src {tuple(src_mesh.shape)} {src_pl}, dst {tuple(dst_mesh.shape)} {dst_pl}"
        try:
            problem = problem_from_dtensor(shape, torch.float32, src_mesh, src_pl, dst_mesh, dst_pl)
        except FrontendError as err:
            assert "not one contiguous range" in str(err), where
            sides = ((src_mesh, src_pl), (dst_mesh, dst_pl))
            assert any(not _contiguous(shape, m, p) for m, p in sides), f"{where}: refused ({err}) though every rank holds a box"
            refused += 1
            continue
        for side, mesh, placements in (("src", src_mesh, src_pl), ("dst", dst_mesh, dst_pl)):
            assert our_boxes(problem, side) == dtensor_boxes(shape, mesh, placements), f"{where}: {side}"
            assert holds_its_box(problem, side, shape, mesh, placements), f"{where}: {side}"
            if getattr(problem, side).boxes is None:
                assert gspmd_boxes(shape, mesh, placements) == dtensor_boxes(shape, mesh, placements), where
                as_spec += 1
            else:
                as_boxes += 1
    assert as_spec >= CASES // 2 and as_boxes >= 60 and refused >= 20, (as_spec, as_boxes, refused)


def _contiguous(shape, mesh: DeviceMesh, placements) -> bool:
    """Whether every rank's DTensor shard is the box DTensor's shape and offset name (its elements, in order)."""
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    for rank, coord in coordinates(mesh).items():
        local_shape, offset = _compute_local_shape_and_global_offset(shape, tuple(mesh.shape), coord, placements)
        if not _same_elements(full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))],
                              torch_local(shape, mesh, placements, coord)):
            return False
    return True


def test_public_per_rank_answer_equals_the_coordinate_one():
    rng = random.Random(7)
    for _ in range(20):
        shape, (mesh, placements), _ = random_case(rng)
        assert dtensor_boxes_per_rank(shape, mesh, placements) == dtensor_boxes(shape, mesh, placements)


def test_earlier_mesh_dim_is_the_major_split():
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    problem = problem_from_dtensor((8,), "float32", mesh, [Shard(0), Shard(0)], mesh, [Replicate(), Replicate()])
    assert str(problem.src.spec) == "S01"
    assert problem.blocks("src")[1] == ((2, 4),) == dtensor_boxes((8,), mesh, [Shard(0), Shard(0)])[1]


def test_submesh_of_init_device_mesh_uses_global_ranks():
    mesh = init_device_mesh("cpu", (4, 4), mesh_dim_names=("dp", "tp"))
    problem = problem_from_dtensor((4, 8), torch.bfloat16, mesh["tp"], [Shard(1)], mesh, [Shard(0), Replicate()])
    assert problem.src.mesh.devices == (0, 1, 2, 3) and problem.dst.mesh.devices == tuple(range(16))
    assert problem.dtype == "bfloat16"


def test_plain_rank_lists_plan_without_a_process_group_and_the_plan_verifies():
    problem = problem_from_dtensor((6, 4), "float8_e4m3fn", [[0, 1], [2, 3]], [Shard(0), Shard(1)],
                                   [4, 5, 6], [Shard(-1)])
    assert (str(problem.src.spec), str(problem.dst.spec), problem.dst.mesh.devices) == ("S0 S1", "R S0", (4, 5, 6))
    verify_plan(compile_fast(problem))


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float8_e4m3fn, "float8_e4m3fn"),
                                         (torch.float8_e5m2, "float8_e5m2"), (torch.half, "float16"),
                                         (torch.int64, "int64"), (torch.bool, "bool"), (torch.complex64, "complex64"),
                                         (torch.uint16, "uint16"), ("bf16", "bfloat16")])
def test_dtypes_map_to_our_names(dtype, name):
    assert problem_from_dtensor((4,), dtype, [0, 1], [Shard(0)], [2], [Replicate()]).dtype == name


def test_partial_and_interleaved_strided_sources_are_refused_with_the_fix():
    with pytest.raises(FrontendError, match=r"src_placements\[1\]: .*partial values.*redistribute it on the source mesh first"):
        problem_from_dtensor((8, 8), "float32", [[0, 1], [2, 3]], [Shard(0), Partial()], [4], [Replicate()])
    # S(0) then SS(0, 2): rank (0, 0) holds rows 0 and 2 of the tensor, not one box
    with pytest.raises(FrontendError, match=r"src_placements: DTensor gives rank 0 the indices 0:1, 2:3 of tensor dim 0, "
                                            r"not one contiguous range; .*redistribute it on the source mesh first"):
        problem_from_dtensor((8, 8), "float32", [[0, 1], [2, 3]], [Shard(0), _StridedShard(0, split_factor=2)], [4], [Replicate()])


def test_fsdp_over_tp_strided_shards_become_boxes_and_the_plan_verifies():
    """FSDP2 over TP: on the (dp, tp) mesh the weight is [_StridedShard(0, tp), Shard(0)]; rank (i, j) holds FSDP
    piece i of TP shard j, one box, which no spec says (the TP split is the major one). Moved to a TP=2 mesh."""
    dp, tp = 2, 2
    placements = [_StridedShard(0, split_factor=tp), Shard(0)]
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(dp, tp), _init_backend=False)
    problem = problem_from_dtensor((8, 4), "bfloat16", mesh, placements, [4, 5], [Shard(0)])
    assert problem.src.spec is None and problem.src.boxes == (((0, 2), (0, 4)), ((4, 6), (0, 4)), ((2, 4), (0, 4)), ((6, 8), (0, 4)))
    assert our_boxes(problem, "src") == dtensor_boxes((8, 4), mesh, placements)
    assert str(problem.dst.spec) == "S0 R"
    verify_plan(compile_fast(problem))


def test_nested_uneven_split_becomes_boxes_and_the_plan_verifies():
    """Length 9 over a 2x2 mesh as [Shard(0), Shard(0)]: DTensor's sizes 3,2,2,2 differ from a ceil split's 3,3,3,0."""
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), _init_backend=False)
    problem = problem_from_dtensor((9, 2), "float32", mesh, [Shard(0), Shard(0)], [4, 5, 6], [Shard(0)])
    assert problem.src.boxes == (((0, 3), (0, 2)), ((3, 5), (0, 2)), ((5, 7), (0, 2)), ((7, 9), (0, 2)))
    assert our_boxes(problem, "src") == dtensor_boxes((9, 2), mesh, [Shard(0), Shard(0)])
    for strategy in ("broadcast", "send_recv", "local_allgather", "global_allgather"):
        verify_plan(compile_fast(problem, strategy=strategy))


@pytest.mark.parametrize("args, message", [
    (dict(dtype=torch.float8_e8m0fnu), "dtype: torch.float8_e8m0fnu has no xmesh-plan equivalent"),
    (dict(dst_placements=[Shard(2)]), r"dst_placements\[0\]: S\(2\) names tensor dim 2 but the tensor has 2 dims"),
    (dict(dst_placements=[Shard(0), Shard(1)]), "dst_placements: 2 placements for a 1-d mesh; give one per mesh dim"),
    (dict(dst_placements=["S(0)"]), r"dst_placements\[0\]: 'S\(0\)' is not a placement"),
    (dict(dst_mesh="gpu"), "dst_mesh: 'gpu' is not a DeviceMesh or a nested list of integer global ranks"),
    (dict(dst_mesh=torch.ones(4, 4)), "dst_mesh: a Tensor is not a DeviceMesh"),
    (dict(dst_mesh=[1, 1]), "dst_mesh: mesh 2 device ids must be distinct"),
    (dict(shape=(8, -1)), "shape: .* no negative lengths"),
    (dict(shape=(8.5, 8)), r"shape: \(8.5, 8\) is not a sequence of integers"),  # not planned as (8, 8)
    (dict(shape=(8.0, 8)), r"shape: \(8.0, 8\) is not a sequence of integers"),
    (dict(shape=(True, 8)), r"shape: \(True, 8\) is not a sequence of integers"),  # not planned as (1, 8)
    (dict(dtype=None), "dtype: None is not a dtype"),  # not planned as float64
    (dict(dst_placements=Shard(0)), r"dst_placements: Shard\(dim=0\) is not a list of placements; .* e.g. \[Shard\(dim=0\)\]"),
    (dict(src_placements=Replicate()), r"src_placements: Replicate\(\) is not a list of placements"),
])
def test_bad_input_gets_one_line_naming_the_argument(args, message):
    kwargs = dict(shape=(8, 8), dtype="float32", src_mesh=[[0, 1], [2, 3]], src_placements=[Shard(0), Replicate()],
                  dst_mesh=[4], dst_placements=[Replicate()]) | args
    with pytest.raises(FrontendError, match=message) as info:
        problem_from_dtensor(**kwargs)
    assert "\n" not in str(info.value)
