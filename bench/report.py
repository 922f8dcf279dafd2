"""Shared by the benchmarks: replace one `## ` section of BENCHMARKS.md, write a results JSON."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xmesh_plan.schemas.plan import write_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def write_json(name: str, data) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def replace_section(title: str, body: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    """Put `## title` + body in place of that section (up to the next `## `), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    header = f"## {title}\n"
    block = header + "\n" + body.strip() + "\n\n"
    if header in text:
        before, rest = text.split(header, 1)
        after = rest[rest.index("\n## "):].lstrip("\n") if "\n## " in rest else ""
        text = before + block + after
    else:
        text = text.rstrip("\n") + "\n\n" + block
    write_atomic(path, text.rstrip("\n") + "\n")


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


def compare_parser(doc: str, compared: str, results: str) -> argparse.ArgumentParser:
    """The flags of a bench that times this tree against a git revision: --compare REV, --repeat, --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--compare", metavar="REV", help=f"also time {compared} of this git revision")
    parser.add_argument("--repeat", type=int, default=3, help="runs per point; the best is kept (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS / results)
    return parser
