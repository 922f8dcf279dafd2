"""BENCHMARKS.md is generated from bench/results/*.json by bench/benchmarks_doc.py; the committed file must be what the
script makes of the committed results, so no table shows a figure its results file does not hold."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render() -> str:
    return runpy.run_path(str(ROOT / "bench" / "benchmarks_doc.py"))["render"]()


def test_benchmarks_md_is_what_the_results_files_make():
    made = render()
    assert (ROOT / "BENCHMARKS.md").read_text() == made, "BENCHMARKS.md is stale: run `make benchmarks-doc`"


def test_every_section_answers_one_question_with_a_command_and_a_table():
    text = render()
    sections = text.split("\n## ")[1:]
    titles = [s.splitlines()[0] for s in sections]
    assert titles == ["Metrics", "Paper cases, held against the bound", "Weight sync", "Scale", "Frontier scale", "Executor overhead",
                      "Emulated cluster, measured against the model", "Pipelines"]
    for section in sections[1:]:
        assert "```\n" in section and "\n|:" in section, section.splitlines()[0]
