"""A torch rank without the engine's receipts: `executor.torch_run` with `TransportOptions(receipt_bytes=None)`, so
in device order a gloo send ends for its device once the socket buffer holds the rest (gloo's own behaviour).

    sudo .venv/bin/python -m bench.netlab.experiments --engine torch --no-receipts ...

A bench tool: `experiments --no-receipts` launches the ranks with it, to measure both ways on the testbed.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from xmesh_plan.executor import TransportOptions
    from xmesh_plan.executor.torch_run import main

    sys.exit(main(transport=TransportOptions(receipt_bytes=None)))
