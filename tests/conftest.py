"""Shared builders: a problem from shorthand, the paper's reference cases, and a fast compile.

Tests that only need *a* correct plan compile with the `greedy` solver: it exists in every version
of the solver registry and answers in milliseconds, so the suite stays fast whatever the default
solver is. Nothing here hard-codes a predicted time.
"""

from __future__ import annotations

import os

# The JAX front-end tests need 16 CPU devices. XLA reads this flag once, when jax is first imported,
# so it is set here before any test module loads; it changes nothing for code that does not use jax.
_HOST_DEVICES = "--xla_force_host_platform_device_count=16"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_HOST_DEVICES}".strip()

import pytest

from tests.support.builders import compile_fast, make_problem, reference_problem


# Subprocesses the tests start (xmesh-plan, mpiexec ... executor.run) show real tracebacks, not the one-line
# internal-error report; tests of that report unset it themselves.
os.environ.setdefault("XMESH_PLAN_DEBUG", "1")

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


def pytest_addoption(parser) -> None:
    parser.addoption("--all-mutants", action="store_true",
                     help="mutation tests that sample fewer mutants in `make test` run their full count (e.g. "
                          "tests/test_verify_columns.py: 400 instead of 200)")


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist, the files with `slow` or `mpi` tests first (otherwise in order): each worker takes whole
    files, so a long file handed out last would leave the other worker idle until it ends."""
    if hasattr(config, "workerinput"):
        long = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("mpi")}
        items.sort(key=lambda item: item.path not in long)


def pytest_sessionfinish(session) -> None:
    """Under pytest-xdist, hand this worker's summary lines to the controller, which prints them."""
    from tests.support.mutations import SUMMARY

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["summary"] = list(SUMMARY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: keep the summary lines of a worker that finished."""
    from tests.support.mutations import SUMMARY

    SUMMARY.extend(getattr(node, "workeroutput", {}).get("summary", []))


def pytest_terminal_summary(terminalreporter) -> None:
    """Print what summary-keeping tests recorded (e.g. the plan-mutation counts), so CI's log shows it."""
    from tests.support.mutations import SUMMARY

    for line in SUMMARY:
        terminalreporter.write_line(line)
