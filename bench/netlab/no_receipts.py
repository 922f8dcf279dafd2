"""A torch rank without the engine's receipts: `executor.torch_run` with `torch_engine.RECEIPT_BYTES = None`, so in
device order a gloo send ends for its device once the socket buffer holds the rest, as it did before session 15.

    sudo .venv/bin/python -m bench.netlab.experiments --engine torch --no-receipts ...

A bench tool: `experiments --no-receipts` launches the ranks with it, to measure both ways on the testbed.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from xmesh_plan.executor import torch_engine
    from xmesh_plan.executor.torch_run import main

    torch_engine.RECEIPT_BYTES = None
    sys.exit(main())
