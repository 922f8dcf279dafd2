"""Run the doctests of every module under schemas/, planner/ and xmesh_plan/, so examples in docstrings stay true."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

from xmesh_plan import planner
from xmesh_plan import schemas
import xmesh_plan


def module_names() -> list[str]:
    names = []
    for package in (schemas, planner, xmesh_plan):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".") if not m.name.endswith("__main__")]
    return sorted(names)


# Modules whose docstrings document a format with examples (STYLE rule 8): they must keep them.
MUST_HAVE_EXAMPLES = ["xmesh_plan.schemas.spec", "xmesh_plan.schemas.geometry", "xmesh_plan.schemas.dtypes", "xmesh_plan.planner.problem_io"]


@pytest.mark.parametrize("name", module_names())
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctests in {name} failed (run python -m doctest -v on it)"


@pytest.mark.parametrize("name", MUST_HAVE_EXAMPLES)
def test_format_modules_keep_their_examples(name):
    module = importlib.import_module(name)
    assert doctest.testmod(module, report=False).attempted > 0, f"{name} lost its doctest examples"
