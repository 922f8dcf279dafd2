"""`xmesh_plan.redistribute` moves DTensors between meshes on 4 gloo ranks, bit-exact against DTensor's
own `distribute_tensor` on the destination mesh, with gradients, a plan cache, and DTensor's own refusal
of the same call shown (tests/workers/redistribute_worker.py does the checking on every rank)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import ROOT, TORCH_LAUNCH_TIMEOUT_S as LAUNCH_TIMEOUT_S, launch

pytestmark = pytest.mark.slow


def test_redistribute_across_meshes_matches_dtensor_on_every_rank():
    lines = launch(4, "0", worker=Path(__file__).parent / "workers" / "redistribute_worker.py")
    counts = {line.split(":")[0]: int(line.split()[-1]) for line in lines if ": ok " in line}
    assert sorted(counts) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    # 4 layouts x 3 dtypes x 2 calls, on the ranks of each destination mesh, plus one gradient check per source rank
    # of case 3 (every rank in the destination mesh) and of case 0 (source ranks 0, 1 outside it, async)
    assert sum(counts.values()) == 2 * 3 * (2 + 2 + 4 + 4) + 4 + 2
    randoms = {line.split(":")[0]: dict(kv.split("=") for kv in line.split()[3:]) for line in lines if ": counts " in line}
    assert sorted(randoms) == sorted(counts)
    moved = {r["moved"] for r in randoms.values()}
    assert len(moved) == 1 and int(moved.pop()) >= 12  # every rank went through the same random moves
    assert all(int(r["left_out"]) > 0 and int(r["groups"]) > 0 for r in randoms.values())  # subgroups were exercised
    assert sum(int(r["async"]) for r in randoms.values()) > 0


def test_into_writes_the_callers_views_matching_dtensor_and_bad_ones_fail_every_rank():
    lines = launch(4, "into", worker=Path(__file__).parent / "workers" / "redistribute_worker.py")
    moves = [line for line in lines if ": into case " in line]
    # 5 cases x 2 dtypes x 3 runs (sync rows, async columns, sync columns) on every rank
    assert len(moves) == 4 * 5 * 2 * 3 and all(line.endswith(": ok") for line in moves), [m for m in moves if not m.endswith(": ok")]
    refused = {line.split(": ", 2)[1]: [] for line in lines if ": into refused" in line}
    for line in lines:
        if ": into refused" in line:
            refused[line.split(": ", 2)[1]].append(line.split(": ", 2)[2])
    assert sorted(refused) == ["into refused, gradient", "into refused, wrong shape"]
    assert all(len(said) == 4 and len(set(said)) == 1 for said in refused.values()), refused  # every rank, the same line
    assert refused["into refused, wrong shape"][0].startswith("redistribute: into= on rank 1 is not a tensor of its destination "
                                                              "shard's shape, dtype and device"), refused
    assert "into= is written outside autograd" in refused["into refused, gradient"][0], refused


def test_a_plain_tensor_is_refused_in_one_line():
    from xmesh_plan.redistribute import redistribute
    from xmesh_plan.sides import FrontendError

    with pytest.raises(FrontendError, match="pass a DTensor"):
        redistribute(object(), None, [])


def test_the_readme_torchrun_example_runs_bit_exact():
    """The exact `torchrun` line the README shows, with this environment's torchrun."""
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("torchrun ") and "redistribute_demo" in line)
    command = [str(Path(sys.executable).parent / "torchrun"), *shlex.split(line)[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "every destination shard bit-exact against distribute_tensor" in done.stdout
    assert done.stdout.count("ms per call") == 2, done.stdout
