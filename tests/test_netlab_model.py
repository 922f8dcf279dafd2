"""bench/netlab's pure parts (no namespaces needed): Alpa's baselines as runnable plans, predictions, counters."""

from __future__ import annotations

import pytest

from bench.netlab.baseline_plans import baseline_plan
from bench.netlab.counters import HostBytes, LinkBytes, predicted_links, within
from bench.netlab.launch import ranks_per_host
from bench.netlab.predict import at_rate, predictions
from bench.netlab.run_plan import scaled
from xmesh_plan.planner.baselines import baseline_seconds
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.verify import verify_plan


@pytest.mark.parametrize("name", ["alpa-send-recv", "alpa-allgather"])
@pytest.mark.parametrize("case_name", ["case3", "case6", "case8", "one_to_2x2"])
def test_baselines_become_verified_plans_that_scale(case, case_name, name):
    problem = case(case_name)
    plan = baseline_plan(problem, name)
    verify_plan(plan)
    verify_plan(scaled(plan, 1))
    assert plan.predicted_seconds == pytest.approx(baseline_seconds(problem, name))


def test_unknown_baseline_lists_the_valid_names(case):
    with pytest.raises(ValueError, match="alpa-send-recv, alpa-allgather"):
        baseline_plan(case("case3"), "alpa")
    with pytest.raises(ValueError, match="'per-rank-broadcast' is simulator-only .*alpa-send-recv, alpa-allgather"):
        baseline_plan(case("case3"), "per-rank-broadcast")


def test_predictions_scale_with_the_link_rate_and_posted_never_beats_the_bound(case, compile_quick):
    plan = compile_quick(case("case3"), "broadcast", solver="naive")
    slow, fast = predictions(plan, 200), predictions(plan, 500)
    for key in slow:
        assert slow[key] == pytest.approx(fast[key] * 2.5, rel=0.01)
    assert slow["lower-bound"] <= slow["posted"] <= slow["host-order"]
    assert at_rate(plan.problem, 200).cluster.nics[0].recv_gbps == 0.2


def test_the_weight_sync_case_gives_verified_multi_tensor_plans_scaled_and_predicted():
    from bench.netlab.experiments import _plans
    from xmesh_plan.schemas.plan_tensors import is_multi

    made = dict(_plans("weight_sync_small", 500, latency_us=200))
    assert sorted(made) == ["chained", "default", "no-cross-tensor", "split-hosts"]
    assert made["default"].to_json() == compile_plan(made["default"].problem, split_hosts=True, coalesce=True).to_json()
    for plan in made.values():
        assert is_multi(plan) and plan.problem.cluster.latency_us == 200
        verify_plan(plan)
        verify_plan(scaled(plan, 0.01))  # every tensor shrunk where its boundaries allow
        p = predictions(plan, 500)
        assert p["lower-bound"] == pytest.approx(plan.lower_bound_seconds, rel=1e-6)  # the joint bound over all tensors
        assert p["lower-bound"] <= p["posted"] + 1e-9


def test_reference_cases_are_planned_on_the_tensor_that_runs():
    """With max_mb the case is compiled on the shrunk tensor (chunk counts fit its bytes), with the same boxes
    as the full-size plan shrunk by the executor, and the testbed's message costs in its cluster."""
    from bench.netlab.experiments import _plans

    small = dict(_plans("case7", 500, latency_us=200, overhead_us=30, max_mb=16))
    full = dict(_plans("case7", 500, latency_us=200, overhead_us=30))
    for label in ("ours", "naive", "alpa-send-recv"):
        plan = small[label]
        verify_plan(plan)
        assert plan.problem.nbytes <= 16 * 2**20 < full[label].problem.nbytes
        assert (plan.problem.cluster.latency_us, plan.problem.cluster.overhead_us) == (200, 30)
        assert sorted(op.region for op in plan.operations) == sorted(op.region for op in scaled(full[label], 16).operations)
    assert max(op.chunks for op in small["ours"].operations) < max(op.chunks for op in full["ours"].operations)


