"""Bytes each host's link carried, read from the bridge-side veth, against the bytes the plan sends across that host's NIC.

The bridge-side end `v<i>` sees every frame of host i: its rx bytes are what the host sent, its tx
bytes what the host received (Ethernet and IP/TCP headers included, so a run at MTU 9000 carries
about 0.7% more than the payload, at MTU 1500 about 4.6% less GSO's savings). The plan's side comes
from `planner.inspect_plan.plan_loads`, the code behind `xmesh-plan inspect`'s per-host NIC load.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from xmesh_plan.planner.inspect_plan import plan_loads
from xmesh_plan.schemas import Plan

from .launch import plan_hosts
from .testbed import IP, Testbed, TestbedError


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a host's link carried, each direction."""

    sent: int
    received: int

    def __sub__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.sent - other.sent, self.received - other.received)


@dataclass(frozen=True)
class HostBytes:
    """One testbed host: what its link carried during a run, and what the plan says crosses its NIC in that run."""

    host: int
    measured: LinkBytes
    predicted: LinkBytes

    @property
    def excess(self) -> LinkBytes:
        """Measured minus predicted: headers and control traffic (negative means plan bytes did not cross)."""
        return self.measured - self.predicted

    def as_dict(self) -> dict:
        return {"host": self.host, "sent": self.measured.sent, "received": self.measured.received,
                "predicted_sent": self.predicted.sent, "predicted_received": self.predicted.received}


def read_links(bed: Testbed) -> dict[int, LinkBytes]:
    """Testbed host -> bytes its link has carried since it was made."""
    cmd = [IP, "-n", bed.bridge_ns, "-s", "-j", "link", "show"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")
    links = {}
    for link in json.loads(result.stdout):
        name = link.get("ifname", "")
        if name.startswith("v") and name[1:].isdigit():
            stats = link["stats64"]
            links[int(name[1:])] = LinkBytes(sent=stats["rx"]["bytes"], received=stats["tx"]["bytes"])
    return links


def retransmitted_segments(bed: Testbed) -> dict[int, int]:
    """Testbed host -> TCP segments its namespace has retransmitted (RetransSegs of /proc/net/snmp): lost bytes sent twice."""
    out = {}
    for host in range(bed.hosts):
        cmd = [IP, "netns", "exec", bed.host_ns(host), "cat", "/proc/net/snmp"]
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        tcp = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
        out[host] = int(dict(zip(tcp[0], tcp[1])).get("RetransSegs", 0)) if len(tcp) == 2 else -1
    return out


def predicted_links(plan: Plan, reshards: int) -> dict[int, LinkBytes]:
    """Testbed host -> payload bytes the plan moves across that host's NIC in `reshards` runs of it."""
    loads = plan_loads(plan).hosts
    out = {}
    for i, host in enumerate(plan_hosts(plan)):
        load = loads.get(host)
        out[i] = LinkBytes(load.send_bytes * reshards, load.recv_bytes * reshards) if load else LinkBytes(0, 0)
    return out


def compare_many(before: dict[int, LinkBytes], after: dict[int, LinkBytes], plans: list[Plan], reshards: int) -> list[HostBytes]:
    """Per host: what the link carried between the two readings, against all `plans` run `reshards` times each."""
    rows = []
    for h in sorted(after):
        want = [predicted_links(p, reshards).get(h, LinkBytes(0, 0)) for p in plans]
        rows.append(HostBytes(h, after[h] - before[h], LinkBytes(sum(w.sent for w in want), sum(w.received for w in want))))
    return rows


def within(rows: list[HostBytes], rel: float, slack_bytes: int) -> list[str]:
    """Hosts whose link carried less than the plan's bytes, or more than `rel` plus `slack_bytes` over them."""
    bad = []
    for row in rows:
        for what, got, want in (("sent", row.measured.sent, row.predicted.sent),
                                ("received", row.measured.received, row.predicted.received)):
            if not want <= got <= want * (1 + rel) + slack_bytes:
                bad.append(f"host {row.host} {what} {got:,} bytes, plan {want:,} (allowed up to +{rel:.1%} + {slack_bytes:,})")
    return bad
