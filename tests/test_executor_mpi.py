"""Multi-rank executor tests: real `mpiexec` launches on scaled paper plans, planner cases and faults."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xmesh_plan.schemas import load_plan
from tests.support.cases import DEVICES, all_fixed_plans, compiled, fixed_problems, random_problem, with_chunks, write_plans
from tests.support.launch import EXECUTOR_WORKER as WORKER, MPI_LAUNCH_TIMEOUT_S, MPIEXEC, mpiexec, mpiexec_programs

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)"),
              pytest.mark.timeout(2 * MPI_LAUNCH_TIMEOUT_S)]  # above the launch's own limit, so that limit reports first


REFERENCE_GROUPS = {  # world size -> reference plans that need exactly that many ranks
    16: ["case1", "case2", "case3", "case4", "case5", "case9"],
    12: ["case7", "case8"],
    20: ["case6"],
    9: ["one_to_4x2"],
    4: ["one_to_1x3"],
}


@pytest.mark.parametrize("ranks", sorted(REFERENCE_GROUPS))
def test_reference_plans_scaled_check_bit_exact(ranks):
    paths = [PLANS / f"{name}.plan.json" for name in REFERENCE_GROUPS[ranks]]
    if not all(p.exists() for p in paths):
        pytest.skip("reference plans not compiled yet; run `make plans`")
    assert all(len(set(load_plan(p).problem.src.mesh.devices) | set(load_plan(p).problem.dst.mesh.devices)) == ranks for p in paths)
    result = mpiexec(ranks, "-m", "xmesh_plan.executor.run", *map(str, paths), "--check", "--max-mb", "1", "--iters", "2", "--warmup", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [l for l in result.stdout.splitlines() if "check ok" in l]
    assert len(lines) == len(paths), result.stdout


def _checked_plans():
    return all_fixed_plans() + [compiled(random_problem(seed), "auto") for seed in range(6)]


def _iterated_plans():
    return all_fixed_plans() + [compiled(random_problem(seed), "auto") for seed in range(10, 14)]


def _relayed_plan():
    return with_chunks(compiled(fixed_problems()[3], "broadcast"), 3)  # to_fully_replicated: chains through devices 2..7


def _reversed(plan):
    return plan.model_copy(update={"operations": tuple(
        op.model_copy(update={"dsts": op.dsts[::-1]}) if op.kind == "broadcast" else op for op in plan.operations)})


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The checks below that run on 8 ranks with nothing failing, in one launch (`batch`: each job in turn, a barrier
    between): job name -> the `ok` lines it printed (its name taken out). 8 ranks importing the project (and torch)
    take longer than most of these checks on a 2-core machine."""
    folder = tmp_path_factory.mktemp("shared")
    relayed = _relayed_plan()
    jobs = [("check", "check", _checked_plans()), ("iterations", "iterations", _iterated_plans()),
            ("cross-wait", "cross-wait", [relayed, _reversed(relayed)]), ("threads", "threads", [relayed])]
    if importlib.util.find_spec("torch") is not None:
        jobs.append(("torch", "torch", _checked_plans()))
    spec = []
    for name, mode, plans in jobs:
        (folder / name).mkdir()
        spec.append({"name": name, "mode": mode, "plans": write_plans(folder / name, plans)})
    (folder / "jobs.json").write_text(json.dumps(spec))
    result = mpiexec(DEVICES, str(WORKER), "batch", str(folder / "jobs.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    out: dict[str, str] = {name: "" for name, _, _ in jobs}
    for line in result.stdout.splitlines():
        name, _, rest = line.partition(": ")
        if name in out:
            out[name] += rest + "\n"
    return out


def test_planner_cases_every_strategy_uneven_and_overlapping(shared):
    """Fixed cases x 4 strategies (+ chunked broadcasts) and seeded random cases, via run(), start/wait and DLPack."""
    assert shared["check"].count("ok ") == len(_checked_plans()), shared["check"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (pip install torch==2.13.0 to run it)")
def test_cpu_torch_tensors_bfloat16_included(shared):
    """Real torch tensors in, through DLPack without a copy; bfloat16 ones through a same-size integer view."""
    plans = _checked_plans()
    assert any(p.problem.dtype == "bfloat16" for p in plans)
    assert shared["torch"].count("ok ") == len(plans), shared["torch"]


def test_every_iteration_delivers_that_iterations_data(shared):
    """Persistent requests reuse buffers: 7 iterations of different data (new, re-viewed and rewritten source shards), each checked."""
    assert shared["iterations"].count("ok ") == len(_iterated_plans()), shared["iterations"]


@pytest.fixture(scope="module")
def fixed_plan_path(tmp_path_factory) -> str:
    return write_plans(tmp_path_factory.mktemp("plans"), [all_fixed_plans()[0]])[0]


def test_a_dead_rank_makes_the_others_fail_with_a_named_peer(fixed_plan_path):
    result = mpiexec(DEVICES, str(WORKER), "die", fixed_plan_path, keep_going=True)
    assert result.returncode != 0
    assert result.stderr.count("PeerTimeoutError") == DEVICES - 1, result.stderr  # ranks' lines may interleave
    named = re.findall(r"op \d+ \(task \d+, \w+[^)]*\): (?:receive|send) \d+ B (?:from|to) device 1 \(rank 1\)", result.stderr)
    assert named, result.stderr


def test_the_demo_gives_up_after_its_timeout_when_a_rank_dies(fixed_plan_path):
    """Its barriers and reductions honour --timeout (2 s here), not a fixed minute."""
    result = mpiexec(DEVICES, str(WORKER), "demo-die", fixed_plan_path, keep_going=True)
    assert result.returncode != 0
    # ranks' lines may interleave on one line, so match each report rather than split lines
    reports = re.findall(r"rank (\d+): error: .*?(?:did not finish within 2 s|nothing completed for 2 s)", result.stderr)
    assert sorted(map(int, reports)) == [r for r in range(DEVICES) if r != 1], result.stderr


HANG_S = 120  # the job ends within its --timeout (2 s) after start-up; this only catches a hang, which would otherwise last for ever


@pytest.mark.parametrize("mode,failure,status", [
    ("demo-fail-late", "rank 1: error: 00_even_disjoint_broadcast.plan.json: injected failure in close()", 2 | 3),
    ("demo-bug", "rank 1: error: 00_even_disjoint_broadcast.plan.json: unexpected ZeroDivisionError: injected bug in run()", 4 | 3),
], ids=["after-the-last-collective", "unexpected-error"])
def test_a_failure_on_one_rank_ends_the_demo(fixed_plan_path, mode, failure, status):
    """Under -disable-auto-cleanup, as docs/executor.md recommends: rank 1 failing after the demo's last collective,
    or with an unexpected error, must not leave any rank blocked in MPI_Finalize. The failing rank reports in one line,
    the others stop at their next wait (the last one is a barrier before finalize) and mpiexec returns the OR of the
    statuses (2 or 4 for rank 1, 3 for the timeouts)."""
    result = mpiexec(DEVICES, str(WORKER), mode, fixed_plan_path, keep_going=True, timeout=HANG_S)
    assert result.returncode == status, result.stderr
    assert failure in result.stderr and "Traceback" not in result.stderr, result.stderr
    others = re.findall(r"rank (\d+): error: .*?(?:did not finish within 2 s|nothing completed for 2 s)", result.stderr)
    assert sorted(map(int, others)) == [r for r in range(DEVICES) if r != 1], result.stderr


def test_the_demo_help_shows_the_launch_command_the_docs_show():
    help_text = subprocess.run([sys.executable, "-m", "xmesh_plan.executor.run", "--help"], cwd=ROOT, capture_output=True, text=True,
                               timeout=60).stdout
    launch = re.search(r"^  (mpiexec .*)$", help_text, re.M)
    assert launch and "-disable-auto-cleanup" in launch.group(1), help_text
    assert launch.group(1) in (ROOT / "docs" / "executor.md").read_text()


def test_an_exception_escaping_wait_leaves_a_refusing_executor_that_closes(fixed_plan_path):
    result = mpiexec(DEVICES, str(WORKER), "interrupt", fixed_plan_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: this executor stopped after an error (Interrupted in wait())" in result.stdout
    assert "ok interrupt" in result.stdout


def test_two_reshards_waited_in_different_orders_on_different_ranks_finish(shared):
    """Chunked broadcasts down a chain of ranks 2..7 and, in the other reshard, down the reversed chain. Even ranks
    wait for the first reshard first, odd ranks for the second: rank 3 waits for a chunk rank 4 forwards in the
    second, while rank 4 waits for one rank 3 forwards in the first."""
    assert any(op.kind == "broadcast" and len(op.dsts) > 2 for op in _relayed_plan().operations)
    assert "ok cross-wait" in shared["cross-wait"]


def test_two_executors_each_run_by_its_own_thread(shared):
    assert "ok threads" in shared["threads"]  # relays: chunks forwarded down chains


def test_a_plan_for_another_world_size_is_refused(fixed_plan_path):
    result = mpiexec(3, "-m", "xmesh_plan.executor.run", fixed_plan_path, "--check")
    assert result.returncode == 2
    assert f"run with mpiexec -n {DEVICES}" in result.stderr and "this MPI world has 3 ranks" in result.stderr
    assert result.stderr.count("error:") == 1, "only rank 0 reports an error every rank shares"


@pytest.mark.parametrize("odd_rank,other_devices", [(1, DEVICES), (1, DEVICES - 2), (0, DEVICES)])
def test_ranks_with_different_plans_are_refused_before_moving_data(tmp_path, odd_rank, other_devices):
    """The odd rank is named, rank 0 included; also when its plan is for another world size (its refusal reaches
    every rank, none waits out a timeout)."""
    a, b = write_plans(tmp_path, [compiled(random_problem(1), "auto"), compiled(random_problem(2, max_devices=other_devices), "auto")])
    result = mpiexec(DEVICES, str(WORKER), "other-plan", a, b, str(odd_rank), keep_going=True)
    assert result.returncode != 0
    expected = f"rank {odd_rank} loaded a different plan than the other {DEVICES - 1} ranks"
    assert result.stderr.count(expected) == DEVICES, result.stderr


@pytest.mark.parametrize("flags,expect", [
    (["--timeout", "0"], "--timeout 0: give a positive number of seconds"),
    (["--max-mb", "-3"], "--max-mb -3: give a positive size in MiB"),
    (["--scale", "3,3,3"], "scale factor 3 does not divide every box boundary of dim 0"),
])
def test_demo_errors_shared_by_every_rank_print_once_and_exit_2_everywhere(flags, expect):
    plan = PLANS / "one_to_1x1.plan.json"
    if not plan.exists():
        pytest.skip("reference plans not compiled yet; run `make plans`")
    result = mpiexec(2, "-m", "xmesh_plan.executor.run", str(plan), "--check", *flags)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "check ok" not in result.stdout
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and expect in result.stderr, result.stderr


def test_a_plan_file_only_one_rank_cannot_read_is_reported_by_that_rank_and_every_rank_stops(tmp_path, fixed_plan_path):
    """The failing rank is not rank 0: it prints its own error, and every rank agrees to stop before any byte moves,
    well before the 30 s timeout a silent refusal would cost."""
    bad = tmp_path / "truncated.plan.json"
    bad.write_text(Path(fixed_plan_path).read_text()[:200])
    demo = [sys.executable, "-m", "xmesh_plan.executor.run", "--timeout", "30"]
    result = mpiexec_programs(["-n", str(DEVICES - 1), *demo, fixed_plan_path], ["-n", "1", *demo, str(bad)])
    assert result.returncode == 2, result.stderr
    assert f"rank {DEVICES - 1}: error: " in result.stderr and "truncated.plan.json" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "did not finish" not in result.stderr and "nothing completed" not in result.stderr


def test_a_usage_error_on_one_rank_alone_is_reported_by_that_rank(fixed_plan_path):
    demo = [sys.executable, "-m", "xmesh_plan.executor.run", fixed_plan_path, "--timeout", "30"]
    result = mpiexec_programs(["-n", str(DEVICES - 1), *demo], ["-n", "1", *demo, "--iters", "0"])
    assert result.returncode == 2, result.stderr
    assert f"rank {DEVICES - 1}: error: --iters 0" in result.stderr, result.stderr
    assert "did not finish" not in result.stderr and "nothing completed" not in result.stderr, result.stderr


def test_help_on_one_rank_alone_ends_the_job():
    """`--help` on one rank only: that rank left before MPI started, and MPI_Init on the others waited for it for
    ever (no --timeout bounds MPI_Init). It joins the job, and every rank agrees to stop."""
    plan = PLANS / "one_to_1x1.plan.json"
    demo = [sys.executable, "-m", "xmesh_plan.executor.run", str(plan), "--timeout", "10"]
    result = mpiexec_programs(["-n", "1", *demo], ["-n", "1", *demo, "--help"], timeout=150)
    assert result.returncode == 2, result.stderr
    assert "rank 0: stopped: another rank was given --help" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "did not finish" not in result.stderr, result.stderr


@pytest.mark.parametrize("plans,options", [([], ["--iters", "2"]), ([], ["--check"]), ([str(PLANS / "weight_sync_small.plan.json")], [])],
                         ids=["iters", "check", "one-more-plan"])
def test_flags_that_differ_on_one_rank_are_refused_before_any_byte_moves(fixed_plan_path, plans, options):
    """Ranks given different --iters or --check would run different collectives and wait out the timeout, and one
    more plan on one rank hung the job for good; every rank agrees on the flags and the number of plans first."""
    demo = [sys.executable, "-m", "xmesh_plan.executor.run", fixed_plan_path]
    flags = ["--iters", "1", "--timeout", "30"]
    result = mpiexec_programs(["-n", str(DEVICES - 1), *demo, *flags], ["-n", "1", *demo, *plans, *flags, *options])
    assert result.returncode == 2, result.stderr
    assert "different flags" in result.stderr, result.stderr
    assert "did not finish" not in result.stderr and "nothing completed" not in result.stderr, result.stderr


def test_ctrl_c_on_one_rank_ends_the_job(fixed_plan_path):
    """A real SIGINT on one rank mid-run: it says so and leaves without MPI_Finalize (which would wait for ever under
    -disable-auto-cleanup); the others stop within their --timeout."""
    demo = ["-m", "xmesh_plan.executor.run", fixed_plan_path, "--iters", "50", "--timeout", "5"]
    result = mpiexec_programs(["-n", str(DEVICES - 1), sys.executable, *demo],
                   ["-n", "1", sys.executable, str(ROOT / "tests" / "workers" / "demo_interrupted.py"), *demo[2:]])
    assert f"rank {DEVICES - 1}: interrupted" in result.stderr, result.stderr
    assert result.returncode & 130 == 130, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
