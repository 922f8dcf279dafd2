"""Find lines that narrate how the project was developed instead of saying what it does.

    .venv/bin/python bench/history_check.py          # prints `path:line: text` per match; exit 1 if any

Project files describe the software as it is; its history is in git. This scans every text file git
tracks (or the paths given), except the archived results (`bench/results/archive/`, kept as they were
measured) and this checker, and reports each line that matches one of `PATTERNS`: a numbered work period,
a result file named by one, what code did at an earlier time, or a commit used as a point in time. It
also reports every tracked file, archived results included, whose own name carries a work-period suffix
(`NAME_SUFFIX`: a dash, the letter s and a number before the extension): a results file is named by what it holds (engine, order, rate, size, cases).
`tests/test_docs_history.py` runs it as part of `make test`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = ("bench/results/archive/", "bench/history_check.py", "tests/test_docs_history.py")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".cfg", ".ini", ".yml", ".yaml", ""}

# What each pattern catches; every one is a phrase that dates the text rather than describes the code.
PATTERNS = {
    "numbered work period": r"\bsessions? \d+",
    "work-period suffix on a file name": r"\b[\w.-]*[a-z0-9]-s\d+(?=\.json|-[a-z])",
    "what code used to do": r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )\bused to\b",
    "before a change": r"\bbefore the (fix|fixes|change|rewrite|review)\b",
    "an earlier version": r"\b(first|previous|earlier|old) version\b|\bpreviously\b|\bformerly\b",
    "a change, told as news": r"\b(was|were) (added|removed|changed|fixed|introduced|rewritten|replaced)\b(?! so far)|\bnow the default\b",
    "a revision as a point in time": r"\b(until|since|as of|before) [0-9a-f]{7,40}\b",
    "before and now": r"(?-i:\bBefore: |(?<=\. )Now (the|a|an|it|every|each)\b)",
}
COMPILED = {name: re.compile(pattern, re.IGNORECASE) for name, pattern in PATTERNS.items()}
NAME_SUFFIX = re.compile(r"(?<=[a-z0-9])-s\d+(?=[.-])", re.IGNORECASE)  # on a file's own name, before its extension or next part


def tracked_names(root: Path = ROOT) -> list[Path]:
    """Every file git tracks under `root`."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout.split("\0")
    return [root / n for n in names if n]


def tracked_files(root: Path = ROOT) -> list[Path]:
    """The text files git tracks under `root`, less the skipped ones."""
    return [p for p in tracked_names(root) if not p.relative_to(root).as_posix().startswith(SKIPPED)
            and p.suffix in TEXT_SUFFIXES and p.is_file()]


def history_names(paths: list[Path], root: Path = ROOT) -> list[str]:
    """`path: [work-period suffix on a file name]` for every path whose own name carries one (`NAME_SUFFIX`)."""
    return [f"{p.relative_to(root) if p.is_relative_to(root) else p}: [work-period suffix on a file name] rename it by what it holds"
            for p in paths if NAME_SUFFIX.search(p.name)]


def history_lines(paths: list[Path], root: Path = ROOT) -> list[str]:
    """`path:line: [what] text` for every line of `paths` that one of PATTERNS matches."""
    found = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in COMPILED.items():
                if pattern.search(line):
                    shown = path.relative_to(root) if path.is_relative_to(root) else path
                    found.append(f"{shown}:{number}: [{what}] {line.strip()[:160]}")
                    break
    return found


@click.command()
@click.argument("paths", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def main(paths: tuple[Path, ...]) -> None:
    """Print every line that narrates development history (all tracked text files, or PATHS), and every file named by
    a work period (all tracked files, or PATHS); exit 1 if any."""
    chosen = [p.resolve() for p in paths]
    found = history_names(chosen or tracked_names()) + history_lines(chosen or tracked_files())
    for line in found:
        click.echo(line)
    if found:
        click.echo(f"{len(found)} line(s) narrate history: say what the software does, not how it came to.", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
