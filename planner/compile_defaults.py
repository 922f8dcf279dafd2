"""What a compile does when `split_hosts` or `coalesce` is not given: the choice that measured best for
the problem's kind, read from the kind alone, so one compile makes one plan (no second compile to choose).

A multi-tensor problem (a weight sync: every FSDP shard's boxes go to each TP replica's host) gets both
on. The executor runs its plan posted (`TransferExecutor`'s default on MPI: every message at once), and
the chained plan both-off gives (each box down a broadcast chain through every destination host) shares
the NICs worse so: on the Llama-3-8B weight sync posted 1.14x the byte bound against 1.02x with both on,
on the small one 1.15x against 1.02x. A single-tensor problem keeps both off: its executor runs device
order, where both on is no faster on any of the 16 reference cases and 2-4x slower on five (case7,
case8, one_to_{2x2,3x2,4x2}: a split chain sends the whole tensor once per host). BENCHMARKS.md,
"Compile defaults" (bench/bench_compile_defaults.py).

>>> defaults_for_kind(multi_tensor=True)
CompileDefaults(split_hosts=True, coalesce=True)
>>> resolve(False, None, multi_tensor=True)
CompileDefaults(split_hosts=False, coalesce=True)

Every other compile setting travels with these in one frozen `CompileOptions`; `CompileOptions.resolved`
fills in everything left to the problem's kind (the two switches, the bundle bucket, shared messages)
in this one place, and refuses combinations that cannot work:

>>> o = CompileOptions(max_staging_bytes=2**20).resolved(multi_tensor=True)
>>> o.split_hosts, o.coalesce, o.bucket_bytes, o.cross_tensor, o.max_staging_bytes
(True, True, 1048576, True, 1048576)

Staging: the executor runs a multi-tensor plan posted (every message at once), which stages every staged box
at once: a busiest device of a 16-layer Llama-3-70B-like cut stages 3.65 GiB so, the full model and the MoE
ones tens of GiB. A compile given no `max_staging_bytes` applies no limit: the plan runs posted, the fastest order
(the 16-layer 70B cut: 1.034x the byte bound posted, 1.034x posted within a 1024 MiB window, 1.320x in device order
under that limit; BENCHMARKS.md, "Staging default"). Where posted order stages more than POSTED_STAGING_WARN_BYTES on a device,
`xmesh-plan compile` says so and names `--max-staging-mb` (`planner/staging_limit.py`: the plan states the limit
and runs posted within a window of it on MPI, `executor/window.py`). `max_staging_bytes=0` (`--max-staging-mb 0`) is the same as none.

>>> o = CompileOptions().resolved(multi_tensor=True)
>>> o.max_staging_bytes is None, CompileOptions(max_staging_bytes=NO_STAGING_LIMIT).resolved(multi_tensor=True).bucket_bytes == o.bucket_bytes
(True, True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.transfer import TransferProblem

from .coalesce import default_bucket_bytes
from .problem_io import InputError
from .staging_limit import MIB
from .unit_tasks import DEFAULT_MAX_TASKS

POSTED_STAGING_WARN_BYTES = 1024 * MIB  # posted staging on one device above which `xmesh-plan compile` names --max-staging-mb
NO_STAGING_LIMIT = 0  # `max_staging_bytes` (`--max-staging-mb`) that states no limit, as none given: posted, whatever it stages


@dataclass(frozen=True, slots=True)
class CompileDefaults:
    """The two compile switches a problem's kind decides: one unit task per receiving host, bundled small boxes."""

    split_hosts: bool
    coalesce: bool


SINGLE_TENSOR = CompileDefaults(split_hosts=False, coalesce=False)
MULTI_TENSOR = CompileDefaults(split_hosts=True, coalesce=True)


def defaults_for_kind(multi_tensor: bool) -> CompileDefaults:
    """Both on for a multi-tensor problem, both off for a single tensor (see the module docstring)."""
    return MULTI_TENSOR if multi_tensor else SINGLE_TENSOR


def defaults_for(problem: ReshardingProblem | TransferProblem) -> CompileDefaults:
    """`defaults_for_kind` of the problem: a `TransferProblem` is multi-tensor."""
    return defaults_for_kind(isinstance(problem, TransferProblem))


