"""The resharding problem: tensor, source and destination (mesh, spec or per-device boxes), and the cluster they run on."""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import product
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema, field_validator, model_validator

from .boxes import Boxes, box_cut_points, check_boxes, uncovered
from .convert import check_cast
from .dtypes import DTYPE_SIZES, canonical_dtype, check_dtype
from .geometry import Layout, Region
from .limits import (MAX_DEVICE_ID, MAX_GBPS, MAX_LATENCY_US, MAX_MESH_DEVICES, MAX_TENSOR_RANK, MIN_GBPS, Length,
                     check_int64_product, check_mesh_size, finite, integer)
from .spec import ShardingSpec, SpecError

def _parse_spec(value: object) -> ShardingSpec:
    return value if isinstance(value, ShardingSpec) else ShardingSpec.parse(value)


_SPEC_SCHEMA = WithJsonSchema({"type": "string", "examples": ["S0 R R", "R S01 R"], "description": "R or S<mesh axes> per tensor dim"})
Spec = Annotated[ShardingSpec, BeforeValidator(_parse_spec), PlainSerializer(str, return_type=str), _SPEC_SCHEMA]
OptionalSpec = Annotated[ShardingSpec | None, BeforeValidator(_parse_spec), PlainSerializer(str, return_type=str), _SPEC_SCHEMA]
"""A spec where boxes may stand instead: absent (the default, never validated) or a spec; an explicit null is refused."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Nic(BaseModel):
    """One network interface of a host; full duplex, so send and receive are separate."""

    model_config = _FROZEN
    send_gbps: finite(MIN_GBPS, MAX_GBPS, description="send bandwidth, Gbit/s") = 10.0
    recv_gbps: finite(MIN_GBPS, MAX_GBPS, description="receive bandwidth, Gbit/s") = 10.0


class Cpu(BaseModel):
    """The CPU that every rank of every host shares (the emulated cluster: all hosts on one machine), opt-in.

    With it, a message inside a host is CPU work at both ends instead of a transfer on an intra-host link:
    each end spends `message_us` plus its bytes at `copy_gbps` (shared-memory copies: the sender's in, the
    receiver's out), and a local copy its bytes once. Each rank gets at most one core; all ranks at work
    at once share `cores` max-min fairly. Messages between hosts are priced as without it.
    """

    model_config = _FROZEN
    cores: finite(1e-3, MAX_MESH_DEVICES, description="cores all ranks of all hosts share") = 2.0
    message_us: finite(0, MAX_LATENCY_US, description="CPU time at each end of a message inside a host, microseconds") = 0.0
    copy_gbps: finite(MIN_GBPS, MAX_GBPS, description="bytes one core copies through shared memory, Gbit/s") = 24.0

    @property
    def copy_bytes_per_us(self) -> float:
        return self.copy_gbps * 1e3 / 8


class Cluster(BaseModel):
    """Hosts of identical shape: devices per host, NICs per host, the intra-host link, and what each message
    costs besides its bytes: a latency (a delay other messages overlap) and an overhead (time its link is busy).

    The default is the paper's: 4 GPUs per host over NVLink, one 10 Gbit/s NIC per host.
    Device d lives on host d // devices_per_host.
    """

    model_config = _FROZEN
    devices_per_host: integer(1, MAX_MESH_DEVICES, "a device count") = 4
    nics: tuple[Nic, ...] = Field((Nic(),), min_length=1, description="NICs of every host")
    intra_host_gbps: finite(MIN_GBPS, MAX_GBPS, description="device-to-device bandwidth inside a host, Gbit/s") = 800.0
    latency_us: finite(0, MAX_LATENCY_US, description="delay of one message from its last byte sent to its arrival, "
                       "microseconds; links carry other messages meanwhile") = 20.0
    overhead_us: finite(0, MAX_LATENCY_US, description="time a link is busy with one message besides its bytes "
                        "(per-message software and NIC work), microseconds") = 1.0
    cpu: Cpu | None = Field(None, exclude_if=lambda v: v is None,
                            description="the CPU every rank shares (emulated clusters; None: not modelled)")

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    @property
    def send_bytes_per_s(self) -> float:
        return sum(n.send_gbps for n in self.nics) * 1e9 / 8

    @property
    def recv_bytes_per_s(self) -> float:
        return sum(n.recv_gbps for n in self.nics) * 1e9 / 8

    @property
    def message_bytes_per_s(self) -> float:
        """How fast one cross-host message moves alone: striped over every NIC, each lane at its slower side."""
        return sum(min(n.send_gbps, n.recv_gbps) for n in self.nics) * 1e9 / 8

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra_host_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6

    @property
    def overhead_s(self) -> float:
        return self.overhead_us * 1e-6


class DeviceMesh(BaseModel):
    """A logical mesh: its shape and the global device id at each position (row-major)."""

    model_config = _FROZEN
    shape: tuple[integer(1, MAX_MESH_DEVICES, "an axis size"), ...] = Field(min_length=1)
    devices: tuple[integer(0, MAX_DEVICE_ID, "a device id"), ...]

    @model_validator(mode="after")
    def _check(self) -> "DeviceMesh":
        check_mesh_size(self.shape, "mesh shape")
        if len(self.devices) != math.prod(self.shape):
            raise ValueError(f"mesh {self.label} needs {math.prod(self.shape)} device ids, got {len(self.devices)}")
        if len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
            raise ValueError(f"mesh {self.label} device ids must be distinct and >= 0")
        return self

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))

    def coords(self) -> list[tuple[int, ...]]:
        """Mesh coordinates in the order of `devices`."""
        return list(product(*(range(s) for s in self.shape)))

    def hosts(self, cluster: Cluster) -> list[int]:
        return sorted({cluster.host_of(d) for d in self.devices})


class Placement(BaseModel):
    """A tensor's layout on one side: a mesh and either a sharding spec (the short form) or each device's box
    (`schemas.boxes`: layouts a spec cannot say, one box per mesh position in the order of `mesh.devices`)."""

    model_config = _FROZEN
    mesh: DeviceMesh
    spec: OptionalSpec = Field(None, exclude_if=lambda v: v is None, description="R or S<mesh axes> per tensor dim")
    boxes: Boxes | None = Field(None, exclude_if=lambda v: v is None,
                                description="each device's box, in the order of mesh.devices (instead of spec)")

    @model_validator(mode="after")
    def _one_form(self) -> "Placement":
        if (self.spec is None) == (self.boxes is None):
            raise ValueError("give spec (e.g. \"S0 R\") or boxes (one [[start, stop], ...] per device), not both or neither")
        return self

    @property
    def label(self) -> str:
        """The spec as text, or `boxes` for a box layout (what listings print)."""
        return "boxes" if self.spec is None else str(self.spec)

    def layout_key(self) -> tuple:
        """What decides the layout besides the tensor's shape: equal keys, equal boxes."""
        return (self.mesh.shape, self.label if self.boxes is None else self.boxes)


class ReshardingProblem(BaseModel):
    """Move a tensor of `shape` and `dtype` from (src mesh, spec) to (dst mesh, spec) on `cluster`."""

    model_config = _FROZEN
    name: str = ""
    shape: tuple[Length, ...] = Field(min_length=1, max_length=MAX_TENSOR_RANK)
    dtype: str = "float32"
    dst_dtype: str | None = Field(None, exclude_if=lambda v: v is None,
                                  description="the destination's element type where the senders convert (schemas.convert)")
    src: Placement
    dst: Placement
    cluster: Cluster = Cluster()

    @field_validator("dtype", "dst_dtype", mode="before")
    @classmethod
    def _canonical_dtype(cls, value: object) -> object:
        return canonical_dtype(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "ReshardingProblem":
        check_dtype(self.dtype)
        if self.dst_dtype is not None:
            check_dtype(self.dst_dtype)
            check_cast(self.dtype, self.dst_dtype)
        check_int64_product(self.shape, max(self.itemsize, self.src_itemsize), "shape")
        for side in ("src", "dst"):
            placement: Placement = getattr(self, side)
            if placement.boxes is not None:
                _check_side_boxes(placement, self.shape, side)
                continue
            try:
                placement.spec.check_fits(len(self.shape), placement.mesh.shape, field=f"{side}.spec")
            except SpecError as err:
                raise ValueError(str(err)) from None
        return self

    @property
    def itemsize(self) -> int:
        """Bytes of one element as it crosses: the destination dtype's where the senders convert."""
        return DTYPE_SIZES[self.dst_dtype or self.dtype]

    @property
    def src_itemsize(self) -> int:
        """Bytes of one element in a source shard."""
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def tensor_problems(self) -> list["ReshardingProblem"]:
        """The problem's tensors one by one (a `TransferProblem` has many): this one."""
        return [self]

    def layout(self, side: str) -> Layout:
        """The spec layout of a side (a box layout has none: see `has_boxes`)."""
        placement: Placement = getattr(self, side)
        if placement.spec is None:
            raise ValueError(f"{side} is a box layout; it has no spec layout (read blocks({side!r}) instead)")
        return Layout(tuple(self.shape), tuple(placement.mesh.shape), placement.spec)

    @property
    def has_boxes(self) -> bool:
        """Whether either side lists boxes instead of a spec."""
        return self.src.boxes is not None or self.dst.boxes is not None

    def cut_points(self, side: str) -> list[list[int]]:
        """Per dim, every bound of a box of that side, 0 and the length included."""
        placement: Placement = getattr(self, side)
        if placement.boxes is not None:
            return box_cut_points(tuple(self.shape), placement.boxes)
        return self.layout(side).cut_points()

    def blocks(self, side: str) -> dict[int, Region]:
        """Device id -> the box it holds on that side (computed once per distinct shape and placement: the
        tensors of a model repeat a few layouts many times, and every rank's lowering asks for each)."""
        return dict(_blocks(tuple(self.shape), getattr(self, side)))

    def block_of(self, side: str, device: int) -> Region | None:
        """`blocks(side).get(device)` without copying the table (a rank asks once per tensor, of thousands)."""
        return _blocks(tuple(self.shape), getattr(self, side)).get(device)


@lru_cache(maxsize=1024)
def _blocks(shape: tuple[int, ...], placement: Placement) -> dict[int, Region]:
    if placement.boxes is not None:
        return dict(zip(placement.mesh.devices, placement.boxes))
    layout = Layout(shape, tuple(placement.mesh.shape), placement.spec)
    return {d: layout.block(c) for d, c in zip(placement.mesh.devices, placement.mesh.coords())}


def _check_side_boxes(placement: Placement, shape: tuple[int, ...], side: str) -> None:
    """One box per device inside the tensor; the source's boxes together cover every element (the destination
    takes what it lists: each of its elements is then held by some source device)."""
    check_boxes(placement.boxes, tuple(shape), len(placement.mesh.devices), f"{side}.boxes")
    if side == "src" and (hole := uncovered(tuple(shape), placement.boxes)) is not None:
        where = "[" + ", ".join(f"{a}:{b}" for a, b in hole) + "]"
        raise ValueError(f"src.boxes: no source device holds {where} of the tensor; every element must be in some "
                         "source box: widen a box or add a device that holds it")
