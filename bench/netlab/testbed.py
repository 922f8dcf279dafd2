"""H network namespaces ("hosts") on a bridge in a namespace of its own, each link shaped both ways.

Host i lives in namespace `<run>-h<i>` with one interface `eth0` at 10.99.0.<i+1>; its peer `v<i>`
sits on bridge `br0` in namespace `<run>-br`, which also holds 10.99.0.254 for the launcher. htb on
`eth0` limits what the host sends, htb on `v<i>` what it receives (full duplex, as a NIC). The root
namespace is never touched and the addresses exist only inside these namespaces, so no packet
leaves them. `<run>` is `xnl<pid>x<random>`: two runs never share a name, and `clean_stale()`
removes what a killed run (SIGKILL, power loss) left behind.

>>> bed = Testbed(run_id="xnl1x2", hosts=2, link=LinkShape(rate_mbit=500))
>>> bed.host_ns(1), bed.bridge_ns, bed.host_addr(1), bed.bridge_addr
('xnl1x2-h1', 'xnl1x2-br', '10.99.0.2', '10.99.0.254')
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "xnl"
SUBNET = "10.99.0"
BRIDGE_HOST = 254
MAX_HOSTS = 64
IP = "ip"
TC = "tc"
COMMAND_TIMEOUT_S = 30.0
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-(br|h\d+)$")


class TestbedError(RuntimeError):
    """A namespace, link or qdisc could not be made; the message names the command and what it said."""


@dataclass(frozen=True)
class LinkShape:
    """Each host link's rate (both directions), MTU and htb burst (about 4 ms of the rate keeps the rate under CPU load)."""

    rate_mbit: float
    mtu: int = 9000
    burst_ms: float = 4.0

    def __post_init__(self):
        if not 1 <= self.rate_mbit <= 100_000:
            raise ValueError(f"rate_mbit {self.rate_mbit:g}: give 1 to 100000 Mbit/s, e.g. 500")
        if not 1280 <= self.mtu <= 65_000:
            raise ValueError(f"mtu {self.mtu}: give 1280 to 65000, e.g. 1500 or 9000")

    @property
    def burst_bytes(self) -> int:
        """htb burst: burst_ms of the rate, at least two full frames."""
        return max(int(self.rate_mbit * 1e6 / 8 * self.burst_ms / 1e3), 2 * (self.mtu + 14))


@dataclass(frozen=True)
class Testbed:
    """The names and addresses of one run's namespaces (a value: `build` makes them, `teardown` removes them)."""

    __test__ = False  # not a pytest test class
    run_id: str
    hosts: int
    link: LinkShape

    def __post_init__(self):
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts {self.hosts}: give 1 to {MAX_HOSTS} hosts")

    @property
    def bridge_ns(self) -> str:
        return f"{self.run_id}-br"

    def host_ns(self, host: int) -> str:
        return f"{self.run_id}-h{host}"

    def host_addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    @property
    def bridge_addr(self) -> str:
        return f"{SUBNET}.{BRIDGE_HOST}"

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.bridge_ns,) + tuple(self.host_ns(h) for h in range(self.hosts))


def new_run_id() -> str:
    """A name prefix unique to this run; the pid in it lets `clean_stale` tell live runs from dead ones."""
    return f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and result.returncode:
        raise TestbedError(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.returncode}")
    return result


