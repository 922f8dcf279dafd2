"""The ranks an executor runs over: an mpi4py communicator or a torch.distributed process group.

A world answers the few questions `ReshardingExecutor` asks before any engine exists: this rank,
the number of ranks, an all-gather of a few int64 (plan agreement in prepare()) bounded by a
deadline, and the communicator the engine gets (MPI: a duplicate of the caller's, so the
executor's messages never meet theirs; torch: the group itself, see docs/executor.md).
"""

from __future__ import annotations

import time

import numpy as np

from .errors import BackendUnavailableError, ExecutorError, PeerTimeoutError


def poll_until(is_done, timeout_s: float, poll_s: tuple[float, float], what: str) -> None:
    """Call `is_done()` with growing sleeps between calls; PeerTimeoutError naming `what` after `timeout_s`."""
    deadline, nap = time.monotonic() + timeout_s, poll_s[0]
    while not is_done():
        if time.monotonic() > deadline:
            raise PeerTimeoutError(f"{what} did not finish within {timeout_s:g} s; every rank must call it, "
                                   "check that all ranks are alive and loaded the same plan")
        time.sleep(nap)
        nap = min(nap * 2, poll_s[1])


def is_mpi_comm(comm: object) -> bool:
    return all(hasattr(comm, name) for name in ("Get_rank", "Get_size", "Idup"))


def is_torch_group(comm: object) -> bool:
    """True for a torch.distributed ProcessGroup (checked without importing torch)."""
    return any(c.__name__ == "ProcessGroup" and c.__module__.startswith("torch") for c in type(comm).__mro__)


class MpiWorld:
    """The ranks of an mpi4py communicator."""

    kind, label, launch = "mpi", "MPI world", "mpiexec -n"
    buffered_sends = False  # the MPI engine sends a device-order message synchronously itself (no receipts)

    def __init__(self, comm):
        self.comm = comm

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def tag_limit(self) -> int:
        """The largest tag this MPI allows (its TAG_UB)."""
        from mpi4py import MPI

        return self.comm.Get_attr(MPI.TAG_UB) or 32767

    def allgather(self, row: np.ndarray, timeout_s: float, poll_s: tuple[float, float], what: str) -> np.ndarray:
        every = np.empty((self.size, len(row)), np.int64)
        request = self.comm.Iallgather(np.ascontiguousarray(row, np.int64), every)
        poll_until(request.Test, timeout_s, poll_s, what)
        return every

    def engine_comm(self, timeout_s: float, poll_s: tuple[float, float]):
        comm, request = self.comm.Idup()
        poll_until(request.Test, timeout_s, poll_s, "duplicating the communicator in prepare()")
        return comm

    def release(self, comm) -> None:
        from mpi4py import MPI

        if comm is not None and not MPI.Is_finalized():
            comm.Free()  # pending operations of an abandoned reshard still complete (MPI_Comm_free's rule)


class TorchWorld:
    """The ranks of a torch.distributed process group (None: the default group, once initialised)."""

    kind, label, launch = "torch", "process group", "torchrun --nproc-per-node"

    def __init__(self, group=None):
        self.dist = import_torch_distributed()
        if group is None and not self.dist.is_initialized():
            raise ExecutorError("torch.distributed is not initialised; call torch.distributed.init_process_group('gloo') "
                                "(or 'nccl') first, e.g. under torchrun")
        self.group = self.dist.group.WORLD if group is None else group

    @property
    def rank(self) -> int:
        return group_rank(self.dist, self.group)

    @property
    def size(self) -> int:
        return self.dist.get_world_size(self.group)

    @property
    def backend(self) -> str:
        return group_backend(self.dist, self.group)

    @property
    def buffered_sends(self) -> bool:
        """Whether a send ends once the transport buffered it, before the peer has it (gloo's sockets: receipts keep
        device order, `passes.with_receipts`); NCCL's sends end when received."""
        return self.backend != "nccl"

    def tensor_device(self):
        """Where this group's tensors live: the current CUDA device for NCCL, else the CPU."""
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def tag_limit(self) -> int:
        return 2**31 - 1  # gloo's tags are C ints; NCCL ignores them

    def allgather(self, row: np.ndarray, timeout_s: float, poll_s: tuple[float, float], what: str) -> np.ndarray:
        import torch

        mine = torch.as_tensor(np.asarray(row, np.int64), device=self.tensor_device())
        every = [torch.empty_like(mine) for _ in range(self.size)]
        work = self.group.allgather([every], [mine])  # what dist.all_gather calls, on a group torch's registry may not know
        poll_until(work.is_completed, timeout_s, poll_s, what)
        work.wait()
        return torch.stack(every).cpu().numpy()

    def engine_comm(self, timeout_s: float, poll_s: tuple[float, float]):
        return self.group

    def release(self, comm) -> None:
        pass  # the group is the caller's


def group_rank(dist, group) -> int:
    """This process's rank in `group`. Torch's registry knows the groups it made (the default one, `new_group`'s);
    a group made from its own store and not registered (`xmesh_plan.transfer_group`) answers for itself."""
    try:
        return dist.get_rank(group)
    except ValueError:
        return group.rank()


def group_backend(dist, group) -> str:
    """`group`'s backend name in lower case ("gloo", "nccl"), also for a group torch's registry does not know."""
    try:
        return str(dist.get_backend(group)).lower()
    except ValueError:
        return str(group.name()).lower()


def import_torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError as err:
        raise BackendUnavailableError(f"the torch backend needs PyTorch ({err}); pip install torch==2.13.0 'xmesh-plan[torch]' "
                                      "(pin torch: a bare requirement downloads a CUDA build of several GB)") from None
    if not dist.is_available():
        raise BackendUnavailableError("this PyTorch was built without torch.distributed; install a build with it")
    return dist
