"""The emulated cluster (bench/netlab): a 2-host testbed runs a plan bit-exact over shaped links, and leaves nothing behind.

Needs root and network namespaces (CI runs as root); skips with the reason elsewhere. Timeouts are
generous and only catch hangs: nothing here asserts a time.
"""

from __future__ import annotations

import doctest
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench.netlab import counters, testbed as tb
from bench.netlab.launch import MPIEXEC, ranks_per_host
from bench.netlab.run_plan import RunOptions, run_plan
from tests.support.builders import compile_fast, make_problem
from tests.support.launch import ROOT
from tests.support.wait import wait_until

REASON = tb.unavailable_reason() if os.name == "posix" else "network namespaces are Linux only"
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=str(REASON)),
              pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)")]
RUN_TIMEOUT_S = 600  # catches a hang only; a passing run takes a few seconds
CONTROL_SLACK = 8 * 2**20  # launcher and MPI wire-up traffic share the links with the plan's bytes


def ours(name: str) -> list[str]:
    return [n for n in tb.existing_namespaces() if n.startswith(name)]


def two_host_plan():
    """4 MiB from host 0's two devices to host 1's two, re-split along another dim: every byte crosses the link."""
    problem = make_problem((128, 128, 64), "1x2", "S1 R R", "1x2", "R S1 R", dtype="int32",
                           cluster={"devices_per_host": 2}, name="netlab-smoke")
    return compile_fast(problem)


@pytest.mark.parametrize("engine, order, single_copy, module, says", [
    ("mpi", "posted", False, None, "check ok: 2 destination shards bit-exact"),
    ("mpi", "device", True, None, "check ok: 2 destination shards bit-exact"),  # MPICH's single copy inside a host
    ("torch", "device", False, None, "check ok: every destination shard bit-exact"),  # 1 MiB messages: with receipts
    ("torch", "device", False, "bench.netlab.no_receipts", "check ok: every destination shard bit-exact")])
def test_two_hosts_run_a_plan_bit_exact_and_links_carry_its_bytes(engine, order, single_copy, module, says):
    plan = two_host_plan()
    assert ranks_per_host(plan) == (2, 2)
    opts = RunOptions(tb.LinkShape(rate_mbit=500), max_mb=4, iters=2, warmup=1, timeout_s=RUN_TIMEOUT_S, engine=engine, order=order,
                      single_copy=single_copy, module=module)
    result = run_plan(plan, opts)
    assert result.ok, result.launch.stderr[-3000:]
    assert says in result.launch.stdout, result.launch.stdout
    assert [row.predicted.sent for row in result.hosts] == [3 * 4 * 2**20, 0]
    assert counters.within(result.hosts, rel=0.01, slack_bytes=CONTROL_SLACK) == []
    assert result.run_id and ours(result.run_id) == []


def test_single_copy_reaches_every_rank_of_every_host():
    """`--single-copy` puts MPICH's CMA switch in the environment mpiexec hands every rank (`-genv`)."""
    from bench.netlab.launch import SINGLE_COPY_ENV, mpiexec_command

    bed = types.SimpleNamespace(hosts=2, bridge_ns="b", bridge_addr="10.0.0.1")
    for single_copy in (False, True):
        cmd = mpiexec_command(bed, two_host_plan(), Path("/launcher"), ["-m", "x"], single_copy)
        pairs = {(cmd[i + 1], cmd[i + 2]) for i, a in enumerate(cmd) if a == "-genv"}
        assert (set(SINGLE_COPY_ENV.items()) <= pairs) == single_copy


def test_testbed_shapes_both_directions_and_is_removed_after_an_error():
    link = tb.LinkShape(rate_mbit=300, mtu=1500)
    with pytest.raises(RuntimeError, match="boom"):
        with tb.testbed(2, link) as bed:
            assert sorted(ours(bed.run_id)) == sorted(bed.namespaces)
            for ns, dev in [(bed.host_ns(0), "eth0"), (bed.bridge_ns, "v0"), (bed.host_ns(1), "eth0"), (bed.bridge_ns, "v1")]:
                shown = subprocess.run([tb.TC, "-n", ns, "class", "show", "dev", dev], capture_output=True, text=True).stdout
                assert "rate 300Mbit" in shown, (ns, dev, shown)
            assert "inet 10.99.0.1/24" in subprocess.run([tb.IP, "-n", bed.host_ns(0), "addr"], capture_output=True, text=True).stdout
            raise RuntimeError("boom")
    assert ours(bed.run_id) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "ctrl-c"])
