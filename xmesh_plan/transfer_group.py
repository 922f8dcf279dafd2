"""A communicator for weight sync between separate launches: a process group made from a TCP rendezvous.

    group = transfer_group("trainer-0.example", 29600, rank=4 + dist.get_rank(), world_size=8)

Every process of the transfer (trainer and inference ranks, launched apart, each launch with its own
default process group or none) calls it with the same host, port and world size and its own rank in the
transfer. Rank 0 hosts the rendezvous (a `torch.distributed.TCPStore` listening on `port`); the others
connect to it. The group is made from that store alone, as RL frameworks make theirs (verl, NeMo-RL,
vLLM's weight-update API): it is not torch's default group and not registered with it, so it never
collides with the launch's own `init_process_group`. Pass it to `WeightSync(group=...)` or to an
executor (`TransferExecutor(plan, group)`); use it through those (or its own methods: `group.rank()`,
`group.size()`, `group.allgather(...)`), not through `torch.distributed.*` functions, which only know
registered groups.

`backend="gloo"` moves CPU tensors (tested in CI); `"nccl"` CUDA tensors on the current device (the same
code, run on one H200). With NCCL, let every rank finish with the group (a barrier over it) and call
`group.shutdown()` before the process exits, or a peer's exit can abort the others' communicators.
"""

from __future__ import annotations

import operator
from datetime import timedelta

from .sides import FrontendError

BACKENDS = ("gloo", "nccl")


def transfer_group(host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo", timeout_s: float = 60.0):
    """A `ProcessGroup` of `world_size` processes joined at `host:port`, this process being `rank` in it.

    Rank 0 listens on `port` (of `host`, an address of its own machine); every other rank must reach it within
    `timeout_s`, which also bounds each of the group's collectives. Bad arguments are one FrontendError line."""
    import torch.distributed as dist

    rank, world_size, port = _whole(rank, "rank"), _whole(world_size, "world_size"), _whole(port, "port")
    if not isinstance(host, str) or not host:
        raise FrontendError(f"transfer_group: host={host!r}; give the address of transfer rank 0's machine, e.g. \"10.0.0.1\"")
    if world_size < 1 or not 0 <= rank < world_size:
        raise FrontendError(f"transfer_group: rank={rank} with world_size={world_size}; give 0 <= rank < world_size, "
                            "world_size being every trainer and inference process of the transfer")
    if not 0 < port < 65536:
        raise FrontendError(f"transfer_group: port={port}; give a TCP port in 1..65535 that rank 0 can listen on")
    if backend not in BACKENDS:
        raise FrontendError(f"transfer_group: backend={backend!r}; use one of {', '.join(BACKENDS)}")
    if not timeout_s > 0:
        raise FrontendError(f"transfer_group: timeout_s={timeout_s!r}; give a positive number of seconds")
    timeout = timedelta(seconds=float(timeout_s))
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    return group_on_store(store, rank, world_size, timeout, backend)


def group_on_store(store, rank: int, world_size: int, timeout: timedelta, backend: str = "gloo"):
    """The process group `transfer_group` makes, from any `torch.distributed.Store` the ranks share (a `TCPStore`
    there; a `HashStore` for ranks that are threads of one process): made from the store alone, not torch's default
    group and not registered with it; `timeout` bounds each collective."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _dist2

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return _dist2._BACKENDS[backend](dist.PrefixStore("xmesh-transfer/", store), rank, world_size, timeout, device)


def _whole(value: object, field: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise FrontendError(f"transfer_group: {field}={value!r} is not a whole number; give an int") from None
