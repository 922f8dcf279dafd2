"""One import identity: the top folders are the packages `xmesh_plan.schemas`, `xmesh_plan.planner` and
`xmesh_plan.executor`; reaching one of them under its bare name (as `import schemas` from the repository root
would) is refused with the name to use, instead of loading a second copy whose classes differ from the first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.launch import ROOT

PACKAGES = ("schemas", "planner", "executor")


def python(code: str) -> subprocess.CompletedProcess:
    """`python -c code` from the repository root, where the bare folder names are importable."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", PACKAGES)
def test_the_bare_folder_name_is_refused_with_the_name_to_use(name):
    result = python(f"import {name}")
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and f"import xmesh_plan.{name}, not {name}" in last, result.stderr


@pytest.mark.parametrize("name", PACKAGES)
def test_a_module_under_the_bare_folder_name_is_refused_too(name):
    module = {"schemas": "plan", "planner": "compile", "executor": "lower"}[name]
    result = python(f"from {name}.{module} import *")
    assert result.returncode == 1 and f"import xmesh_plan.{name}, not {name}" in result.stderr, result.stderr


def test_the_namespaced_packages_import_from_the_repository_root_as_one_copy():
    result = python("import xmesh_plan.schemas as s, xmesh_plan.planner.compile as c, xmesh_plan.executor as e\n"
                    "assert c.Plan is s.Plan, 'two copies of Plan'\n"
                    "print(s.Plan.__module__, e.ReshardingExecutor.__module__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["xmesh_plan.schemas.plan", "xmesh_plan.executor.executor"]


def test_the_command_line_entry_points_run_from_the_repository_root():
    result = subprocess.run([sys.executable, "-m", "xmesh_plan.planner.cli", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "Usage:" in result.stdout, result.stderr
