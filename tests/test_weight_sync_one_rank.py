"""`WeightSync` in this process as a transfer group of one gloo rank (trainer and inference at once): the input
checks a construction makes before any byte moves, each a one-line `WeightSyncError` naming the tensor and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from xmesh_plan.engine_layouts import COLUMN
from xmesh_plan.weight_sync import Target, WeightSync, WeightSyncError


@pytest.fixture(scope="module")
def trainer():
    """A one-rank gloo world (this process) and a trainer state dict of one 256 x 128 DTensor, torn down after the module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    yield {"w": distribute_tensor(torch.randn(256, 128), mesh, [Replicate()])}
    dist.destroy_process_group()


def fp8(**convert) -> Target:
    return Target(torch.zeros(256, 128, dtype=torch.float8_e4m3fn), COLUMN, dtype="float8_e4m3fn", **convert)


@pytest.mark.parametrize("target, message", [
    (fp8(scale="tensor", scales=torch.zeros(1, dtype=torch.bfloat16)),
     r"^inference\['w'\]\.scales on rank 0 is bfloat16 of shape \(1,\); pass float32 of shape \(1,\)"),
    (fp8(scale="block", scales=torch.zeros(5)),
     r"^inference\['w'\]\.scales on rank 0 is float32 of shape \(5,\); pass float32 of shape \(2, 1\)"),
])
def test_a_scales_tensor_that_cannot_take_the_scales_is_refused_at_construction(trainer, target, message):
    with pytest.raises(WeightSyncError, match=message) as info:
        WeightSync(trainer=trainer, inference={"w": target}, inference_mesh=[[0]])
    assert "\n" not in str(info.value)


def test_a_scales_tensor_of_the_right_dtype_and_shape_receives_the_scales(trainer):
    scales = torch.zeros(2, 1)
    with WeightSync(trainer=trainer, inference={"w": fp8(scale="block", scales=scales)}, inference_mesh=[[0]]) as sync:
        sync.run()
    full = trainer["w"].full_tensor()
    assert sync.scales["w"] is scales
    assert torch.equal(scales, torch.stack([full[:128].abs().max(), full[128:].abs().max()]).reshape(2, 1) / 448)
