"""`weight_sync_demo.check_converted`, the checker the converting weight-sync tests rest on, on one engine rank under
torch's fake process group (no launch): destinations made here by hand from `cast_reference` of the full tensor are
'ok', and one wrong scale is named. Stacked experts [E, I, H] keep one scale per expert in dim 0 (block size 1 there),
and a fused destination concatenates its parts' shares along its `Fused.dim`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from xmesh_plan.weight_sync import COLUMN, ROW, Fused, Target
from xmesh_plan.weight_sync_demo import ENGINE, cast_reference, check_converted

FP8 = "float8_e4m3fn"
W1, W3, W13 = "model.layers.0.mlp.experts.w1", "model.layers.0.mlp.experts.w3", "model.layers.0.mlp.experts.w13"


@pytest.fixture(scope="module")
def mesh():
    """Engine rank 5 of the demo's 8: TP coordinate 1 of the engine mesh [[4, 5], [6, 7]]."""
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    yield DeviceMesh("cpu", ENGINE)
    dist.destroy_process_group()


def test_stacked_experts_sharded_over_experts(mesh):
    """Experts 4:8 of 8 (COLUMN = Shard(0) on the TP dim) with their own scales [4, 2, 2]: ok; another expert's
    scales in their place: the scales differ."""
    full = torch.randn(8, 256, 200, generator=torch.Generator().manual_seed(0))
    values, scales = cast_reference(full, FP8, "block")
    target = {W1: Target(values[4:8].clone(), COLUMN, dtype=FP8, scale="block")}
    assert check_converted(target, {W1: scales[4:8]}, mesh, {W1: full}) == "ok"
    assert check_converted(target, {W1: scales[3:7]}, mesh, {W1: full}) == f"{W1}'s scales differ"


def test_stacked_experts_fused_along_dim_1(mesh):
    """w13 = cat(w1, w3) along dim 1 of experts sharded over dim 0: this rank's experts of each part, whole along
    dim 1, and their scales concatenated the same way; swapped parts: the values differ."""
    gen = torch.Generator().manual_seed(1)
    w1, w3 = torch.randn(8, 128, 200, generator=gen), torch.randn(8, 128, 200, generator=gen)
    (v1, s1), (v3, s3) = cast_reference(w1, FP8, "block"), cast_reference(w3, FP8, "block")
    refs = {W1: w1, W3: w3}
    fused = Target(torch.cat([v1[4:8], v3[4:8]], 1), COLUMN, source=Fused((W1, W3), dim=1), dtype=FP8, scale="block")
    assert check_converted({W13: fused}, {W13: torch.cat([s1[4:8], s3[4:8]], 1)}, mesh, refs) == "ok"
    swapped = Target(torch.cat([v3[4:8], v1[4:8]], 1), COLUMN, source=Fused((W1, W3), dim=1), dtype=FP8, scale="block")
    assert check_converted({W13: swapped}, {W13: torch.cat([s1[4:8], s3[4:8]], 1)}, mesh, refs) == f"{W13} differs"


def test_two_dim_row_and_fused_rows(mesh):
    """A 2-d ROW destination (columns 128:256 of 256) with its column of blocks, and q, k fused along dim 0 (each
    part's second half of rows): ok."""
    gen = torch.Generator().manual_seed(2)
    full, q, k = torch.randn(300, 256, generator=gen), torch.randn(256, 64, generator=gen), torch.randn(256, 64, generator=gen)
    values, scales = cast_reference(full, FP8, "block")
    (vq, sq), (vk, sk) = cast_reference(q, FP8, "block"), cast_reference(k, FP8, "block")
    targets = {"o": Target(values[:, 128:].clone(), ROW, dtype=FP8, scale="block"),
               "qk": Target(torch.cat([vq[128:], vk[128:]]), COLUMN, source=Fused(("q", "k")), dtype=FP8, scale="block")}
    given = {"o": scales[:, 1:], "qk": torch.cat([sq[1:], sk[1:]])}
    assert check_converted(targets, given, mesh, {"o": full, "q": q, "k": k}) == "ok"
