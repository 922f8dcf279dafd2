"""The wheel installs everything under `xmesh_plan` and ships the documented examples.

Built from this checkout, installed into a scratch folder, and run from another folder that holds a
user's own `schemas.py` and `planner.py`: the documented commands must still work there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    wheels = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(wheels)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
        names = archive.namelist()
    return target, names


def run_outside(target: Path, tmp_path: Path, *code: str):
    (tmp_path / "schemas.py").write_text("raise SystemExit('the user schemas.py shadowed ours')\n")
    (tmp_path / "planner.py").write_text("raise SystemExit('the user planner.py shadowed ours')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{target}"}
    return subprocess.run([sys.executable, "-c", ";".join(code)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_has_one_top_level_package(installed):
    _, names = installed
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"xmesh_plan"}
    assert "xmesh_plan/examples_data/plans/case3.problem.json" in names
    assert "xmesh_plan/examples_data/plans/weight_sync_small.problem.toml" in names  # multi-tensor examples are TOML
    assert "xmesh_plan/examples_data/pipelines/utrans-2.1b-fp16.json" in names


def test_documented_commands_work_outside_the_repository(installed, tmp_path):
    target, _ = installed
    result = run_outside(target, tmp_path,
                         "import sys, xmesh_plan.planner.cli as cli, xmesh_plan.schemas as schemas",
                         f"assert schemas.__file__.startswith({str(target)!r}), schemas.__file__",
                         "sys.argv = ['xmesh-plan', 'compile', 'plans/case3.problem.json', '-o', 'case3.plan.json']",
                         "cli.main()")
    assert result.returncode == 0, result.stderr
    assert "case3.plan.json: 4 unit tasks" in result.stdout
    assert (tmp_path / "case3.plan.json").is_file()
