"""The shared-CPU model (`Cluster.cpu`, opt-in): messages inside a host and local copies are CPU work that every
rank shares; without it every plan simulates as before."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.simulate import simulate, simulate_plan
from xmesh_plan.schemas import Cluster, Cpu, DeviceMesh, Operation, Placement, ReshardingProblem

from tests.support.builders import compile_fast, reference_problem

SHAPE = (256, 256, 64)  # int32: 16 MiB


def one_host(cpu: Cpu | None, devices: int = 8) -> ReshardingProblem:
    """Every device on one host, so every message is intra-host; the problem is here for its cluster and tensor."""
    mesh = DeviceMesh(shape=(1, devices), devices=tuple(range(devices)))
    return ReshardingProblem(shape=SHAPE, dtype="int32", cluster=Cluster(devices_per_host=devices, cpu=cpu),
                             src=Placement(mesh=mesh, spec="R R R"), dst=Placement(mesh=mesh, spec="R R R"))


def full(problem):
    return tuple((0, n) for n in problem.shape)


def copies(problem, devices):
    return [Operation(id=i, task=-1, kind="copy", src=d, dsts=(d,), region=full(problem)) for i, d in enumerate(devices)]


def sends(problem, pairs, region=None):
    return [Operation(id=i, task=i, kind="send", src=a, dsts=(b,), region=region or full(problem)) for i, (a, b) in enumerate(pairs)]


def test_a_local_copy_costs_its_bytes_at_the_copy_rate():
    p = one_host(Cpu(cores=2, copy_gbps=8))
    assert simulate(copies(p, [0]), p).makespan_s == pytest.approx(p.nbytes / 1e9, rel=1e-9)


def test_two_copies_sharing_one_core_take_twice_as_long():
    """Two ranks at work on a one-core machine each get half of it; on two cores each has its own."""
    one_core, two_cores = one_host(Cpu(cores=1, copy_gbps=8)), one_host(Cpu(cores=2, copy_gbps=8))
    alone = simulate(copies(one_core, [0]), one_core).makespan_s
    assert simulate(copies(one_core, [0, 1]), one_core).makespan_s == pytest.approx(2 * alone, rel=1e-9)
    assert simulate(copies(two_cores, [0, 1]), two_cores).makespan_s == pytest.approx(alone, rel=1e-9)
    # one rank never uses more than one core: two copies of one device go one core's speed, shared
    assert simulate(copies(two_cores, [0, 0]), two_cores).makespan_s == pytest.approx(2 * alone, rel=1e-9)


def test_without_the_model_copies_and_intra_host_messages_of_different_ranks_overlap():
    p = one_host(None)
    assert simulate(copies(p, [0, 1]), p).makespan_s == simulate(copies(p, [0]), p).makespan_s
    assert simulate(sends(p, [(0, 1), (2, 3)]), p).makespan_s == simulate(sends(p, [(0, 1)]), p).makespan_s


def test_a_message_inside_a_host_is_cpu_work_at_both_ends():
    """Four messages between distinct pairs keep 8 ranks busy: on 2 cores each end gets a quarter core."""
    p = one_host(Cpu(cores=2, copy_gbps=8))
    lone = simulate(sends(p, [(0, 1)]), p).makespan_s
    assert lone == pytest.approx(p.nbytes / 1e9, rel=1e-9)  # both ends copy at once, each on its own core
    assert simulate(sends(p, [(0, 1), (2, 3), (4, 5), (6, 7)]), p, "posted").makespan_s == pytest.approx(4 * lone, rel=1e-9)


@pytest.mark.parametrize("discipline", ["posted", "device-order"])
def test_per_message_cpu_cost_serialises_small_messages_on_one_machine(discipline):
    """200 one-element messages between 8 pairs of ranks on one core: 2 x 200 x message_us of CPU in series,
    whatever the pairs; without the model they overlap and cost next to nothing."""
    p = one_host(Cpu(cores=1, message_us=100, copy_gbps=1e3), devices=16)
    tiny = ((0, 1),) * 3
    pairs = [(2 * (i % 8), 2 * (i % 8) + 1) for i in range(200)]
    assert simulate(sends(p, pairs, tiny), p, discipline).makespan_s == pytest.approx(200 * 2 * 100e-6, rel=1e-6)
    free = one_host(None, devices=16)
    assert simulate(sends(free, pairs, tiny), free, discipline).makespan_s < 1e-3


def test_messages_between_hosts_are_priced_as_without_the_model():
    raw = {"shape": [64, 64, 64], "dtype": "int32", "src": {"mesh": "1x4", "spec": "R R R"},
           "dst": {"mesh": "1x4", "spec": "R R R"}}
    problem = build_problem(raw)
    ops = sends(problem, [(0, 4), (1, 5)])
    with_cpu = problem.model_copy(update={"cluster": problem.cluster.model_copy(update={"cpu": Cpu()})})
    assert simulate(ops, with_cpu, "device-order").makespan_s == simulate(ops, problem, "device-order").makespan_s


@pytest.mark.parametrize("name", ["case1", "case5", "case8"])
@pytest.mark.parametrize("strategy", ["broadcast", "local_allgather"])
def test_the_default_cluster_is_unchanged(name, strategy):
    """No `cpu`: nothing in the JSON, and every discipline times a plan as its compiler did."""
    plan = compile_fast(reference_problem(name), strategy)
    assert plan.problem.cluster.cpu is None and '"cpu"' not in plan.to_json()
    assert simulate_plan(plan).makespan_s == pytest.approx(plan.predicted_seconds, rel=1e-9, abs=1e-11)  # stored rounded
    slower = plan.problem.model_copy(update={"cluster": plan.problem.cluster.model_copy(update={"cpu": Cpu(cores=2, copy_gbps=1)})})
    if strategy == "local_allgather":  # its all-gathers inside a host now cost CPU
        assert simulate(plan.operations, slower).makespan_s > plan.predicted_seconds


def test_a_cluster_with_a_cpu_round_trips_through_json():
    cluster = Cluster(cpu=Cpu(cores=2, message_us=25, copy_gbps=24))
    assert Cluster.model_validate_json(cluster.model_dump_json()) == cluster
    assert "cpu" not in Cluster().model_dump()


@pytest.mark.parametrize("field,value", [("cores", 0), ("message_us", -1), ("copy_gbps", float("nan")), ("cores", True)])
def test_bad_cpu_values_name_the_field(field, value):
    with pytest.raises(ValidationError, match=rf"cpu\.{field}"):
        Cluster.model_validate({"cpu": {field: value}})
    with pytest.raises(ValidationError, match="cpu.speed"):
        Cluster.model_validate({"cpu": {"speed": 1}})


def test_a_problem_file_with_a_bad_cpu_gets_one_line_naming_the_field():
    from xmesh_plan.planner.problem_io import InputError, parse_cluster

    with pytest.raises(InputError) as err:
        parse_cluster({"cpu": {"cores": -2}})
    assert "\n" not in str(err.value) and "cluster.cpu.cores" in str(err.value)
    assert parse_cluster({"cpu": {"cores": 2, "copy_gbps": 24}}).cpu == Cpu(cores=2, copy_gbps=24)


def test_saved_runs_are_repredicted_with_and_without_the_cpu(tmp_path):
    """One case of an archived run (made before the CPU model existed): rebuilt plans predict as saved without the CPU model (broadcasts),
    and the CPU model only adds time (its copies are work the default model charges next to nothing)."""
    import json
    from pathlib import Path

    from bench.netlab.repredict import repredicted, table

    saved = json.loads((Path(__file__).resolve().parents[1] / "bench/results/archive/netlab-mpi-device-500-without-cpu-model.json").read_text())
    one = {"meta": saved["meta"], "runs": [run for run in saved["runs"] if run["case"] == "case1"]}
    (tmp_path / "one.json").write_text(json.dumps(one))
    rows = repredicted(tmp_path / "one.json", Cpu(cores=2, copy_gbps=24))
    assert [r["approach"] for r in rows] == ["ours", "send_recv", "local_allgather", "alpa-send-recv", "alpa-allgather"]
    assert rows[0]["today"] == pytest.approx(rows[0]["saved"], rel=1e-9)
    assert all(r["cpu"] >= r["today"] for r in rows)
    assert "| case1 | 500 | 5 |" in table(rows)


def test_inspect_names_the_cpu_only_when_there_is_one():
    from xmesh_plan.planner.inspect_plan import summarize

    plan = compile_fast(reference_problem("case1"))
    assert "CPU" not in summarize(plan)
    raw = plan.problem.model_dump()
    raw["cluster"]["cpu"] = {"cores": 2, "copy_gbps": 24}
    with_cpu = compile_fast(ReshardingProblem.model_validate(raw))
    assert "CPU shared by every rank: 2 cores, copies 24 Gbit/s per core, 0 us per message inside a host" in summarize(with_cpu)


def one_to_host(cpu: Cpu | None, gbps: float = 0.5) -> ReshardingProblem:
    """One device sends a 16 MiB tensor to the 4 devices of another host over a NIC of `gbps` (500 Mbit/s unless
    given): one cross-host hop, then 3 inside."""
    return build_problem({"name": "fan", "shape": list(SHAPE), "dtype": "int32", "src": {"mesh": "1x1", "spec": "R R R"},
                          "dst": {"mesh": "1x4", "spec": "R R R"},
                          "cluster": {"nics": [{"send_gbps": gbps, "recv_gbps": gbps}], "overhead_us": 200, "latency_us": 0,
                                      **({"cpu": cpu.model_dump()} if cpu else {})}})


def test_the_planner_chunks_for_the_relays_copies_when_the_cpu_is_modelled():
    """With the CPU modelled a relay inside a host copies at `copy_gbps`, not at the intra-host link's speed, so the
    broadcast takes more chunks, and the simulator (which prices it independently) agrees it is faster that way."""
    cpu = Cpu(cores=2, copy_gbps=24)
    links_only, with_cpu = (compile_fast(one_to_host(c), "broadcast") for c in (None, cpu))
    k_links, k_cpu = (p.operations[0].chunks for p in (links_only, with_cpu))
    assert k_cpu > k_links
    priced = one_to_host(cpu)
    assert simulate(with_cpu.operations, priced).makespan_s < simulate(links_only.operations, priced).makespan_s
    assert with_cpu.predicted_seconds == pytest.approx(simulate(with_cpu.operations, priced).makespan_s, rel=0.02)


@pytest.mark.parametrize("cores", [2, 1, 0.5])
def test_a_broadcasts_chunks_wait_for_the_copies_its_relays_share(cores):
    """With a fast NIC the copies pace the chain: each of the 2 relays copies every chunk twice on its one core, and the
    chain's 6 copies per chunk share the cores (on 2 cores 3 copies' time per chunk, not 1; below 2 the two ends of
    one message already share them). The broadcast's time, with the K it chose, is what the simulator gives that
    operation, and no other K simulates faster by more than 1%."""
    from xmesh_plan.planner.strategies import TaskContext, broadcast

    problem = one_to_host(Cpu(cores=cores, copy_gbps=24), gbps=10)
    ctx = TaskContext(full(problem), problem.nbytes, 0, (4, 5, 6, 7), problem.cluster, problem.itemsize)
    chosen = broadcast(ctx)

    def simulated(k):
        op = Operation(id=0, task=0, kind="broadcast", src=0, dsts=(4, 5, 6, 7), region=full(problem), chunks=k)
        return simulate([op], problem).makespan_s

    assert chosen.duration_s == pytest.approx(simulated(chosen.chunks), rel=0.01)
    assert simulated(chosen.chunks) <= 1.01 * min(simulated(k) for k in (1, 2, 4, 8, 16, 32, 64))
