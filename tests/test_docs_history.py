"""No project file narrates how the software was developed (bench/history_check.py); the history is in git and
the files say what the software does. The checker's own samples are assembled from parts below, so that this
file holds no such line itself."""

import runpy
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    return SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / "history_check.py")))


def test_no_tracked_file_narrates_development_history():
    check = _checker()
    found = check.history_lines(check.tracked_files())
    assert not found, "lines that narrate history (say what the software does instead):\n" + "\n".join(found)


def test_no_tracked_file_is_named_by_a_work_period():
    """Results files, archived ones included, are named by what they hold (engine, order, rate, size, cases)."""
    check = _checker()
    found = check.history_names(check.tracked_names())
    assert not found, "files named by a work period (rename them by what they hold):\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_history_line(tmp_path):
    check = _checker()
    period, saved = "session", f"netlab-device-500-s{7}.json"  # the parts the samples are made of
    lines = [f"Measured in {period} 13 on a quiet machine.", f"See bench/results/{saved}.",
             "The lowering used to loop over every chunk.", "Before the fix it crashed.", "The first version sent more.",
             "The model changed in fb54710.", "Until fb54710 the model held the NIC.", "Before: it hung. Now the rank reports.",
             f"bench/results/archive/{saved} holds it."]
    kept = ["A send ends once its receipt arrives.", "bench/results/archive/netlab-mpi-device-500-32mb-single-copy.json holds it.",
            "The stage is used to pick a chunk count.", "how many flows were added so far"]
    text = tmp_path / "doc.md"
    text.write_text("\n".join(lines + kept) + "\n")
    found = check.history_lines([text], root=tmp_path)
    assert [int(f.split(":")[1]) for f in found] == [1, 2, 3, 4, 5, 7, 8, 9]


def test_the_check_finds_files_named_by_a_work_period(tmp_path):
    check = _checker()
    suffix = f"-s{12}"
    named = [f"netlab-device-500{suffix}.json", f"netlab-torch-device-500-32mb-plancpu{suffix}-cases1-3.json"]
    kept = ["netlab-mpi-device-500-32mb-single-copy.json", "netlab-mpi-device-500-32mb-plancpu-overhead240us.json",
            "utrans-2.1b-fp16.1f1b.png", "bench_staging.py"]
    found = check.history_names([tmp_path / "archive" / n for n in named + kept], root=tmp_path)
    assert [f.split(":")[0] for f in found] == [f"archive/{n}" for n in named]
