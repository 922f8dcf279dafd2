"""Shared hosts: predicted / bound where the source and destination meshes share hosts, with the
full-duplex resource model (a cross-host hop holds the sender's NIC send side and the receiver's receive
side) against an "exclusive hosts" model (an exclusive intra-host resource on every host a task touches, held
for its whole duration, so a shared host never sends and receives at once).

The exclusive-hosts model is built here from the same task options (NIC sides kept, device ports replaced by
one `intra` resource per host touched), scheduled by the same solver and timed by the same
simulator, so the two columns differ only in the resource model. Tensors are 4096x4096 float32
(64 MiB); hosts have one 100 Gbit/s NIC, 800 Gbit/s inside, 20 us latency.

    .venv/bin/python -m bench.bench_duplex
"""

from __future__ import annotations

from dataclasses import replace

from bench.report import update_benchmarks_doc, write_json
from xmesh_plan.planner.compile import TaskOptions, assemble, task_options
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.solvers import solve
from xmesh_plan.planner.unit_tasks import decompose

CLUSTER = {"devices_per_host": 4, "nics": [{"send_gbps": 100, "recv_gbps": 100}], "intra_host_gbps": 800, "latency_us": 20}
CASES = [  # src mesh, src spec, dst mesh, dst first host, dst spec, tensor shape
    ((2, 4), "S0 R", (2, 4), 1, "R S0", (4096, 4096)),
    ((2, 4), "S0 R", (2, 4), 1, "S1 R", (4096, 4096)),
    ((2, 4), "S01 R", (2, 4), 1, "R S01", (4096, 4096)),
    ((2, 4), "S0 S1", (2, 4), 0, "S1 S0", (4096, 4096)),
    ((3, 4), "S0 R", (3, 4), 1, "R S0", (6144, 4096)),
    ((4, 4), "S0 R", (4, 4), 2, "S1 R", (8192, 4096)),
    ((2, 4), "S0 R", (3, 4), 1, "R S0", (4096, 4096)),
    ((2, 2), "S0 S1", (2, 4), 1, "S1 R", (4096, 4096)),
]
STRATEGIES = ("broadcast", "auto")


def exclusive_host_model(options: list[TaskOptions], host_of) -> list[TaskOptions]:
    """The exclusive-hosts model: device ports dropped, an `intra` resource on every host the option touches."""
    out = []
    for item in options:
        hosts = {host_of(d) for d in item.cell.receivers}
        new = []
        for option in item.scheduling.options:
            nic = {r for r in option.resources if r[1].partition(":")[0] in ("send", "recv")}
            new.append(replace(option, resources=frozenset(nic | {(h, "intra") for h in hosts | {option.sender_host}})))
        out.append(replace(item, scheduling=replace(item.scheduling, options=tuple(new))))
    return out


def compiled(problem, strategy: str, exclusive: bool):
    cells = decompose(problem)
    options = task_options(problem, cells, strategy)
    if exclusive:
        options = exclusive_host_model(options, problem.cluster.host_of)
    schedule = solve([o.scheduling for o in options], "auto")
    return assemble(problem, cells, options, schedule, strategy, 0)


def main() -> None:
    rows, data = [], []
    for src, src_spec, dst, first, dst_spec, shape in CASES:
        problem = build_problem({"shape": list(shape), "dtype": "float32", "cluster": CLUSTER, "src": {"mesh": list(src), "spec": src_spec},
                                 "dst": {"mesh": {"shape": list(dst), "first_host": first}, "spec": dst_spec}})
        src_hosts, dst_hosts = problem.src.mesh.hosts(problem.cluster), problem.dst.mesh.hosts(problem.cluster)
        for strategy in STRATEGIES:
            exclusive, duplex = compiled(problem, strategy, True), compiled(problem, strategy, False)
            case = (f"{src[0]}x{src[1]} {src_spec} on hosts {','.join(map(str, src_hosts))} -> "
                    f"{dst[0]}x{dst[1]} {dst_spec} on hosts {','.join(map(str, dst_hosts))}")
            exclusive_ratio, duplex_ratio = (p.predicted_seconds / p.lower_bound_seconds for p in (exclusive, duplex))
            rows.append(f"| {case} | {strategy} | {len(duplex.tasks)} | {duplex.lower_bound_seconds * 1e3:.3f} | {exclusive_ratio:.3f} | {duplex_ratio:.3f} | "
                        f"{duplex.solver.details['gap_to_proven_bound']} |")
            data.append({"case": case, "strategy": strategy, "tasks": len(duplex.tasks), "bound_s": duplex.lower_bound_seconds,
                         "exclusive_hosts_predicted_s": exclusive.predicted_seconds, "duplex_predicted_s": duplex.predicted_seconds})
            print(rows[-1], flush=True)
    write_json("duplex.json", data)
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
