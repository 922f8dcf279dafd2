"""Every output file (`compile -o`, `schedule -o`, `--torch-csv`, `simulate --trace`, `--png`) goes through
`schemas.files.write_atomic`: a regular file is replaced atomically, but what a path points to is never
replaced: a device or FIFO is written through, a symbolic link stays a link (its target gets the data), a
file with several hard links keeps them all (each shows the new bytes), a folder is refused in one line. A full disk is the machine's fault: one line, exit code 1, wherever the
output goes (a file named by a flag, or standard output behind `>`).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from xmesh_plan.schemas.files import write_atomic
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "xmesh-plan"
CASE3 = str(ROOT / "plans" / "case3.problem.json")
PIPELINE = str(ROOT / "bench" / "pipelines" / "gpt-1.3b-2x2-fp16.json")
FAST = ["--solver", "greedy"]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")



def device(path: Path, minor: int) -> Path:
    """A character device like /dev/null (minor 3) or /dev/full (minor 7) at `path`."""
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    return path


def is_char_device(path: Path) -> bool:
    return stat.S_ISCHR(os.lstat(path).st_mode)


# --- the helper ---------------------------------------------------------------------------------------------

def test_a_symlink_stays_a_link_and_its_target_gets_the_data(tmp_path):
    (tmp_path / "real.json").write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to("real.json")
    write_atomic(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == "real.json"
    assert (tmp_path / "real.json").read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]  # no temp file left


def test_a_dangling_symlink_stays_and_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to("made.json")
    write_atomic(link, b"bytes")
    assert link.is_symlink() and (tmp_path / "made.json").read_bytes() == b"bytes"


def test_a_fifo_nobody_reads_is_refused_at_once_and_stays(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="nothing reads"):
        write_atomic(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_hard_linked_file_keeps_every_name_and_they_all_show_the_new_bytes(tmp_path):
    """A rename would part `plan.json` from `copy.json`, which would keep the old plan."""
    plan, other = tmp_path / "plan.json", tmp_path / "copy.json"
    plan.write_text("a much longer old content\n")
    plan.chmod(0o640)
    os.link(plan, other)
    inode = os.stat(plan).st_ino
    write_atomic(plan, "new\n")
    assert plan.read_text() == other.read_text() == "new\n"
    assert os.stat(plan).st_ino == os.stat(other).st_ino == inode and os.stat(plan).st_nlink == 2
    assert stat.S_IMODE(os.stat(plan).st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.json", "plan.json"]  # no temp file left


def test_a_hard_linked_file_is_untouched_when_the_copy_cannot_be_written(tmp_path, monkeypatch):
    """The full copy is written first: a full disk is found before the file with several names is touched."""
    plan, other = tmp_path / "plan.json", tmp_path / "copy.json"
    plan.write_text("old\n")
    os.link(plan, other)
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.handle = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", Full)
    with pytest.raises(OSError, match="No space"):
        write_atomic(plan, "new\n")
    assert plan.read_text() == other.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.json", "plan.json"]


def test_a_folder_is_refused_and_stays(tmp_path):
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path, "x")
    assert tmp_path.is_dir()


def test_an_existing_file_keeps_its_permissions(tmp_path):
    """A private file (0600) stays private: the new content does not come with the umask's 0644."""
    private = tmp_path / "private.json"
    private.write_text("old\n")
    private.chmod(0o600)
    write_atomic(private, "new\n")
    assert private.read_text() == "new\n" and stat.S_IMODE(os.stat(private).st_mode) == 0o600


def test_a_path_ending_in_a_slash_is_a_folder_not_a_file(tmp_path):
    """`-o out/` names a folder, as the shell's `>` reads it: no file `out` is made in its place."""
    with pytest.raises(IsADirectoryError):
        write_atomic(f"{tmp_path / 'out'}/", "x")
    assert list(tmp_path.iterdir()) == []