def test_plan_bytes_per_testbed_host_and_the_one_percent_check(case, compile_quick):
    plan = compile_quick(case("case3"))
    assert ranks_per_host(plan) == (4, 4, 4, 4)
    links = predicted_links(plan, reshards=2)
    assert [links[h].sent for h in range(4)] == [2**31, 2**31, 0, 0]  # case 3: each source host sends 1 GiB per reshard
    assert [links[h].received for h in range(4)] == [0, 0, 2**31, 2**31]
    ok = HostBytes(0, LinkBytes(1000, 0), LinkBytes(995, 0))
    short = HostBytes(1, LinkBytes(994, 0), LinkBytes(995, 0))
    over = HostBytes(2, LinkBytes(1020, 0), LinkBytes(995, 0))
    assert within([ok], 0.01, 0) == []
    assert len(within([short, over], 0.01, 0)) == 2


def test_a_case_runs_each_distinct_plan_once_and_every_solver_gets_a_row(monkeypatch):
    """Solvers that find the same operations share one launch slot; their rows point at the first."""
    from types import SimpleNamespace

    import bench.netlab.experiments as experiments
    from bench.netlab.run_plan import RunOptions
    from bench.netlab.testbed import LinkShape

    launched = []

    def fake_run(plans, opts):
        launched.extend(plans)
        times = [0.1 + i / 100 for i in range(len(plans))]
        return SimpleNamespace(plans=plans, median_s=times, min_s=times, checked=True, ok=True, hosts=[], retransmits={})

    monkeypatch.setattr(experiments, "run_plans", fake_run)
    run = experiments.run_case("case3", 500, RunOptions(LinkShape(500, 9000), 1.0, 1, 0), latency_us=200, overhead_us=30)
    rows = {r["approach"]: r for r in run["rows"]}
    assert set(rows) == {label for label, _, _ in experiments.APPROACHES}
    ops = [p.model_dump_json(include={"operations"}) for p in launched]
    assert len(set(ops)) == len(ops) == len(rows) - sum("same_as" in r for r in rows.values())
    for r in rows.values():
        if "same_as" in r:
            twin = rows[r["same_as"]]
            assert "same_as" not in twin and r["measured_s"] == twin["measured_s"]


def test_plans_made_with_the_testbed_cpu_chunk_more_and_are_also_priced_on_links_alone():
    """`experiments --plan-cpu`: the plans carry the CPU (case 9's relays copy at the CPU's rate, so more chunks);
    `predictions` without a CPU prices them as if they had none, with it as the CPU model says."""
    from bench.netlab.experiments import _arguments, _plans
    from bench.netlab.predict import TESTBED_CPU

    links = dict(_plans("case9", 500, latency_us=0, overhead_us=250, max_mb=32))["ours"]
    cpu = dict(_plans("case9", 500, latency_us=0, overhead_us=250, max_mb=32, cpu=TESTBED_CPU))["ours"]
    verify_plan(cpu)
    assert links.problem.cluster.cpu is None and cpu.problem.cluster.cpu == TESTBED_CPU
    assert max(op.chunks for op in cpu.operations) > max(op.chunks for op in links.operations)
    bare = cpu.model_copy(update={"problem": links.problem})  # the same operations on a cluster without the CPU
    assert predictions(cpu, 500) == predictions(bare, 500)
    assert predictions(cpu, 500, TESTBED_CPU) == predictions(bare, 500, TESTBED_CPU)
    assert predictions(cpu, 500, TESTBED_CPU)["device-order"] < predictions(links, 500, TESTBED_CPU)["device-order"]
    assert _arguments(["--plan-cpu"]).plan_cpu and not _arguments([]).plan_cpu
    with pytest.raises(SystemExit):
        _arguments(["--max-run-gib", "0"])


