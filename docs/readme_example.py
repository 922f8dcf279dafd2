"""Refresh the worked example in README.md with real output: `.venv/bin/python docs/readme_example.py`."""

import json
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = str(ROOT / ".venv/bin/xmesh-plan")
FLAGS = ["--shape", "1024,1024,512", "--dtype", "int32", "--src-mesh", "2x4", "--src-spec", "R S0 R",
         "--dst-mesh", "2x4", "--dst-spec", "S0 R R"]


def run(*args: str, cwd: str) -> str:
    done = subprocess.run([CLI, *args], cwd=cwd, capture_output=True, text=True)
    return (done.stdout + done.stderr).rstrip()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        compile_out = run("compile", *FLAGS, "-o", "case3.plan.json", cwd=tmp)
        inspect_out = run("inspect", "case3.plan.json", "--ops", cwd=tmp)
        verify_out = run("verify", "case3.plan.json", cwd=tmp)
        plan = json.loads(Path(tmp, "case3.plan.json").read_text())
        plan["operations"] = plan["operations"][:-1]
        Path(tmp, "broken.plan.json").write_text(json.dumps(plan))
        reject_out = "$ xmesh-plan verify broken.plan.json   # the last operation removed\n" + run("verify", "broken.plan.json", cwd=tmp)
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Worked example")
    end = readme.index("Bad input gets one line")
    block = f"""## Worked example

```console
$ xmesh-plan compile --shape 1024,1024,512 --dtype int32 --src-mesh 2x4 --src-spec "R S0 R" \\
                     --dst-mesh 2x4 --dst-spec "S0 R R" -o case3.plan.json
{compile_out}
$ xmesh-plan inspect case3.plan.json --ops
{inspect_out}
$ xmesh-plan verify case3.plan.json
{verify_out}
```

A plan that does not deliver every byte is rejected with the operation, device and box, and exit code 1:

```console
{reject_out}
```

"""
    (ROOT / "README.md").write_text(readme[:start] + block + readme[end:])


if __name__ == "__main__":
    main()
