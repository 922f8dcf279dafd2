"""Shared builders: a problem from shorthand, the paper's reference cases, and a fast compile.

Tests that only need *a* correct plan compile with the `greedy` solver: it exists in every version
of the solver registry and answers in milliseconds, so the suite stays fast whatever the default
solver is. Nothing here hard-codes a predicted time.
"""

from __future__ import annotations

import os
from typing import Any

# The JAX front-end tests need 16 CPU devices. XLA reads this flag once, when jax is first imported,
# so it is set here before any test module loads; it changes nothing for code that does not use jax.
_HOST_DEVICES = "--xla_force_host_platform_device_count=16"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_HOST_DEVICES}".strip()

import pytest

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.reference_cases import reference_problems

# Subprocesses the tests start (xmesh-plan, mpiexec ... executor.run) show real tracebacks, not the one-line
# internal-error report; tests of that report unset it themselves.
os.environ.setdefault("XMESH_PLAN_DEBUG", "1")

FAST_SOLVER = "greedy"
STRATEGY_NAMES = ("broadcast", "send_recv", "local_allgather", "global_allgather", "auto")


def make_problem(shape, src_mesh, src_spec, dst_mesh, dst_spec, dtype: str = "float32", **extra: Any):
    """A problem from CLI-like shorthand; `extra` goes into the raw dict (cluster, name, ...)."""
    raw = {"shape": list(shape), "dtype": dtype, "src": {"mesh": src_mesh, "spec": src_spec},
           "dst": {"mesh": dst_mesh, "spec": dst_spec}, **extra}
    return build_problem(raw)


def reference_problem(name: str):
    raw = dict(reference_problems())[name]
    return build_problem(raw)


def compile_fast(problem, strategy: str = "broadcast", **kwargs: Any):
    return compile_plan(problem, strategy=strategy, solver=kwargs.pop("solver", FAST_SOLVER), **kwargs)


@pytest.fixture
def problem():
    """Builder: `problem((8, 8), "2x2", "S0 R", "2x2", "R S1")`."""
    return make_problem


@pytest.fixture
def case():
    """Builder: `case("case3")` is the paper's case 3 as a ReshardingProblem."""
    return reference_problem


@pytest.fixture
def compile_quick():
    """`compile_quick(problem, strategy)`: compile_plan with the fast solver."""
    return compile_fast


def pytest_terminal_summary(terminalreporter) -> None:
    """Print what summary-keeping tests recorded (e.g. the plan-mutation counts), so CI's log shows it."""
    from tests.test_plan_mutations import SUMMARY

    for line in SUMMARY:
        terminalreporter.write_line(line)
