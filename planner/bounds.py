"""The physical lower bound of a resharding: what the busiest NIC must move, over its bandwidth.

Four bounds, the largest wins: each destination host must receive every byte it needs but holds on
none of its devices; each source host must send every byte that only it holds and some other host
needs; all source hosts together must send every byte needed across hosts at least once; and each
destination device must take in every byte it lacks, at most as fast as its host link and its NIC
share together (so a resharding inside one host still has a bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from xmesh_plan.schemas import Cluster

from .unit_tasks import Cell


@dataclass(frozen=True, slots=True)
class LowerBound:
    """The bound in seconds and which NIC side sets it, e.g. `0.2147s (host 2 receive)`."""

    seconds: float
    reason: str

    def __str__(self) -> str:
        return f"{self.seconds:.6f}s ({self.reason})"


def lower_bound(cells: list[Cell], cluster: Cluster, itemsize: int) -> LowerBound:
    """The bound of one tensor's cells."""
    return joint_lower_bound([(cells, itemsize)], cluster)


def joint_lower_bound(tensors: list[tuple[list[Cell], int]], cluster: Cluster) -> LowerBound:
    """The bound of several tensors moved together: (cells, itemsize) per tensor, every byte summed per NIC side.
    Tensors given the same list of cells (a compile's tensors of one kind) are summed once and counted as many times:
    the sums are integers, so the bound is the same to the bit."""
    times: dict[tuple[int, int], list] = {}
    for cells, itemsize in tensors:
        times.setdefault((id(cells), itemsize), [cells, itemsize, 0])[2] += 1
    recv: dict[int, int] = {}
    device_in: dict[int, int] = {}
    sole_send: dict[int, int] = {}
    total_send, source_hosts = 0, set()
    for cells, itemsize, count in times.values():
        for cell in cells:
            nbytes = cell.nbytes(itemsize) * count
            for device in cell.receivers:
                device_in[device] = device_in.get(device, 0) + nbytes
            sender_hosts = {cluster.host_of(d) for d in cell.senders}
            source_hosts |= sender_hosts
            needy = {cluster.host_of(d) for d in cell.receivers} - sender_hosts
            for host in needy:
                recv[host] = recv.get(host, 0) + nbytes
            if needy:
                total_send += nbytes
                if len(sender_hosts) == 1:
                    (only,) = sender_hosts
                    sole_send[only] = sole_send.get(only, 0) + nbytes
    candidates = [LowerBound(0.0, "nothing crosses hosts")]
    candidates += [LowerBound(b / cluster.recv_bytes_per_s, f"host {h} receive") for h, b in recv.items()]
    candidates += [LowerBound(b / cluster.send_bytes_per_s, f"host {h} send") for h, b in sole_send.items()]
    device_rate = cluster.intra_bytes_per_s + cluster.recv_bytes_per_s
    candidates += [LowerBound(b / device_rate, f"device {d} intake") for d, b in device_in.items()]
    if source_hosts:
        candidates.append(LowerBound(total_send / (cluster.send_bytes_per_s * len(source_hosts)), "all source hosts send"))
    return max(candidates, key=lambda c: (c.seconds, c.reason))


def over_bound(seconds: float, bound: float) -> float:
    """`seconds` over the byte lower bound; 1.0 where the bound is 0 (nothing crosses a link: the plan
    cannot do better), so `compile`, `inspect` and `check` print and gate the same figure.

    >>> over_bound(0.5, 0.25), over_bound(0.0, 0.0)
    (2.0, 1.0)
    """
    return seconds / bound if bound > 0 else 1.0

