"""`WeightSync` on one gloo rank (trainer and engine at once, every byte a local copy): the plan cache's size and
where the weights land, in this process.

The 8-rank syncs, fused and separate launches are in tests/test_weight_sync.py; these need no launch. A layout here is
one tensor of n rows: each n is another problem, so another plan.
"""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

from xmesh_plan import weight_sync  # noqa: E402
from xmesh_plan.weight_sync import COLUMN, REPLICATED, Fused, Target, WeightSync, WeightSyncError, set_plan_cache_size  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("this process already runs torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DeviceMesh("cpu", [0])
    dist.destroy_process_group()


@pytest.fixture
def cache():
    """An empty plan cache of the default size, restored after the test."""
    weight_sync._PLANS.clear()
    yield
    set_plan_cache_size(8)
    weight_sync._PLANS.clear()


def sync_of(mesh, rows: int) -> tuple[WeightSync, torch.Tensor, torch.Tensor]:
    """A WeightSync of one float32 tensor of `rows` x 4 (FSDP-like rows on the trainer, replicated on the engine)."""
    full = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + rows
    out = torch.full((rows, 4), float("nan"))
    sync = WeightSync(trainer={"w": distribute_tensor(full, mesh, [Shard(0)])}, inference={"w": (out, REPLICATED)},
                      inference_mesh=[[0]])
    return sync, full, out


def compiles(mesh, layouts) -> list[bool]:
    """Whether each WeightSync of `layouts` (row counts, in turn) compiled its plan, each run once and checked."""
    out = []
    for rows in layouts:
        sync, full, got = sync_of(mesh, rows)
        with sync:
            sync.run()
        assert torch.equal(got, full)
        out.append(sync.compiled)
    return out


def test_a_layout_the_plan_cache_holds_is_never_compiled_again(mesh, cache):
    set_plan_cache_size(3)
    assert compiles(mesh, [1, 2, 3, 1, 2, 3, 3, 1]) == [True, True, True] + [False] * 5


def test_a_cache_smaller_than_the_layouts_cycled_compiles_every_time(mesh, cache):
    set_plan_cache_size(2)
    assert compiles(mesh, [1, 2, 3, 1, 2, 3]) == [True] * 6
    set_plan_cache_size(1)  # shrinking keeps the most recent
    assert compiles(mesh, [3, 3]) == [False, False]


@pytest.mark.parametrize("size", [0, -1, True, 2.5, "8"])
def test_a_bad_cache_size_is_refused_in_one_line(size, cache):
    with pytest.raises(WeightSyncError, match=r"^set_plan_cache_size: size=.*; give a whole number of plans to keep, at least 1"):
        set_plan_cache_size(size)
    assert weight_sync.PLAN_CACHE_SIZE == 8


def storage_uses(tensor) -> int:
    """How many tensors (views included) use `tensor`'s memory: a view kept by the executor would count."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def test_the_weights_land_in_the_callers_tensors_with_no_buffer_of_the_executors_own(mesh, cache):
    sync, full, out = sync_of(mesh, 5)
    address, uses = out.data_ptr(), storage_uses(out)
    sync.run()
    assert torch.equal(out, full) and out.data_ptr() == address
    assert sync.executor.engine.dsts == [None], "the executor made a destination buffer of its own"
    assert storage_uses(out) == uses, "the executor keeps a view of the caller's tensor after run()"
    sync.trainer["w"].to_local().add_(1)  # the trainer's next step
    full.add_(1)
    sync.run()
    assert torch.equal(out, full)
    sync.close()
    ref = weakref.ref(out)
    del sync, out
    assert ref() is None, "something still holds the engine's tensor after close()"


def test_a_fused_destination_is_written_through_the_views_of_its_parts(mesh, cache):
    parts = {name: torch.randn(rows, 3) for name, rows in (("q", 4), ("k", 2), ("v", 2))}
    qkv = torch.full((8, 3), float("nan"))
    trainer = {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in parts.items()}
    with WeightSync(trainer=trainer, inference={"qkv": Target(qkv, COLUMN, source=Fused(("q", "k", "v")))},
                    inference_mesh=[[0]]) as sync:
        uses = storage_uses(qkv)
        sync.run()
        assert torch.equal(qkv, torch.cat([parts[n] for n in "qkv"]))
        assert sorted(sync.into) == ["k", "q", "v"] and not sync.copied  # each part a view of qkv: nothing copied after
        assert sync.executor.engine.dsts == [None, None, None]
        assert storage_uses(qkv) == uses
