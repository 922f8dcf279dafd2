"""The `xmesh-plan` command in process, and the check that bad input gets the one-line user error."""

from __future__ import annotations

from click.testing import CliRunner, Result

from xmesh_plan.planner.cli import main


def run_cli(*args) -> Result:
    """`xmesh-plan ARGS...` through click's runner (arguments may be paths or numbers)."""
    return CliRunner().invoke(main, list(map(str, args)), catch_exceptions=True)


def assert_user_error(result: Result, *words: str) -> str:
    """Exit 2, exactly one stderr line starting with `error:` that names `words`, no exception escaped and no
    traceback; the line, for further checks."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]