def test_sigterm_or_ctrl_c_removes_the_testbed_and_its_processes(sig):
    """A run killed politely (SIGTERM, as a CI timeout sends) or by Ctrl-C removes its namespaces and the processes
    inside them; Ctrl-C also after a C library reset SIGINT to its default behind Python's back (as CP-SAT did)."""
    code = ("import ctypes, signal, time; from bench.netlab import testbed as tb  # the repository root is the working directory\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even if pytest started with it ignored\n"
            "ctypes.CDLL(None).signal(2, None)  # SIGINT to SIG_DFL in the kernel; Python still thinks its handler is set\n"
            "with tb.testbed(2, tb.LinkShape(100)) as bed:\n"
            "    import subprocess; subprocess.Popen([tb.IP, 'netns', 'exec', bed.host_ns(1), 'sleep', '600'])\n"
            "    print(bed.run_id, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id and len(ours(run_id)) == 3
        # the sleeper enters its namespace a moment after Popen returns
        sleeper = wait_until(lambda: tb.namespace_pids(f"{run_id}-h1"), "the sleeper in host 1's namespace")
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:  # a failed assert must not leave the child (and its testbed) for 600 s
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    assert ours(run_id) == []
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") and _not_zombie(pid) for pid in sleeper),
               "the sleeper in the removed namespace to end", timeout_s=30)


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_stale_namespaces_of_dead_runs_are_cleaned_and_live_ones_kept():
    dead_pid = 2**22 + 12345  # above the kernel's pid_max, so no process has it
    dead = tb.Testbed(run_id=f"{tb.PREFIX}{dead_pid}x0abc", hosts=1, link=tb.LinkShape(100))
    live = tb.Testbed(run_id=tb.new_run_id(), hosts=1, link=tb.LinkShape(100))
    try:
        tb.build(dead)
        tb.build(live)
        removed = tb.clean_stale()
        assert sorted(dead.namespaces) == sorted(n for n in removed if n.startswith(dead.run_id))
        assert sorted(ours(live.run_id)) == sorted(live.namespaces)
    finally:
        tb.teardown(dead)
        tb.teardown(live)


def test_docstring_examples():
    assert doctest.testmod(tb, report=False).failed == 0


def test_the_doc_commands_that_need_no_root_run_as_shown_without_pythonpath():
    """docs/netlab.md shows its commands as they run from the repository root: `python -m` finds `bench` there."""
    lines = [line[2:].split("  #")[0] for line in (ROOT / "docs" / "netlab.md").read_text().splitlines() if line.startswith("$ ")]
    assert lines and not [line for line in lines if "PYTHONPATH" in line]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    shown = [line.split() for line in lines if line.startswith(".venv/bin/python -m bench.netlab.")]
    assert len(shown) == 2  # summary and repredict; the others need root for the testbed
    for words in shown:
        done = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and "| case" in done.stdout, done.stderr[-2000:]


def test_the_message_cost_probe_compiles_its_plan(monkeypatch):
    """`experiments` and `steptrace` (the commands docs/netlab.md shows) start by timing one tiny send-recv message;
    the probe's plan is compiled here, the launch faked (no testbed needed)."""
    from bench.netlab import experiments
    from bench.netlab.testbed import LinkShape

    launched = []

    def fake_run_plans(plans, opts):
        launched.append((plans, opts))
        return types.SimpleNamespace(ok=True, median_s=[250e-6])

    monkeypatch.setattr(experiments, "run_plans", fake_run_plans)
    assert experiments.measure_message_costs(RunOptions(LinkShape(500))) == (0.0, 250.0)
    (plan,), opts = launched[0]
    assert [op.kind for op in plan.operations] == ["send"] and opts.iters == 30  # one message, timed 30 times


@pytest.mark.parametrize("engine", ["mpi", "torch"])
def test_steptrace_times_every_step_on_one_clock(engine):
    """bench.netlab.steptrace: every step of every rank is launched and finished, and a message never lands before its
    sender started it (the ranks' clocks are one), so the per-operation table it sets against the model is real. The
    torch engine finishes a send no step waits for only after the rest, so such a send has only its launch timed."""
    from bench.netlab.steptrace import compare, op_times, traced_run
    from xmesh_plan.executor.ranks import plan_devices
    from xmesh_plan.schemas.geometry import region_size

    plan = two_host_plan()
    opts = RunOptions(tb.LinkShape(rate_mbit=500), max_mb=4, iters=2, warmup=1, timeout_s=RUN_TIMEOUT_S, order="device",
                      engine=engine)
    result, traces = traced_run(plan, opts)
    assert result.ok and result.checked, result.launch.stderr[-3000:]
    assert sorted(t[0]["device"] for t in traces) == sorted(plan_devices(plan))
    sent: dict[tuple, float] = {}
    for t in traces:
        run = t[0]
        assert len(run["reshards"]) == 3  # warm-up, two timed
        times = run["reshards"][-2]
        for s, launched, finished in zip(run["steps"], times["launch"], times["finish"]):
            if engine == "torch" and s["action"] == "send" and finished is None:
                assert launched is not None, s
                finished = launched
            assert launched is not None and finished is not None and launched <= finished, s
            if s["action"] == "send":
                sent[(run["device"], s["peer"], s["op"], s["piece"])] = launched
    for t in traces:
        run = t[0]
        for s, finished in zip(run["steps"], run["reshards"][-2]["finish"]):
            if s["action"] == "recv":
                assert finished >= sent[(s["peer"], run["device"], s["op"], s["piece"])], s
    per_op, _ = op_times(traces)
    assert sorted(per_op) == sorted(op.id for op in plan.operations)
    for op in plan.operations:  # every op crosses the 500 Mbit/s link: none ends before half its bytes could (htb's burst)
        nbytes = plan.problem.itemsize * region_size(op.region)
        assert per_op[op.id][1] >= 0.5 * nbytes * 8 / 500e6, (op, per_op[op.id])
    table = compare(plan, traces, 500, "device")
    assert len([line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]) == len(plan.operations)