def test_no_receipts_is_a_torch_option(capsys):
    """`experiments --no-receipts` runs torch ranks without the engine's receipts (bench.netlab.no_receipts); the MPI
    engine has none to turn off, so asking it of MPI is a usage error that names the fix."""
    from bench.netlab.experiments import _arguments, _meta

    args = _arguments(["--engine", "torch", "--no-receipts"])
    assert args.no_receipts and "--no-receipts" in _meta(args, None)["command"] and _meta(args, None)["receipts"] is False
    assert _meta(_arguments(["--engine", "torch"]), None)["receipts"] is True
    with pytest.raises(SystemExit) as stop:
        _arguments(["--no-receipts"])
    assert stop.value.code == 2 and "use it with --engine torch" in capsys.readouterr().err


def test_the_summary_reads_a_results_file_that_is_still_being_written(tmp_path):
    """`experiments` writes its results after each case with no load average yet; `summary --compact` still reads it."""
    import json

    from bench.netlab.summary import compact

    row = {"approach": "ours", "measured_s": 0.3, "min_s": 0.3, "strategy": "broadcast", "solver": "auto", "ops": 4,
           "predicted_s": {"device-order": 0.28, "host-order": 0.28, "posted": 0.28, "lower-bound": 0.27}}
    run = {"case": "case9", "rate_mbit": 500, "order": "device", "rows": [row], "ok": True, "checked": True,
           "links": [{"host": 0, "sent": 101, "received": 0, "predicted_sent": 100, "predicted_received": 0}]}
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"meta": {"command": "x", "loadavg_after": None, "order": "device"}, "runs": [run]}))
    text = compact([path])
    assert "had not finished" in text and "| case9 | 500 | device | 300 | 1.111 |" in text


def test_the_first_come_rules_serve_a_send_side_one_message_at_a_time():
    """`bench.netlab.sharing`'s rules as `run_flows(share=...)`: two 1 MB messages leave one host at once. Max-min: both
    arrive at 2 ms on a 1 GB/s side. First come at send sides: the first at 1 ms, the second at 2 ms; two messages from
    different hosts into one receive side still share it (both at 2 ms)."""
    from bench.netlab.first_come import FirstCome
    from bench.netlab.sharing import rule_table
    from xmesh_plan.planner.simulate import Flow, run_flows

    cap = {"h0.send:0": 1e9, "h1.send:0": 1e9, "h2.recv:0": 1e9, "h3.recv:0": 1e9}
    one_side = [Flow(0, 0, 1e6, 0.0, ("h0.send:0", "h2.recv:0")), Flow(1, 1, 1e6, 0.0, ("h0.send:0", "h3.recv:0"))]
    into_one = [Flow(0, 0, 1e6, 0.0, ("h0.send:0", "h2.recv:0")), Flow(1, 1, 1e6, 0.0, ("h1.send:0", "h2.recv:0"))]

    def arrivals(flows, rule="max-min", **kw):
        make = rule_table(rule, **kw).get("posted")
        spans = run_flows(flows, cap, share=make()) if make else run_flows(flows, cap)
        return sorted(round(end * 1e3, 6) for _, end in spans.values())

    assert arrivals(one_side) == [2.0, 2.0]
    assert arrivals(one_side, "first-come-send") == [1.0, 2.0]
    assert arrivals(into_one, "first-come-send") == [2.0, 2.0]
    assert arrivals(into_one, "first-come-all") == [1.0, 2.0]
    assert arrivals(one_side, "first-come-send-small", small_mib=0.5) == [2.0, 2.0]  # 1 MB is not small: max-min
    assert arrivals(one_side, "first-come-send-short", short_ms=0.5) == [2.0, 2.0]  # 1 ms at 1 GB/s: not short
    assert arrivals(one_side, "first-come-send-short", short_ms=1.1) == [1.0, 2.0]  # short at this rate: first come
    # the first message is held to 0.25 GB/s by a slow receive side; the second takes the 0.75 GB/s it leaves
    slow = cap | {"h2.recv:0": 0.25e9}
    assert FirstCome(("send",))(one_side, slow) == pytest.approx({0: 0.25e9, 1: 0.75e9})
    assert FirstCome(("send",))(one_side, cap) == pytest.approx({0: 1e9, 1: 1e-9})  # the second waits its turn
    with pytest.raises(ValueError, match="unknown sharing rule 'fair'; choose one of: testbed, max-min, first-come-send"):
        rule_table("fair")


