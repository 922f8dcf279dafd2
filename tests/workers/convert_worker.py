"""One rank of the senders' conversion on the torch engine over gloo, started by tests/test_convert_torch.py with env://
variables, or on the MPI engine under mpiexec (tests/test_convert_mpi.py): a plan converting at the sender (fp16,
bf16, FP8 with block and per-tensor scales), run twice with new values, every destination element and every delivered
scale compared bit for bit with a reference made here from the whole tensor by torch's own ops
(`weight_sync_demo.cast_reference`: scales block by block, the cast by `.to()`), not by `executor.convert`.

    python tests/workers/convert_worker.py hooks       4 ranks: sends, broadcasts, bundle gathers and local copies, in
                                                       device order (gloo's tags, then every tag 0) and posted; a one-tensor cast
    python tests/workers/convert_worker.py replicated  3 ranks: per-tensor scales over replicated and uneven sources
    mpiexec -n 4 python tests/workers/convert_worker.py mpi   the same two plans on 4 MPI ranks (the second with a
                                                       fourth, receiving rank), in device order and posted; a one-tensor cast

Each rank prints `rank R: what: result` lines; the test reads them.
"""

from __future__ import annotations

import datetime
import os
import sys
import zlib

import torch
import torch.distributed as dist

from xmesh_plan.executor import ReshardingExecutor, TransferExecutor, TransportOptions
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.weight_sync_demo import BLOCK, cast_reference

HOOKS = {"src_mesh": {"shape": [2], "devices": [0, 1]}, "dst_mesh": {"shape": [2, 2], "devices": [0, 1, 2, 3]},
         "cluster": {"devices_per_host": 2}, "dtype": "float32",
         "tensors": [{"name": "a", "shape": [256, 96], "src": "S0 R", "dst": "R S0", "dst_dtype": "fp16"},
                     {"name": "w", "shape": [256, 384], "src": "S0 R", "dst": "R S1", "dst_dtype": "fp8", "scale": "block"},
                     {"name": "v", "shape": [512, 130], "dtype": "bfloat16", "src": "S0 R", "dst": "S1 S0",
                      "dst_dtype": "float8_e5m2", "scale": "block"},
                     {"name": "e", "shape": [40, 6], "src": "R S0", "dst": "S0 R", "dst_dtype": "fp8", "scale": "tensor"},
                     {"name": "b", "shape": [64, 8], "src": "R R", "dst": "S1 S0", "dst_dtype": "bf16"},
                     {"name": "n", "shape": [16], "src": "S0", "dst": "R"}]}

REPLICATED = {"src_mesh": {"shape": [3], "devices": [0, 1, 2]}, "dst_mesh": {"shape": [1], "devices": [2]},
              "dtype": "float32",
              "tensors": [{"name": "r", "shape": [7, 5], "src": "R R", "dst": "R R", "dst_dtype": "fp8", "scale": "tensor"},
                          {"name": "u", "shape": [5, 3], "src": "S0 R", "dst": "R R", "dst_dtype": "fp8", "scale": "tensor"},
                          {"name": "h", "shape": [5, 3], "src": "S0 R", "dst": "R R", "dst_dtype": "float16"}]}


REPLICATED4 = {**REPLICATED, "dst_mesh": {"shape": [2], "devices": [2, 3]}}  # a receiver outside the source mesh too


def whole(name: str, shape, dtype: str, step: int) -> torch.Tensor:
    """Tensor `name`'s values at `step`, the same on every rank: magnitudes spread over blocks, one block all zero."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {step}".encode()))
    x = torch.randn(*shape, generator=g) * (10.0 ** torch.randint(-3, 4, (1,), generator=g)).item()
    if len(shape) == 2 and shape[0] > BLOCK:
        x[:BLOCK, :BLOCK] = 0  # its scale is the floor's
        x[BLOCK:, :] *= 1000  # values beyond the FP8 range where that block's scale is small
    return x.to(getattr(torch, dtype))


def reference(tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The destination values (and scales) of a whole tensor, by torch's own ops, block by block."""
    return (full, None) if tensor.dst_dtype is None else cast_reference(full, tensor.dst_dtype, tensor.scale)


def box_of(problem, name: str, side: str, rank: int):
    return problem.tensor_problem(problem.index_of(name)).blocks(side).get(rank)


