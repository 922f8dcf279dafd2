"""Shared by the benchmarks: write a results JSON, remake BENCHMARKS.md from the results, time old code against new."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from xmesh_plan.schemas.plan import write_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def write_json(name: str, data) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def update_benchmarks_doc() -> None:
    """Remake BENCHMARKS.md from every results file (bench/benchmarks_doc.py), once a bench has written its own."""
    from bench.benchmarks_doc import DOC, render

    write_atomic(DOC, render())
    print(f"{DOC.name} remade from {RESULTS.relative_to(ROOT)}/")


def module_at(rev: str, path: str, name: str):
    """`path` as of git revision `rev`, imported as module `name` (name it inside its package, e.g.
    `xmesh_plan.executor.lower_compared`, so its relative imports resolve), to time old code against new."""
    text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    file = Path(tempfile.mkdtemp()) / Path(path).name
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def best_seconds(fn, repeat: int) -> float:
    """The fastest of `repeat` calls of `fn`, in seconds (the least disturbed by other load)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare_command(doc: str, compared: str, results: str):
    """A click command for a bench that times this tree against a git revision: --compare REV, --repeat, --out."""
    def decorate(fn):
        fn = click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS / results, show_default=True,
                          help="results JSON")(fn)
        fn = click.option("--repeat", type=int, default=3, show_default=True, help="runs per point; the best is kept")(fn)
        fn = click.option("--compare", metavar="REV", help=f"also time {compared} of this git revision")(fn)
        return click.command(help=doc.splitlines()[0])(fn)
    return decorate