def test_sharing_prices_with_gloos_send_buffer_when_asked_and_refuses_a_bad_size(monkeypatch, capsys):
    """`sharing --send-buffer-mib`: each prediction gets the buffer in bytes (None without the option: the MPI rule);
    a size that is not positive is refused in one line naming the option."""
    from bench.netlab import sharing

    seen = []

    def predictions(plan, rate, cpu=None, sharing=None, send_buffer_bytes=None):
        seen.append(send_buffer_bytes)
        return {}

    monkeypatch.setattr(sharing, "predictions", predictions)
    sharing.priced_by("testbed", send_buffer_mib=1.5)(None, 500)
    sharing.priced_by("max-min")(None, 500)
    assert seen == [1.5 * 2**20, None]
    with pytest.raises(SystemExit) as stop:
        sharing.main(["results.json", "--send-buffer-mib", "0"])
    assert stop.value.code == 2 and "--send-buffer-mib 0: give a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("mib,first_come", [(0.5, True), (4.0, False)])
def test_the_testbed_model_serves_a_hosts_short_messages_first_come_in_device_order_only(mib, first_come, compile_quick):
    """`predict.simulated`: two ranks of one host each send `mib` to another host at once, at 500 Mbit/s. In device
    order a message of at most `TESTBED_SHORT_MS` at the link's rate (0.5 MiB: 8.4 ms) goes first come: one arrives
    after t, the other after 2t; a longer one (4 MiB: 67 ms) shares max-min, both at 2t. Posted order always shares."""
    from bench.netlab.predict import TESTBED_SHORT_MS, simulated, testbed_problem
    from xmesh_plan.schemas import Cluster, DeviceMesh, Placement, ReshardingProblem

    side = int(mib * 2**20 / 4)
    problem = ReshardingProblem(shape=(2, side), dtype="int32", cluster=Cluster(devices_per_host=2, latency_us=0.0, overhead_us=0.0),
                                src=Placement(mesh=DeviceMesh(shape=(1, 2), devices=(0, 1)), spec="S1 R"),
                                dst=Placement(mesh=DeviceMesh(shape=(2, 1), devices=(2, 4)), spec="S0 R"))
    plan = compile_quick(problem, "send_recv")
    assert sorted((op.src, op.dsts) for op in plan.operations) == [(0, (2,)), (1, (4,))]
    t = mib * 2**20 / (500e6 / 8)
    assert (t <= TESTBED_SHORT_MS / 1e3) == first_come
    on_testbed = testbed_problem(plan, 500)
    device = simulated(plan, on_testbed, "device-order")
    posted = simulated(plan, on_testbed, "posted")
    assert sorted(device.op_end_s.values()) == pytest.approx([t, 2 * t] if first_come else [2 * t, 2 * t], rel=1e-6)
    assert sorted(posted.op_end_s.values()) == pytest.approx([2 * t, 2 * t], rel=1e-6)
    with pytest.raises(ValueError, match=r"unknown queueings \['device'\]; use host-order, device-order, posted"):
        simulated(plan, on_testbed, "device-order", {"device": lambda: None})


