"""Shared by the benchmarks: replace one `## ` section of BENCHMARKS.md, write a results JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from xmesh_plan.schemas.plan import write_atomic  # noqa: E402

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
