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
"""

from __future__ import annotations

from dataclasses import dataclass

from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.transfer import TransferProblem


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
