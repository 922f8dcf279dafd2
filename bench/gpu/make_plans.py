"""Small plans for the one-GPU check (`bench/gpu/check.sh`): a 2-rank send, a 3-rank broadcast and a 2-to-2 reshard.

    PYTHONPATH=$PWD .venv/bin/python bench/gpu/make_plans.py .whl/plans
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Cluster, DeviceMesh, Placement, ReshardingProblem


def problem(name, shape, src_devices, src_spec, dst_devices, dst_spec) -> ReshardingProblem:
    return ReshardingProblem(name=name, shape=shape, dtype="int32", cluster=Cluster(devices_per_host=2),
                             src=Placement(mesh=DeviceMesh(shape=(len(src_devices),), devices=src_devices), spec=src_spec),
                             dst=Placement(mesh=DeviceMesh(shape=(len(dst_devices),), devices=dst_devices), spec=dst_spec))


def main(folder: str) -> int:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for p, strategy in [(problem("gpu_pair", (64, 48), (0,), "R R", (1,), "R S0"), "send_recv"),
                        (problem("gpu_bcast3", (64, 48, 8), (0,), "R R R", (1, 2), "R R R"), "broadcast"),
                        (problem("gpu_2to2", (64, 48), (0, 1), "S0 R", (2, 3), "R S0"), "broadcast")]:
        (out / f"{p.name}.plan.json").write_text(compile_plan(p, strategy=strategy, solver="greedy", seed=0).to_json())
    shutil.copy(Path(__file__).resolve().parents[2] / "plans" / "weight_sync_small.plan.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".whl/plans"))
