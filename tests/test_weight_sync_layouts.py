"""What every rank of a weight sync checks from every rank's row (`xmesh_plan.weight_sync_layouts.agree`), the engine
rules' specs, and `transfer_group`'s arguments: in one process, no process group."""

from __future__ import annotations

import copy

import pytest

from xmesh_plan.engine_layouts import COLUMN, EXPERT, REPLICATED, ROW, VOCAB, layout_spec
from xmesh_plan.sides import FrontendError
from xmesh_plan.weight_sync_layouts import WeightSyncError, agree, describe

TRAINER = {"mesh": [[2], [0, 1]], "tensors": [["w", [5, 4], "float32", "S0 R", [3, 4]], ["n", [4], "float32", "S0", [2]]]}


def engine(rank: int, w_local=(5, 2)) -> dict:
    return {"mesh": [[1, 2], [2, 3]], "tensors": [["w", "w", "R S1", "float32", list(w_local)], ["n", "n", "R", "float32", [4]]]}


def rows() -> list[dict]:
    trainer = copy.deepcopy(TRAINER)
    second = copy.deepcopy(TRAINER)
    second["tensors"][0][-1], second["tensors"][1][-1] = [2, 4], [2]
    return [{"rank": 0, "src": trainer}, {"rank": 1, "src": second}, {"rank": 2, "dst": engine(2)}, {"rank": 3, "dst": engine(3)}]


def test_rows_that_fit_make_one_problem_of_transfer_ranks():
    problem, sources = agree(rows(), 4)
    assert [(t.name, t.shape, str(t.src), str(t.dst)) for t in problem.tensors] == [("w", (5, 4), "S0 R", "R S1"),
                                                                                   ("n", (4,), "S0", "R")]
    assert problem.src_mesh.devices == (0, 1) and problem.dst_mesh.devices == (2, 3) and sources == {"w": "w", "n": "n"}


def broken(change) -> list[dict]:
    data = rows()
    change(data)
    return data


@pytest.mark.parametrize("change, message", [
    (lambda r: r[3].update(error="inference['w']: bad"), "rank 3: inference['w']: bad"),
    (lambda r: r[1]["src"]["tensors"][0].__setitem__(2, "bfloat16"),
     "trainer tensor 'w': rank 1 has dtype bfloat16 but rank 0 has float32; give it the same dtype on every rank"),
    (lambda r: r[3]["dst"]["tensors"].pop(), "inference tensor 'n' is not passed on rank 3 (its other ranks pass it)"),
    (lambda r: r[2]["dst"]["tensors"][0].__setitem__(1, "v"), "inference tensor 'w': rank 3 has source 'w' but rank 2 has 'v'"),
    (lambda r: [row["dst"]["tensors"][0].__setitem__(1, "v") for row in r[2:]],
     "inference tensor 'w' takes trainer tensor 'v', which no trainer rank passes (the trainer passes w, n)"),
    (lambda r: r[3]["dst"]["tensors"][0].__setitem__(4, [5, 4]),
     "inference tensor 'w' on rank 3 has shape (5, 4) but R S1 of the global (5, 4) gives that rank (5, 2)"),
    (lambda r: r[0]["src"]["tensors"][0].__setitem__(4, [2, 4]),
     "trainer tensor 'w' on rank 0 has shape (2, 4) but S0 R of the global (5, 4) gives that rank (3, 4)"),
    (lambda r: r[3].pop("dst"), "rank 3 is in the inference mesh but passes no inference tensors"),
    (lambda r: r[3].update(src=copy.deepcopy(r[1]["src"])), "rank 3 passes trainer tensors but is not in the trainer mesh (0,1)"),
    (lambda r: r[3]["dst"].update(mesh=[[2], [3, 2]]), "rank 3 puts its inference tensors on mesh 2 of ranks 3,2 but rank 2 on"),
    (lambda r: [row.pop("dst") for row in r[2:]], "no rank passes inference tensors"),
    (lambda r: [row["dst"]["tensors"][0].__setitem__(3, "float16") for row in r[2:]],
     "inference tensor 'w' on ranks 2,3 is float16 but the trainer's 'w' is float32; give the destination the trainer's dtype"),
])
def test_rows_that_do_not_fit_raise_one_line_naming_the_tensor_rank_and_cause(change, message):
    with pytest.raises(WeightSyncError) as err:
        agree(broken(change), 4)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_rank_of_the_transfer_group_must_be_in_a_mesh():
    with pytest.raises(WeightSyncError, match="rank 4 of the transfer group is in neither mesh"):
        agree(rows(), 5)


