"""Hypothesis strategies: valid sharding specs and small random resharding problems."""

from __future__ import annotations

import math

from hypothesis import HealthCheck
from hypothesis import strategies as st

from xmesh_plan.planner.problem_io import build_problem

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def spec_for(draw, rank: int, mesh_rank: int) -> str:
    """A valid spec: each mesh axis shards at most one dim; axes within a dim in any order."""
    order = draw(st.permutations(range(mesh_rank)))
    owner = {a: draw(st.integers(-1, rank - 1)) for a in order}
    return " ".join("S" + "".join(str(a) for a in order if owner[a] == d) if d in owner.values() else "R" for d in range(rank))


@st.composite
def problems(draw):
    rank = draw(st.integers(1, 3))
    shape = [draw(st.one_of(st.integers(1, 4), st.integers(5, 24), st.just(0) if draw(st.integers(0, 9)) == 0 else st.integers(1, 4)))
             for _ in range(rank)]
    src_mesh = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
    dst_mesh = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
    # a 2-D mesh (A, B) means A hosts of B devices, so hosts must have at least B devices
    widest = max([m[1] for m in (src_mesh, dst_mesh) if len(m) == 2], default=1)
    devices_per_host = draw(st.integers(widest, 4))
    layout = draw(st.sampled_from(["disjoint", "shared_hosts", "shared_devices"]))
    dst: dict = {"shape": dst_mesh}
    if layout == "shared_hosts":
        dst["first_host"] = 0  # same hosts as the source, possibly the same device ids
    elif layout == "shared_devices":
        pool = list(range(math.prod(src_mesh) + math.prod(dst_mesh)))
        dst["devices"] = draw(st.permutations(pool))[: math.prod(dst_mesh)]
    nics = [{"send_gbps": draw(st.sampled_from([1.0, 10.0, 100.0])), "recv_gbps": draw(st.sampled_from([1.0, 10.0, 100.0]))}
            for _ in range(draw(st.integers(1, 2)))]
    cluster = {"devices_per_host": devices_per_host, "nics": nics, "latency_us": draw(st.sampled_from([0.0, 20.0])),
               "intra_host_gbps": draw(st.sampled_from([5.0, 800.0]))}
    raw = {"shape": shape, "dtype": draw(st.sampled_from(["int8", "bfloat16", "float32", "complex128"])), "cluster": cluster,
           "src": {"mesh": src_mesh, "spec": draw(spec_for(rank, len(src_mesh)))},
           "dst": {"mesh": dst, "spec": draw(spec_for(rank, len(dst_mesh)))}}
    return build_problem(raw)
