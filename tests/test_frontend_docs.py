"""Run the Python examples of docs/frontends.md; each `print(...)  # text` line must print that text."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "frontends.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_page_has_both_examples():
    assert len(BLOCKS) == 2 and "problem_from_shardings" in BLOCKS[0] and "problem_from_dtensor" in BLOCKS[1]


@pytest.mark.parametrize("code", BLOCKS, ids=["jax", "dtensor"])
def test_example_runs_and_prints_what_it_says(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {})
    assert out.getvalue().splitlines() == expected
