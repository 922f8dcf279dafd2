"""An emulated multi-host cluster on one machine: hosts are network namespaces with one shaped NIC each.

- `testbed`: build H namespaces joined to a bridge in its own namespace, shape both directions of
  every host link with `tc`, and remove it all again (also on failure or Ctrl-C).
- `launch`: run a plan's ranks through `python -m xmesh_plan.executor.run`, each host's ranks inside its namespace.
- `counters`: per-host link byte counters against the bytes the plan sends across each host's NIC.

Needs root (network namespaces and `tc`). `python -m bench.netlab PLAN --rate-mbit 500 --check` runs
one plan; `make bench-net` runs the experiments recorded in BENCHMARKS.md.
"""
