"""`redistribute` of a DTensor that requires grad, built the usual ways (`DTensor.from_local` of a leaf that
requires grad, `distribute_tensor` of one), moves it and backpropagates, and the next call of the same move
works too. One gloo rank in a fresh process (the default process group is per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
from xmesh_plan.redistribute import redistribute
mesh = DeviceMesh("cpu", [0])
full = torch.arange(12.0).reshape(3, 4)
makers = {  # (the DTensor, where its gradient lands): from_local's reaches the local leaf, distribute_tensor's DTensor is a leaf
    "from_local": lambda t: (DTensor.from_local(t, mesh, [Replicate()]), lambda x: t.grad),
    "distribute_tensor": lambda t: (distribute_tensor(t, mesh, [Replicate()]), lambda x: x.grad.to_local()),
}
for name, make in makers.items():
    x, grad_of = make(full.clone().requires_grad_())
    y = redistribute(x, DeviceMesh("cpu", [0]), [Shard(0)])
    assert torch.equal(y.full_tensor().detach(), full), name
    (y.to_local() * 2).sum().backward()
    assert torch.equal(grad_of(x), torch.full_like(full, 2.0)), (name, grad_of(x))
    again = redistribute(distribute_tensor(full * 3, mesh, [Replicate()]), DeviceMesh("cpu", [0]), [Shard(0)])
    assert torch.equal(again.full_tensor(), full * 3), name
    print(name, "ok", flush=True)
dist.destroy_process_group()
"""


def test_a_dtensor_requiring_grad_moves_backpropagates_and_the_next_call_works():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["from_local ok", "distribute_tensor ok"], done.stdout