def test_different_clusters_on_two_ranks_are_refused():
    data = rows()
    data[0]["cluster"], data[1]["cluster"] = {"devices_per_host": 4}, {"devices_per_host": 8}
    with pytest.raises(WeightSyncError, match="different clusters"):
        agree(data, 4)


@pytest.mark.parametrize("layout, ndim, mesh_ndim, spec", [
    (COLUMN, 2, 2, "S1 R"), (COLUMN, 1, 1, "S0"), (ROW, 2, 2, "R S1"), (VOCAB, 2, 2, "S1 R"), (REPLICATED, 3, 2, "R R R"),
    (EXPERT, 3, 2, "S1 R R"), ("R  S1", 2, 2, "R S1"),
])
def test_engine_rules_are_specs_with_the_tp_ranks_the_last_mesh_axis(layout, ndim, mesh_ndim, spec):
    assert layout_spec(layout, ndim, mesh_ndim, "w") == spec


@pytest.mark.parametrize("layout, ndim, message", [
    (ROW, 1, "inference['w']: ROW lays out tensors of 2 dims, not 1"),
    ("S0 R", 3, "inference['w']: layout 'S0 R' has 2 entries for a tensor of 3 dims"),
    ("Q", 1, "inference['w']: layout 'Q' is not a spec"),
    (3, 1, "inference['w']: layout is a int; use one of COLUMN, ROW, VOCAB, REPLICATED, EXPERT"),
])
def test_a_rule_that_cannot_lay_out_the_tensor_is_refused(layout, ndim, message):
    with pytest.raises(FrontendError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layout_spec(layout, ndim, 2, "w")


def test_a_rank_that_cannot_describe_its_tensors_sends_its_error_in_its_row():
    import torch

    from xmesh_plan.schemas import Cluster

    row = describe(3, {"w": torch.zeros(2)}, None, None, {}, Cluster())
    assert row == {"rank": 3, "error": "trainer['w'] is a Tensor, not a DTensor; pass the trainer's state_dict() (FSDP2 or TP "
                                       "parameters are DTensors) or make one with distribute_tensor"}
    row = describe(3, None, {"w": (torch.zeros(2), COLUMN)}, None, {}, Cluster())
    assert row["error"].startswith("inference_mesh: missing")
    row = describe(3, None, {"w": (torch.zeros(2), COLUMN)}, [[4, 5]], {4: 0}, Cluster())
    assert row["error"].startswith("inference_mesh: rank 5 of the mesh has no rank in the transfer group; add it to ranks=")
    row = describe(3, None, {"w": (torch.zeros(2), COLUMN)}, [[4, 5]], None, Cluster())  # a transfer_group without ranks=
    assert row["error"].startswith("ranks: missing; a group made by transfer_group needs ranks= on every process")


@pytest.mark.parametrize("args, message", [
    (("", 1, 0, 2), "host=''"), (("h", 1, 2, 2), "rank=2 with world_size=2"), (("h", 0, 0, 2), "port=0"),
    (("h", 1, 0, 2.5), "world_size=2.5 is not a whole number"),
])
def test_transfer_group_refuses_bad_arguments_in_one_line(args, message):
    from xmesh_plan.transfer_group import transfer_group

    with pytest.raises(FrontendError, match=message.replace("(", r"\(")):
        transfer_group(*args)


def test_a_source_laid_out_by_boxes_plans_with_them():
    """DTensor's [Shard(0), Shard(0)] of 9 rows on 2x2 holds 3,2,2,2 rows, which no spec says: the row lists boxes."""
    boxes = [[[0, 3]], [[3, 5]], [[5, 7]], [[7, 9]]]
    data = [{"rank": r, "src": {"mesh": [[2, 2], [0, 1, 2, 3]], "tensors": [["v", [9], "float32", boxes, [b[0][1] - b[0][0]]]]}}
            for r, b in enumerate(boxes)]
    data.append({"rank": 4, "dst": {"mesh": [[1], [4]], "tensors": [["v", "v", "R", "float32", [9]]]}})
    problem, _ = agree(data, 5)
    assert problem.tensors[0].src is None and problem.tensor_problem(0).blocks("src")[1] == ((3, 5),)
    data[1]["src"]["tensors"][0][4] = [3]
    with pytest.raises(WeightSyncError, match=r"trainer tensor 'v' on rank 1 has shape \(3,\) but its boxes of the global \(9,\) gives"):
        agree(data, 5)


def fused_rows(k_rows: int = 4) -> list[dict]:
    trainer = {"mesh": [[2], [0, 1]], "tensors": [["q", [12, 12], "float32", "S0 R", [6, 12]],
                                                  ["k", [k_rows, 12], "float32", "S0 R", [(k_rows + 1) // 2, 12]]]}
    second = copy.deepcopy(trainer)
    second["tensors"][1][-1] = [k_rows // 2, 12]
    engine = {"mesh": [[1, 2], [2, 3]], "tensors": [["qk", {"parts": ["q", "k"], "dim": 0}, "S1 R", "float32", [6 + k_rows // 2, 12]]]}
    return [{"rank": 0, "src": trainer}, {"rank": 1, "src": second}, {"rank": 2, "dst": engine}, {"rank": 3, "dst": copy.deepcopy(engine)}]


def test_a_fused_destination_split_over_tp_ranks_takes_each_parts_share_in_turn():
    problem, sources = agree(fused_rows(), 4)
    assert problem.fused[0].parts == ("q[0:6]", "k[0:2]", "q[6:12]", "k[2:4]") and sources == {"q": "q", "k": "k"}
    assert [t.dst for t in problem.tensors] == [None, None] and problem.fused_blocks(0)[3] == ((8, 16), (0, 12))


def test_a_fused_part_the_tp_ranks_cannot_share_equally_is_refused():
    with pytest.raises(WeightSyncError, match="inference tensor 'qk': part 'k' has length 5 along dim 0, not a multiple of the 2 ranks"):
        agree(fused_rows(5), 4)


def converting_rows(convert: dict) -> list[dict]:
    """`rows()` with the engine's 'w' of 256 x 4 (two 128-row FSDP shards) converted as `convert` says on both engine ranks."""
    data = rows()
    for row in data[:2]:
        row["src"]["tensors"][0][1:] = [[256, 4], "float32", "S0 R", [128, 4]]
    for row in data[2:]:
        row["dst"]["tensors"][0][3:] = [convert["w"][0], [256, 2]]
        row["dst"]["convert"] = convert
    return data


def test_a_target_that_converts_makes_a_plan_that_carries_its_scales():
    problem, _ = agree(converting_rows({"w": ["float8_e4m3fn", "block"]}), 4)
    assert problem.names == ("w", "w.scale", "n")
    assert (problem.tensors[0].dst_dtype, problem.tensors[0].scale, problem.tensors[1].scale_of) == ("float8_e4m3fn", "block", "w")
    problem, _ = agree(converting_rows({"w": ["float16", None]}), 4)
    assert problem.names == ("w", "n") and problem.tensors[0].dst_dtype == "float16"


def test_a_conversion_the_engine_ranks_disagree_on_or_cannot_make_is_refused_in_one_line():
    data = converting_rows({"w": ["float8_e4m3fn", "block"]})
    data[3]["dst"]["convert"] = {"w": ["float8_e4m3fn", "tensor"]}
    with pytest.raises(WeightSyncError, match=r"^inference tensor 'w': rank 3 converts to float8_e4m3fn with tensor scales but rank 2 "
                                              r"converts to float8_e4m3fn with block scales; give it the same Target\(dtype=, scale=\)"):
        agree(data, 4)
    data = converting_rows({"w": ["float8_e4m3fn", "block"]})
    for row in data[:2]:  # FSDP shards of 100 rows: not on 128-row blocks
        row["src"]["tensors"][0][1:] = [[200, 4], "float32", "S0 R", [100, 4]]
    for row in data[2:]:
        row["dst"]["tensors"][0][4] = [200, 2]
    with pytest.raises(WeightSyncError, match=r"not whole 128x128 blocks; block scales need every source box on block bounds"):
        agree(data, 4)


def test_a_target_whose_tensor_is_not_of_its_dtype_sends_its_error_in_its_row():
    import torch

    from xmesh_plan.schemas import Cluster
    from xmesh_plan.weight_sync_layouts import Target

    row = describe(2, None, {"w": Target(torch.zeros(2, 2), COLUMN, dtype="float16")}, [[2, 3]], {2: 2, 3: 3}, Cluster())
    assert row["error"] == ("inference['w']: the tensor is float32 but dtype='float16'; pass the engine's tensor of the destination "
                            "dtype (the senders convert to it)")
    row = describe(2, None, {"w": Target(torch.zeros(2, 2, dtype=torch.float16), COLUMN, scale="block")}, [[2, 3]], {2: 2, 3: 3}, Cluster())
    assert row["error"].startswith("inference['w'].scale: 'block' without dtype")
    row = describe(2, None, {"w": Target(torch.zeros(2, 2, dtype=torch.float16), COLUMN, dtype="fp16")}, [[2, 3]], {2: 2, 3: 3}, Cluster())
    assert row["dst"]["convert"] == {"w": ["float16", None]}


def test_a_conversion_the_senders_cannot_make_is_one_line_naming_the_target():
    with pytest.raises(WeightSyncError, match=r"^inference tensor 'w' \(Target\(dtype='float8_e4m3fn', scale=None\) of the trainer's "
                                              r"float32\): scale: an FP8 destination \(float8_e4m3fn\) needs scales; give scale = "
                                              r"\"tensor\" or \"block\"") as info:
        agree(converting_rows({"w": ["float8_e4m3fn", None]}), 4)
    assert "\n" not in str(info.value)
    data = converting_rows({"w": ["float16", None]})
    for row in data[:2]:
        row["src"]["tensors"][0][2] = "int32"
    with pytest.raises(WeightSyncError, match=r"^inference tensor 'w' \(Target\(dtype='float16', scale=None\) of the trainer's int32\): "
                                              r"dst_dtype: int32 -> float16 is not a conversion made at the sender") as info:
        agree(data, 4)
    assert "\n" not in str(info.value)
    data = fused_rows(4)
    for row in data[2:]:
        row["dst"]["tensors"][0][3] = "float8_e4m3fn"
        row["dst"]["convert"] = {"qk": ["float8_e4m3fn", None]}
    with pytest.raises(WeightSyncError, match=r"^inference tensor 'qk' \(Target\(dtype='float8_e4m3fn', scale=None\) .*needs scales"):
        agree(data, 4)


def test_a_fused_fp8_target_with_per_tensor_scales_is_refused_by_the_fused_scales_rule():
    data = fused_rows(4)
    for row in data[2:]:
        row["dst"]["tensors"][0][3] = "float8_e4m3fn"
        row["dst"]["convert"] = {"qk": ["float8_e4m3fn", "tensor"]}
    with pytest.raises(WeightSyncError, match=r"^inference tensor 'qk' is fused \(Fused\(\.\.\.\)\) with scale='tensor'; a fused FP8 "
                                              r"tensor takes block scales .*give Target\(\.\.\., scale=\"block\"\)") as info:
        agree(data, 4)
    assert "\n" not in str(info.value)
