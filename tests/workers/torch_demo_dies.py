"""`executor.torch_run`'s demo where rank 1 dies (os._exit) at its third barrier, mid-run, as a killed rank would."""

import os
import sys

from xmesh_plan.executor import torch_run

barrier, calls = torch_run.TorchCollectives.barrier, []


def dying_barrier(self, what: str) -> None:
    calls.append(what)
    if len(calls) == 3 and os.environ["RANK"] == "1":
        os._exit(9)
    barrier(self, what)


torch_run.TorchCollectives.barrier = dying_barrier
sys.argv[0] = "python -m xmesh_plan.executor.torch_run"
sys.exit(torch_run.console_main())
