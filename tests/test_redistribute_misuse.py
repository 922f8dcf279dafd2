"""`xmesh_plan.redistribute` misused on 4 gloo ranks: every misuse fails on every rank with one line, or works.

tests/workers/redistribute_misuse_worker.py does the calls; these tests compare what the ranks print. Each
launch is bounded (a rank that hangs is killed and the test fails) and keeps tensors small.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.launch import ROOT, free_port, run_ranks

WORKER = ROOT / "tests" / "workers" / "redistribute_misuse_worker.py"
RANKS = 4
LAUNCH_TIMEOUT_S = 300  # a hang only: 4 ranks importing torch on a loaded 2-core machine take a while
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)]


def launch(*args: str) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each of 4 ranks of the worker; every rank is killed after the deadline."""
    reinit = ",".join(str(free_port()) for _ in range(2))
    return run_ranks(RANKS, WORKER, *args, env={"REINIT_PORTS": reinit}, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def main_lines() -> dict[str, list[str]]:
    """Every scenario of the worker's `main` mode, once: scenario name -> the 4 ranks' lines, rank prefix removed."""
    runs = launch("main")
    assert not [(code, err[-3000:]) for code, _, err in runs if code], [(code, err[-3000:]) for code, _, err in runs]
    lines: dict[str, list[str]] = {}
    for _, out, _ in runs:
        for line in out.splitlines():
            if line.startswith("rank "):
                text = line.split(": ", 1)[1]
                lines.setdefault(text.split(": ", 1)[0], []).append(text.split(": ", 1)[1])
    return lines


def same_everywhere(lines: dict[str, list[str]], name: str) -> str:
    assert len(lines.get(name, [])) == RANKS, (name, lines.get(name))
    assert len(set(lines[name])) == 1, lines[name]
    return lines[name][0]


def test_two_asynchronous_moves_over_the_same_ranks_do_not_mix(main_lines):
    assert same_everywhere(main_lines, "back_to_back") == "ok"


def test_a_rank_that_only_sends_waits_for_its_sends(main_lines):
    """Its result waited for, it overwrites its source shard; the (slow) receivers still get the right bytes."""
    assert same_everywhere(main_lines, "sender_waits") == "ok"


@pytest.mark.parametrize("name, message", [
    ("mesh_is_a_list", "FrontendError: redistribute: dst_mesh is a list; pass a DeviceMesh"),
    ("placements_not_a_list", "FrontendError: redistribute: dst_placements is a Shard; pass a list with one placement per mesh dim"),
    ("too_many_placements", "FrontendError: dst_placements: 2 placements for a 1-d mesh; give one per mesh dim"),
    ("partial", "FrontendError: dst_placements[0]: P(sum) holds partial values"),
    ("dim_out_of_range", "FrontendError: dst_placements[0]: S(2) names tensor dim 2 but the tensor has 2 dims"),
    ("cluster_not_a_cluster", "FrontendError: redistribute: cluster is a str; pass an xmesh_plan.schemas.Cluster or None"),
    ("async_not_bool", "FrontendError: redistribute: async_op is a str; pass True or False"),
    ("scalar_sharded", "FrontendError: dst_placements[0]: S(0) on a 0-dim tensor (a scalar)"),
])
def test_bad_arguments_fail_on_every_rank_with_the_same_line(main_lines, name, message):
    line = same_everywhere(main_lines, f"bad {name}")
    assert line.startswith(message) and "\n" not in line, line


def test_bad_arguments_make_no_process_group(main_lines):
    assert same_everywhere(main_lines, "bad groups made") == "0 0"


def test_a_wrong_local_shard_on_one_rank_fails_on_every_rank(main_lines):
    line = same_everywhere(main_lines, "wrong_local_shard")
    assert line.startswith("FrontendError: redistribute: the local shard of rank 1 does not match the DTensor's spec "
                           "(rank 1 must hold shape (3, 6) float32 of the global (7, 6) under [Shard(dim=0)])"), line


def test_requires_grad_on_one_rank_fails_on_every_rank_before_the_backward(main_lines):
    line = same_everywhere(main_lines, "grad_on_one_rank")
    assert line.startswith("FrontendError: redistribute: requires_grad (with grad mode on) is True on rank 0 but False on "
                           "ranks 1,2,3"), line


def test_a_rank_called_with_another_layout_fails_on_every_rank(main_lines):
    line = same_everywhere(main_lines, "other_layout_on_one_rank")
    assert line.startswith("FrontendError: redistribute: rank 3 called it with another shape, dtype, mesh, placements "
                           "or cluster than the other ranks of both meshes"), line


def test_a_scalar_moves_and_backpropagates(main_lines):
    assert same_everywhere(main_lines, "scalar") == "ok"


def test_the_cache_does_not_keep_the_source_shard_alive_and_clear_cache_empties_it(main_lines):
    assert same_everywhere(main_lines, "freed") == ("source kept alive (sync, async): [False, False]; after clear_cache "
                                                    "(executors, groups, pending, executors alive): (0, 0, 0, 0)")


def test_a_layout_the_cache_holds_is_never_compiled_again(main_lines):
    """20 layouts cycled three times with set_cache_size(20): 20 compiles (the default 16 compiled all 60 calls)."""
    assert same_everywhere(main_lines, "cycled") == "compiles 20, distinct 20, kept 20"


def test_set_cache_size_refuses_a_size_below_one():
    from xmesh_plan.redistribute import FrontendError, set_cache_size

    with pytest.raises(FrontendError, match="set_cache_size: size=0; give a whole number of layouts to keep, at least 1"):
        set_cache_size(0)


def test_caches_stay_bounded_and_a_move_dropped_on_some_ranks_runs_again(main_lines):
    sizes = [tuple(map(int, line.split()[1:])) for line in main_lines["bounded"]]
    assert len(sizes) == RANKS and all(executors <= 3 and problems <= 5 and pending <= 2 for executors, problems, pending in sizes)


def test_under_no_grad_the_result_does_not_require_grad_and_can_be_moved_on_unwaited(main_lines):
    """A regression guard: this held before issue 10's changes too (they moved where requires_grad is read)."""
    assert same_everywhere(main_lines, "no_grad") == "requires_grad False"


def test_a_move_that_broke_on_one_rank_fails_on_every_rank_of_the_move_until_clear_cache(main_lines):
    lines = main_lines["broken"]
    message = ("ExecutorError: redistribute: this move failed earlier on rank 2 (that error says why); "
               "call xmesh_plan.redistribute.clear_cache() on every rank before moving again")
    assert lines.count(message) == 3 and lines.count("no error") == 1, lines  # rank 3 is in neither mesh


def test_moves_run_again_after_the_process_group_is_made_again(main_lines):
    assert same_everywhere(main_lines, "reinit") == "ok"


def test_a_failed_asynchronous_move_raises_on_every_use():
    """Rank 0 dies as the move starts: ranks 2 and 3, which wait on its bytes, raise on each of 4 uses of the result."""
    runs = launch("die")
    lines = sorted(line for _, out, _ in runs for line in out.splitlines() if line.startswith("rank "))
    assert [line for line in lines if "uses raised" in line] == [
        "rank 2: uses raised 4 of 4: ['PeerTimeoutError']", "rank 3: uses raised 4 of 4: ['PeerTimeoutError']"], lines


def test_unwaited_asynchronous_moves_finish_at_exit_without_warnings():
    """Ranks that only send exit at once while the receivers are slow; one receiver never touches its result."""
    runs = launch("exit")
    assert [code for code, _, _ in runs] == [0] * RANKS, [err[-2000:] for _, _, err in runs]
    assert all(out.strip() == f"rank {rank}: exiting" for rank, (_, out, _) in enumerate(runs)), runs
    for _, _, err in runs:
        assert "unwaited" not in err and "terminate called" not in err, err[-2000:]


def test_bench_results_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """The benchmark writes its JSON through a temporary file: when the final rename fails, the last results stay."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_redistribute", ROOT / "bench" / "bench_redistribute.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "redistribute.json"
    bench.save([{"move": "handoff"}], out)
    assert json.loads(out.read_text()) == [{"move": "handoff"}]

    def refuse(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        bench.save([{"move": "same_ranks"}], out)
    assert json.loads(out.read_text()) == [{"move": "handoff"}] and [p.name for p in tmp_path.iterdir()] == [out.name]