def test_steptrace_times_an_operation_from_its_first_send_and_needs_two_timed_reshards():
    """`bench.netlab.steptrace.op_times`: a receive posted early does not start an operation (its first send does);
    the table's reshard is the last timed one before the checked one, so fewer than three reshards is an error."""
    from bench.netlab.steptrace import op_times

    def rank(device, action, peer, launch, finish, reshards=3, engine="mpi"):
        steps = [{"op": 0, "action": action, "peer": peer, "nbytes": 8, "piece": ""}]
        return [{"device": device, "engine": engine, "steps": steps,
                 "reshards": [{"start": 10.0 * k, "launch": [10.0 * k + launch],
                               "finish": [None if finish is None else 10.0 * k + finish]} for k in range(reshards)]}]

    traces = [rank(0, "send", 1, 0.5, 2.0), rank(1, "recv", 0, 0.0, 2.5)]
    per_op, per_device = op_times(traces)
    assert per_op == {0: pytest.approx((0.5, 2.5))}
    assert per_device[(0, 1)] == pytest.approx((2.5, 2.5)) and per_device[(0, 0)] == pytest.approx((0.5, 2.0))
    with pytest.raises(ValueError, match="run a warm-up and at least 2 timed ones"):
        op_times([rank(0, "send", 1, 0.5, 2.0, reshards=2), rank(1, "recv", 0, 0.0, 2.5, reshards=2)])
    # the torch engine finishes a send no step waits for after the rest: its launch alone marks the start; an MPI send
    # without a finish (a rank that failed) marks nothing
    per_op, _ = op_times([rank(0, "send", 1, 0.5, None, engine="torch"), rank(1, "recv", 0, 0.0, 2.5, engine="torch")])
    assert per_op == {0: pytest.approx((0.5, 2.5))}
    per_op, _ = op_times([rank(0, "send", 1, 0.5, None), rank(1, "recv", 0, 0.0, 2.5)])
    assert per_op == {0: pytest.approx((2.5, 2.5))}


def test_experiments_stop_with_one_line_naming_the_case_over_the_byte_bound(tmp_path, capsys, monkeypatch):
    """A case whose plans would move more than `--max-run-gib` stops the sweep before it launches anything (so no
    namespace is needed here), with one line that names the case and the fix, and no results file (no case ran)."""
    from bench.netlab import experiments

    monkeypatch.setattr(experiments, "unavailable_reason", lambda: None)
    out = tmp_path / "sweep.json"
    code = experiments.main(["--cases", "one_to_1x2", "--rates", "500", "--max-mb", "8", "--latency-us", "200,40",
                             "--max-run-gib", "0.01", "--no-markdown", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: one_to_1x2 at 500 Mbit/s: these plans would move ") and err.count("\n") == 1
    assert "raise the bound: experiments --max-run-gib" in err and "Traceback" not in err
    assert not out.exists()


def test_a_sweep_refused_after_a_case_ran_keeps_that_run_and_says_where_it_stopped(tmp_path, capsys, monkeypatch):
    """When a later case is refused, the results file keeps the runs before it and names where the sweep stopped
    (its command lists every case, so without that line the file would claim cases it does not hold)."""
    import json
    from types import SimpleNamespace

    from bench.netlab import experiments
    from bench.netlab.counters import HostBytes, LinkBytes
    from bench.netlab.run_plan import PlansRefusedError

    def fake_run(plans, opts):
        if fake_run.calls:
            raise PlansRefusedError("these plans would move 9.9 GiB; raise the bound: experiments --max-run-gib 10")
        fake_run.calls += 1
        times = [0.1] * len(plans)
        hosts = [HostBytes(0, LinkBytes(2**20, 0), LinkBytes(2**20, 0)), HostBytes(1, LinkBytes(0, 2**20), LinkBytes(0, 2**20))]
        return SimpleNamespace(plans=plans, median_s=times, min_s=times, checked=True, ok=True, hosts=hosts, retransmits={})

    fake_run.calls = 0
    monkeypatch.setattr(experiments, "unavailable_reason", lambda: None)
    monkeypatch.setattr(experiments, "run_plans", fake_run)
    out = tmp_path / "sweep.json"
    code = experiments.main(["--cases", "one_to_1x1,one_to_1x2", "--rates", "500", "--max-mb", "1", "--latency-us", "200,40",
                             "--no-markdown", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: one_to_1x2 at 500 Mbit/s: these plans would move 9.9 GiB") and f"in {out}" in err
    saved = json.loads(out.read_text())
    assert saved["meta"]["stopped_at"] == "one_to_1x2 at 500 Mbit/s"
    assert [run["case"] for run in saved["runs"]] == ["one_to_1x1"]
