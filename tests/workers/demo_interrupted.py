"""`executor.run`'s demo on one rank that gets a real Ctrl-C (SIGINT) at its third barrier, mid-run.

Run under mpiexec beside ordinary demo ranks (`mpiexec ... : -n 1 python tests/workers/demo_interrupted.py PLAN ...`);
the other ranks must learn of it and the whole job end, not hang in MPI_Finalize.
"""

import os
import signal
import sys

from xmesh_plan.executor import run

signal.signal(signal.SIGINT, signal.default_int_handler)  # a launcher without job control starts ranks with SIGINT ignored
barrier, calls = run.MpiCollectives.barrier, []


def interrupted_barrier(self, what: str) -> None:
    calls.append(what)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGINT)
    barrier(self, what)


run.MpiCollectives.barrier = interrupted_barrier
sys.argv[0] = "python -m xmesh_plan.executor.run"
sys.exit(run.console_main())
