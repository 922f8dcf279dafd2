"""Every console block of README.md is run and its output compared, so the README cannot show stale output.

A ```console block holds `$ command` lines, each followed by the output it prints (stdout and stderr). The
commands run in a scratch folder that sees the repository's plans/ and bench/, with this checkout's
`xmesh-plan` first on PATH. Only the wall-clock time a compile reports ("in 0.02 s") may differ.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WALL_CLOCK = re.compile(r" in \d+\.\d+ s$")  # `compile`'s own timing, the one figure that is not deterministic


def console_blocks(text: str) -> list[list[tuple[str, list[str]]]]:
    """Each ```console block as [(command, expected output lines)]."""
    blocks = []
    for body in re.findall(r"```console\n(.*?)```", text, re.S):
        steps = []
        for line in body.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                assert steps, f"output before any command in a console block: {line!r}"
                steps[-1][1].append(line)
        blocks.append(steps)
    return blocks


def broken_plan(folder: Path) -> None:
    """`broken.plan.json`, as the README says: case3.plan.json with its last operation removed."""
    data = json.loads((folder / "case3.plan.json").read_text())
    data["operations"].pop()
    (folder / "broken.plan.json").write_text(json.dumps(data))


PREPARE = {"broken.plan.json": broken_plan}
STEPS = [step for block in console_blocks((ROOT / "README.md").read_text()) for step in block]


def test_the_readme_shows_console_output_for_each_way_to_use_the_cli():
    commands = [command.split()[1] for command, _ in STEPS]
    assert {"compile", "inspect", "verify", "check"} <= set(commands)
    assert all(output for _, output in STEPS), "a console command in README.md shows no output; put it in a sh block"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    for name in ("plans", "bench"):
        (folder / name).symlink_to(ROOT / name)
    return folder


@pytest.mark.parametrize("index", range(len(STEPS)), ids=[command[:60] for command, _ in STEPS])
def test_readme_console_output_is_what_the_command_prints(index, scratch):
    """The steps run in README order in one folder, so a later command sees the files an earlier one wrote."""
    command, expected = STEPS[index]
    for name, prepare in PREPARE.items():
        if name in command and not (scratch / name).exists():
            prepare(scratch)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("XMESH_PLAN_DEBUG", None)
    done = subprocess.run(command, shell=True, cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
    shown = (done.stdout + done.stderr).rstrip("\n").splitlines()
    assert [WALL_CLOCK.sub(" in N s", line) for line in shown] == [WALL_CLOCK.sub(" in N s", line) for line in expected]
