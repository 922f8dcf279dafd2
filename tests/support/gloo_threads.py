"""Real gloo ranks as threads of the test process: one process group per thread, made from one in-memory store.

Each rank's group is the one `xmesh_plan.transfer_group` makes (`group_on_store`: not torch's default group, not registered),
so a test runs the torch engine over real gloo sockets without launching processes. A rank that raises fails the
call, naming every failed rank and its error; the join's deadline only bounds a hang.
"""

from __future__ import annotations

import threading
import traceback
from datetime import timedelta
from typing import Any, Callable

HANG_S = 120.0  # bounds a hang only: 8 ranks sharing a loaded 2-core machine


def run_threads(n: int, work: Callable[[int, Any], Any], timeout_s: float = 30.0) -> list[Any]:
    """`work(rank, group)` on `n` threads, each with its rank's gloo group (collectives time out after `timeout_s`);
    every rank's result, in rank order."""
    import torch.distributed as dist

    from xmesh_plan.transfer_group import group_on_store

    store = dist.HashStore()
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def rank(r: int) -> None:
        try:
            group = group_on_store(store, r, n, timedelta(seconds=timeout_s))
            results[r] = work(r, group)
        except BaseException as err:  # reported by the caller's thread
            errors.append((r, err))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads), f"a rank still runs after {HANG_S:g} s"
    if errors:  # every rank's, the first cause usually among peers' timeouts
        raise AssertionError("\n".join(f"rank {r}: {''.join(traceback.format_exception(err)[-4:])}"
                                       for r, err in sorted(errors, key=lambda e: e[0])))
    return results