def resolve(split_hosts: bool | None, coalesce: bool | None, multi_tensor: bool) -> CompileDefaults:
    """The switches as given, each None (not given) replaced by the kind's default."""
    default = defaults_for_kind(multi_tensor)
    return CompileDefaults(default.split_hosts if split_hosts is None else split_hosts,
                           default.coalesce if coalesce is None else coalesce)


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """How to compile a problem (`compile.compile_plan`, `xmesh-plan compile`); None leaves a setting to the problem's
    kind (`resolved`). `strategy`: per unit task ("auto" picks the fastest); `solver`: the scheduler; `seed`: for
    randomized solvers; `time_limit_s`: solver budget in deterministic seconds; `merge`: adjacent identical cells as one
    box; `max_tasks`: refuse a problem that could cut into more unit tasks; `split_hosts`: one unit task per receiving
    host; `coalesce`: small boxes between two hosts in bundles of at most `bucket_bytes`; `cross_tensor`: bundles of
    several tensors share one message; `max_staging_bytes`: no device stages more in device order (None or
    NO_STAGING_LIMIT, 0: no limit)."""

    strategy: str = "broadcast"
    solver: str = "auto"
    seed: int = 0
    time_limit_s: float = 10.0
    merge: bool = True
    max_tasks: int | None = DEFAULT_MAX_TASKS
    split_hosts: bool | None = None
    coalesce: bool | None = None
    bucket_bytes: int | None = None
    max_staging_bytes: int | None = None
    cross_tensor: bool | None = None

    def resolved(self, multi_tensor: bool, message_bytes_per_s: float | None = None) -> "CompileOptions":
        """These options with nothing left to the kind: the switches (`resolve`), the bucket (as given, else the default
        for hosts whose messages move at `message_bytes_per_s`, `coalesce.default_bucket_bytes`, or the staging limit when
        less) and shared messages (on where a multi-tensor problem is coalesced). InputError for a
        bucket above the staging limit (a bundle is staged whole on both relays) or shared messages that cannot be."""
        bucket = _bucket(self.bucket_bytes, self.max_staging_bytes or None, default_bucket_bytes(message_bytes_per_s))
        chosen = resolve(self.split_hosts, self.coalesce, multi_tensor)
        cross = chosen.coalesce and multi_tensor if self.cross_tensor is None else self.cross_tensor
        if cross and not multi_tensor:
            raise InputError("--cross-tensor shares messages between the tensors of a multi-tensor problem, and this problem "
                             "has one tensor (its bundles already carry all of a host pair's small boxes); leave it out")
        if cross and not chosen.coalesce:
            raise InputError("--cross-tensor shares the messages of coalesced bundles, and this compile does not coalesce; "
                             "add --coalesce or leave out --cross-tensor")
        return dataclasses.replace(self, split_hosts=chosen.split_hosts, coalesce=chosen.coalesce, cross_tensor=cross,
                                   bucket_bytes=bucket)

    def for_problem(self, problem: ReshardingProblem | TransferProblem) -> "CompileOptions":
        """`resolved` for the problem's kind (a `TransferProblem` is multi-tensor) and its cluster's NICs."""
        return self.resolved(isinstance(problem, TransferProblem), problem.cluster.message_bytes_per_s)


def _bucket(bucket_bytes: int | None, max_staging_bytes: int | None, default: int) -> int:
    """The bundle bucket: as given, else `default` or the staging limit when less; refused above the limit."""
    if max_staging_bytes is None:
        return default if bucket_bytes is None else bucket_bytes
    if bucket_bytes is None:
        return min(default, max_staging_bytes)
    if bucket_bytes > max_staging_bytes:
        raise InputError(f"--bucket-mb {bucket_bytes / MIB:.4g} is above --max-staging-mb {max_staging_bytes / MIB:.4g}: a bundle is "
                         "staged whole on both relays; leave out --bucket-mb (bundles then take the staging limit), give "
                         "a smaller one, or raise --max-staging-mb")
    return bucket_bytes
