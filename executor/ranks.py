"""Which device a rank plays: rank r plays the r-th smallest device id the plan uses.

The same rule holds for MPI ranks and for ranks of a torch process group. When the plan's devices
are the group's global ranks (as with DTensor meshes over torchrun's world), it is the identity:
device id = global rank.

Only devices in the source or destination mesh count, so a plan whose meshes leave gaps in the
device numbering (case 8 uses devices 0-2, 4-6, 8, 9, ...) needs no idle ranks. The world size must
equal the number of distinct devices used.

>>> from xmesh_plan.schemas import DeviceMesh
>>> devices_used_by((DeviceMesh(shape=(2,), devices=(4, 0)), DeviceMesh(shape=(1,), devices=(9,))))
(0, 4, 9)
"""

from __future__ import annotations

from typing import Iterable

from xmesh_plan.schemas import DeviceMesh, Plan
from xmesh_plan.schemas.plan_check import meshes

from .errors import PlanMismatchError


def devices_used_by(meshes: Iterable[DeviceMesh]) -> tuple[int, ...]:
    return tuple(sorted({d for mesh in meshes for d in mesh.devices}))


def plan_devices(plan: Plan) -> tuple[int, ...]:
    """Sorted distinct device ids of both meshes: index r is the device that rank r plays."""
    return devices_used_by(meshes(plan.problem))


def device_of_rank(plan: Plan, rank: int, world_size: int, world: str = "MPI world", launch: str = "mpiexec -n") -> int:
    """The device `rank` plays; refuses a world of the wrong size with the launch command to use."""
    devices = plan_devices(plan)
    if world_size != len(devices):
        shown = ",".join(map(str, devices[:12])) + (",..." if len(devices) > 12 else "")
        raise PlanMismatchError(
            f"plan {plan.problem.name or '(unnamed)'} uses {len(devices)} devices ({shown}) but this {world} has "
            f"{world_size} ranks; run with {launch} {len(devices)} (rank r plays the r-th smallest device id)",
            same_on_every_rank=True)
    return devices[rank]


def rank_of_devices(plan: Plan) -> dict[int, int]:
    """Device id -> the rank that plays it."""
    return {device: rank for rank, device in enumerate(plan_devices(plan))}
