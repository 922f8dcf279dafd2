"""verify and the compact plan file at scale: a synthetic plan of N operations (default 10^6), verified and written.

The plan moves a (N * rows_per_op, 64) float32 tensor between two 8-device meshes on 4-device hosts, row-sharded on
both; each operation broadcasts one row from the source device that holds it down the chain of the two destination
devices that need it (the destination mesh is 4 x 2, rows sharded over its first axis). It is built directly as records (no compile: compiling 10^6 tasks is issue 29's
other part), so the figures are verify's and the file's alone.

    .venv/bin/python -m bench.bench_verify_scale [--ops 1000000] [--out plan.npz]
"""

from __future__ import annotations

import argparse
import resource
import time

from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas.plan import HostOrder, Operation, Plan, SolverInfo, UnitTask
from xmesh_plan.schemas.plan_compact import compact_bytes

STEP_S = 1e-6


def synthetic_plan(ops: int) -> Plan:
    """`ops` operations over 8 source and 8 destination devices (destination pairs replicate a block)."""
    rows = ops  # one row per operation
    problem = build_problem({"shape": [rows, 64], "dtype": "float32", "cluster": {"devices_per_host": 4},
                             "src": {"mesh": [8], "spec": "S0 R"}, "dst": {"mesh": [4, 2], "spec": "S0 R"}})
    src_blocks, dst_blocks = problem.blocks("src"), problem.blocks("dst")
    owners = sorted(src_blocks, key=lambda d: src_blocks[d][0])
    holders = {}
    for device, block in dst_blocks.items():
        holders.setdefault(block[0], []).append(device)
    host_of = problem.cluster.host_of
    tasks, operations, sends, recvs = [], [], {}, {}
    for row in range(rows):
        src = next(d for d in owners if src_blocks[d][0][0] <= row < src_blocks[d][0][1])
        chain = tuple(sorted(next(v for (lo, hi), v in holders.items() if lo <= row < hi)))
        region = ((row, row + 1), (0, 64))
        start = row * STEP_S
        tasks.append(UnitTask(id=row, region=region, nbytes=256, senders=(src,), receivers=chain, sender=src, sender_host=host_of(src),
                              receiver_hosts=(host_of(chain[0]),), strategy="broadcast", start_s=start, end_s=start + STEP_S))
        operations.append(Operation(id=row, task=row, kind="broadcast", src=src, dsts=chain, region=region, chunks=1,
                                    start_s=start, end_s=start + STEP_S))
        sends.setdefault(host_of(src), []).append(row)
        recvs.setdefault(host_of(chain[0]), []).append(row)
    order = [HostOrder(host=h, side="send", tasks=tuple(t)) for h, t in sorted(sends.items())]
    order += [HostOrder(host=h, side="recv", tasks=tuple(t)) for h, t in sorted(recvs.items())]
    end = rows * STEP_S
    return Plan(generator="bench", problem=problem, strategy="broadcast", solver=SolverInfo(name="synthetic"), merged_slices=False,
                tasks=tuple(tasks), operations=tuple(operations), host_order=tuple(order), predicted_seconds=end, lower_bound_seconds=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--out", help="also write the compact plan here")
    args = parser.parse_args()
    t = time.perf_counter()
    plan = synthetic_plan(args.ops)
    print(f"built {len(plan.operations):,} operations in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    report = verify_plan(plan)
    print(f"verify: {time.perf_counter() - t:.1f} s ({report})", flush=True)
    t = time.perf_counter()
    data = compact_bytes(plan)
    print(f"compact: {len(data):,} bytes, {len(data) / len(plan.operations):.0f} per operation (with its task), "
          f"written in {time.perf_counter() - t:.1f} s", flush=True)
    if args.out:
        with open(args.out, "wb") as handle:
            handle.write(data)
    print(f"peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