def cut(array: torch.Tensor, box) -> torch.Tensor:
    return array[tuple(slice(a, b) for a, b in box)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape).copy_(t).view(torch.uint8)  # standard strides, also where a dim is empty


def say(line: str) -> None:
    """Print one line with one write (atomic on a pipe), so the lines of ranks sharing mpiexec's stdout never interleave."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def as_torch(got, dtype: str) -> torch.Tensor:
    """A destination shard as torch holds it: the torch engine's as it is, the MPI engine's numpy (raw storage for
    bfloat16 and FP8) viewed as the plan's dtype."""
    if isinstance(got, torch.Tensor):
        return got
    return torch.from_numpy(got).view(getattr(torch, dtype))


def check(raw: dict, label: str, comm=None, rank: int | None = None, **executor_kw) -> None:
    rank = dist.get_rank() if rank is None else rank
    plan = compile_plan(build_transfer(raw))
    problem = plan.problem
    backend = "gloo" if comm is None else "mpi"
    ex = TransferExecutor(plan, comm, backend=backend, timeout_s=60.0, **executor_kw).prepare()
    try:
        for step in range(2):
            fulls = {t.name: whole(t.name, t.shape, t.dtype, step) for t in problem.tensors if t.scale_of is None}
            shards = {name: cut(full, box_of(problem, name, "src", rank)).contiguous()
                      for name, full in fulls.items() if box_of(problem, name, "src", rank) is not None}
            out = ex.run(shards)
            wrong = []
            for t in problem.tensors:
                if t.scale_of is not None:
                    continue
                values, scales = reference(t, fulls[t.name])
                for name, want in ((t.name, values), (t.name + ".scale", scales)):
                    box = box_of(problem, name, "dst", rank) if want is not None else None
                    if box is None:
                        continue
                    got = as_torch(out[name], str(want.dtype).removeprefix("torch."))
                    if got.dtype != want.dtype or not torch.equal(bits(got), bits(cut(want, box))):
                        wrong.append(f"{name} ({got.dtype})")
            say(f"rank {rank}: {label} step {step}: {'ok' if not wrong else 'wrong ' + ', '.join(wrong)}")
    finally:
        ex.close()


def check_single(comm=None, rank: int | None = None) -> None:
    """A one-tensor plan casting float32 to bfloat16, through `ReshardingExecutor` (a shard in and out)."""
    rank = dist.get_rank() if rank is None else rank
    mesh = {"shape": [4], "devices": [0, 1, 2, 3]}
    problem = build_problem({"shape": [8, 6], "dtype": "float32", "dst_dtype": "bf16", "src": {"mesh": mesh, "spec": "S0 R"},
                             "dst": {"mesh": mesh, "spec": "R S0"}})
    ex = ReshardingExecutor(compile_plan(problem), comm, backend="gloo" if comm is None else "mpi", timeout_s=60.0).prepare()
    try:
        full = whole("single", problem.shape, "float32", 0)
        got = as_torch(ex.run(cut(full, problem.blocks("src")[rank]).contiguous()), "bfloat16")
        want = cut(full.to(torch.bfloat16), problem.blocks("dst")[rank])
        say(f"rank {rank}: one tensor: {'ok' if got.dtype == want.dtype and torch.equal(bits(got), bits(want)) else 'wrong'}")
    finally:
        ex.close()


def main_mpi() -> int:
    """The MPI engine under mpiexec on 4 ranks; sources handed in as CPU torch tensors (bfloat16 ones too)."""
    from mpi4py import MPI

    comm, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    check(HOOKS, "mpi device order", comm, rank)
    check(HOOKS, "mpi posted", comm, rank, order="posted")
    check(REPLICATED4, "mpi replicated", comm, rank)
    check_single(comm, rank)
    return 0


def main() -> int:
    if sys.argv[1] == "mpi":
        return main_mpi()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        if sys.argv[1] == "hooks":
            check(HOOKS, "device order")
            check(HOOKS, "device order, tag 0", transport=TransportOptions(match_by_tag=False, receipt_bytes=16))
            check(HOOKS, "posted", order="posted")
            check_single()
        else:
            check(REPLICATED, "replicated")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