@root_only
def test_a_device_is_written_through_not_replaced(tmp_path):
    null = device(tmp_path / "fakenull", 3)
    write_atomic(null, "plan\n")
    assert is_char_device(null)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fakenull"]


# --- every output flag --------------------------------------------------------------------------------------

@root_only
def test_compile_output_onto_a_device_keeps_the_device(tmp_path):
    null = device(tmp_path / "fakenull", 3)
    result = run_cli("compile", CASE3, *FAST, "-o", null)
    assert result.exit_code == 0, result.output
    assert is_char_device(null)


@root_only
def test_pipeline_outputs_onto_devices_keep_the_devices(tmp_path):
    schedule = tmp_path / "schedule.json"
    out, csv, trace, png = (device(tmp_path / name, 3) for name in ("out", "csv", "trace", "png"))
    assert run_cli("schedule", PIPELINE, "--schedule", "1f1b", "-o", out, "--torch-csv", csv).exit_code == 0
    assert run_cli("schedule", PIPELINE, "--schedule", "1f1b", "-o", schedule).exit_code == 0
    result = run_cli("simulate", schedule, "--trace", trace, "--png", png)
    assert result.exit_code == 0, result.output
    assert all(is_char_device(p) for p in (out, csv, trace, png))


def test_compile_output_onto_a_symlink_keeps_the_link(tmp_path):
    link = tmp_path / "plan.json"
    link.symlink_to("kept.plan.json")
    assert run_cli("compile", CASE3, *FAST, "-o", link).exit_code == 0
    assert link.is_symlink() and '"schema_version"' in (tmp_path / "kept.plan.json").read_text()


def test_compile_output_onto_a_fifo_is_one_line(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = run_cli("compile", CASE3, *FAST, "-o", fifo)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "--output" in result.stderr and "nothing reads" in result.stderr
    assert "start the program that reads it first" in result.stderr and "folder" not in result.stderr  # the folder is fine
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_an_output_in_a_missing_folder_says_to_create_it(tmp_path):
    result = run_cli("compile", CASE3, *FAST, "-o", tmp_path / "missing" / "plan.json")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "create its folder first" in result.stderr


def test_an_output_path_with_a_newline_is_quoted_on_one_line(tmp_path):
    target = tmp_path / "no\nsuch" / "plan.json"
    result = run_cli("compile", CASE3, *FAST, "-o", target)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no\\nsuch" in result.stderr


# --- a full disk --------------------------------------------------------------------------------------------

def _script(args: list[str], stdout) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XMESH_PLAN_DEBUG"}  # what a user sees, not the tests' tracebacks
    return subprocess.run([str(SCRIPT), *args], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120, env=env)


def _assert_environment_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: cannot write"), done.stderr
    assert "No space left on device" in done.stderr and "internal error" not in done.stderr
    for word in words:
        assert word in done.stderr


@pytest.mark.parametrize("args", [["schema"], ["compile", CASE3, *FAST, "-o", "-"], ["verify", str(ROOT / "plans" / "case3.plan.json")]])
def test_standard_output_on_a_full_disk_is_an_environment_error(args):
    with open("/dev/full", "w") as full:
        _assert_environment_error(_script(args, full), "standard output")


@root_only
def test_an_output_file_on_a_full_disk_is_an_environment_error(tmp_path):
    full = device(tmp_path / "fakefull", 7)
    _assert_environment_error(_script(["compile", CASE3, *FAST, "-o", str(full)], subprocess.DEVNULL), "fakefull")
    assert is_char_device(full)


def test_a_full_disk_behind_the_rename_is_exit_1_in_process(tmp_path, monkeypatch):
    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    result = run_cli("compile", CASE3, *FAST, "-o", tmp_path / "plan.json")
    assert isinstance(result.exception, OSError) and result.exception.errno == 28  # on to the last-resort handler
    assert list(tmp_path.iterdir()) == []
