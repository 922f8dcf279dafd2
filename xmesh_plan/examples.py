"""The example problems, plans and pipelines that `--help` and the README name, wherever xmesh-plan runs.

A documented command such as `xmesh-plan compile plans/case3.problem.json` names a file of the source
tree. When that path does not exist (an installed wheel, another folder), readers fall back to the
copy shipped inside the package, so every documented command works from anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

_PACKAGE = Path(__file__).resolve().parent
# documented folder -> (folder inside an installed wheel, folder in a source checkout)
EXAMPLE_FOLDERS = {
    "plans": (_PACKAGE / "examples_data" / "plans", _PACKAGE.parent / "plans"),
    "bench/pipelines": (_PACKAGE / "examples_data" / "pipelines", _PACKAGE.parent / "bench" / "pipelines"),
}


def shipped_example(path: str | os.PathLike) -> Path | None:
    """The shipped copy of a documented example path such as `plans/case3.problem.json`, or None.

    >>> shipped_example("plans/case3.problem.json").name
    'case3.problem.json'
    >>> shipped_example("elsewhere/case3.problem.json") is None
    True
    """
    relative = PurePosixPath(Path(path).as_posix())
    if relative.is_absolute() or ".." in relative.parts:
        return None
    for folder, places in EXAMPLE_FOLDERS.items():
        prefix = PurePosixPath(folder)
        if relative.parent == prefix:
            for place in places:
                candidate = place / relative.name
                if candidate.is_file():
                    return candidate
    return None
