"""Small plans for the one-GPU check (`bench/gpu/check.sh`): a 2-rank send, a 3-rank broadcast and a 2-to-2 reshard.

    PYTHONPATH=$PWD .venv/bin/python bench/gpu/make_plans.py .whl/plans
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.schemas.files import write_atomic


def problem(name, shape, src_mesh, src_spec, dst_mesh, dst_spec):
    """The problem `xmesh-plan compile --shape ... --src-mesh AxB ...` builds (every rank runs on GPU 0 anyway)."""
    return build_problem({"name": name, "shape": shape, "dtype": "int32", "src": {"mesh": src_mesh, "spec": src_spec},
                          "dst": {"mesh": dst_mesh, "spec": dst_spec}})


def main(folder: str) -> int:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for p, strategy in [(problem("gpu_pair", [64, 48], "1x1", "R R", "1x1", "R S0"), "send_recv"),
                        (problem("gpu_bcast3", [64, 48, 8], "1x1", "R R R", "1x2", "R R R"), "broadcast"),
                        (problem("gpu_2to2", [64, 48], "1x2", "S0 R", "1x2", "R S0"), "broadcast")]:
        write_atomic(out / f"{p.name}.plan.json", compile_plan(p, strategy=strategy, solver="greedy", seed=0).to_json())
    shutil.copy(Path(__file__).resolve().parents[2] / "plans" / "weight_sync_small.plan.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".whl/plans"))