def _shape(ns: str, dev: str, link: LinkShape) -> None:
    """htb on `dev`'s egress at the link rate (a single class that all traffic falls into)."""
    rate = f"{link.rate_mbit:g}mbit"
    _run(TC, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    _run(TC, "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
         "burst", str(link.burst_bytes), "cburst", str(link.burst_bytes))


def _build_host(bed: Testbed, host: int) -> None:
    ns, br, peer = bed.host_ns(host), bed.bridge_ns, f"v{host}"
    _run(IP, "netns", "add", ns)
    _run(IP, "-n", br, "link", "add", peer, "mtu", str(bed.link.mtu), "type", "veth", "peer", "name", "eth0", "netns", ns)
    _run(IP, "-n", br, "link", "set", peer, "master", "br0", "up")
    _run(IP, "-n", ns, "link", "set", "lo", "up")
    _run(IP, "-n", ns, "link", "set", "eth0", "mtu", str(bed.link.mtu))
    _run(IP, "-n", ns, "addr", "add", f"{bed.host_addr(host)}/24", "dev", "eth0")
    _run(IP, "-n", ns, "link", "set", "eth0", "up")
    _shape(ns, "eth0", bed.link)
    _shape(br, peer, bed.link)


def build(bed: Testbed) -> None:
    """Make the bridge namespace and every host; on failure the caller's `teardown` removes the part made."""
    br = bed.bridge_ns
    _run(IP, "netns", "add", br)
    _run(IP, "-n", br, "link", "set", "lo", "up")
    _run(IP, "-n", br, "link", "add", "br0", "mtu", str(bed.link.mtu), "type", "bridge")
    _run(IP, "-n", br, "addr", "add", f"{bed.bridge_addr}/24", "dev", "br0")
    _run(IP, "-n", br, "link", "set", "br0", "up")
    for host in range(bed.hosts):
        _build_host(bed, host)


def existing_namespaces() -> list[str]:
    out = _run(IP, "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _run(IP, "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_processes(names: list[str], grace_s: float = 3.0) -> None:
    """Stop every process inside the namespaces: TERM, then KILL whatever is left after `grace_s`."""
    pids = [p for n in names for p in namespace_pids(n)]
    _kill(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [p for n in names for p in namespace_pids(n)]
    _kill(pids, signal.SIGKILL)


def remove_namespaces(names: list[str]) -> list[str]:
    """Kill every process inside the namespaces, then delete them; returns the names that still exist."""
    names = [n for n in names if n in existing_namespaces()]
    kill_processes(names)
    for name in reversed(names):  # hosts first: deleting a host namespace removes its veth pair
        _run(IP, "netns", "del", name, check=False)
    left = set(existing_namespaces())
    return [n for n in names if n in left]


def teardown(bed: Testbed) -> list[str]:
    """Remove every namespace, link and process of `bed`; safe to call twice or on a half-built testbed."""
    return remove_namespaces(list(bed.namespaces))


def clean_stale() -> list[str]:
    """Remove namespaces that runs of this tool left behind and whose process no longer exists; returns their names."""
    stale = []
    for name in existing_namespaces():
        match = _NAME.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            stale.append(name)
    remove_namespaces(stale)
    return stale


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`/`tc`, no permission), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    name = f"{new_run_id()}-probe"
    try:
        _run(IP, "netns", "add", name)
        _run(TC, "-V")
    except (OSError, TestbedError, subprocess.TimeoutExpired) as err:
        return f"cannot create a network namespace: {err}"
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _run(IP, "netns", "del", name, check=False)
    return None


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C so the testbed's `finally` removes everything."""


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


@contextlib.contextmanager
def testbed(hosts: int, link: LinkShape):
    """Build a testbed, yield it, and remove it on any exit: return, exception, Ctrl-C, SIGTERM or SIGHUP.
    Ctrl-C's handler is installed again (unless SIGINT is ignored): a C library may have reset it behind Python's back
    (CP-SAT did), and the default action kills the process before the `finally`."""
    bed = Testbed(run_id=new_run_id(), hosts=hosts, link=link)
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    ctrl_c = signal.getsignal(signal.SIGINT)
    if ctrl_c is not signal.SIG_IGN:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, ctrl_c if callable(ctrl_c) else signal.default_int_handler)
    try:
        build(bed)
        yield bed
    finally:
        try:
            left = teardown(bed)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if left:
            raise TestbedError(f"could not remove namespaces {', '.join(left)}; remove them with `ip netns del NAME`")
