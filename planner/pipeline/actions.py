"""The schedule IR: one action per step a stage takes, with a compact text form and its exact inverse.

`0F3` is stage 0's forward of micro-batch 3; `B` is a whole backward, `I` its input-gradient part
and `W` its weight-gradient part. Communication names the boundary tensor: `0SEND_F[h0]3` starts
sending activation h0 of micro-batch 3, `1RECV_B[h0]3` waits for its gradient.

>>> Action.from_str("1RECV_F[h0]3")
Action(stage=1, kind='RECV_F', micro_batch=3, tensor='h0')
>>> str(Action(0, "W", 2))
'0W2'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS
_ACTION = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(?:\[([A-Za-z_][A-Za-z0-9_.-]*)\])?(\d+)\Z")
EXAMPLES = "'0F3', '2I0', '0SEND_F[h0]3' or '1RECV_B[skip0]2'"


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """Stage `stage` does `kind` for `micro_batch`; communication kinds also name the tensor moved."""

    stage: int
    kind: str
    micro_batch: int
    tensor: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if (self.kind in COMM_KINDS) != (self.tensor is not None):
            need = "names a tensor, e.g. 0SEND_F[h0]3" if self.kind in COMM_KINDS else "names no tensor, e.g. 0F3"
            raise ValueError(f"action kind {self.kind} {need}")
        if self.stage < 0 or self.micro_batch < 0:
            raise ValueError(f"action {self.kind} has a negative stage or micro-batch; both count from 0")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def direction(self) -> str:
        """'F' for forward activations, 'B' for gradients (communication kinds only)."""
        return self.kind[-1]

    @property
    def transfer(self) -> tuple[str, str, int]:
        """The transfer a communication action belongs to: (tensor, direction, micro-batch)."""
        return (self.tensor, self.direction, self.micro_batch)

    def __str__(self) -> str:
        tensor = f"[{self.tensor}]" if self.tensor is not None else ""
        return f"{self.stage}{self.kind}{tensor}{self.micro_batch}"

    @classmethod
    def from_str(cls, text: str) -> "Action":
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(f"bad action {text!r}; write <stage><kind>[<tensor>]<micro-batch>, e.g. {EXAMPLES}")
        stage, kind, tensor, micro_batch = match.groups()
        return cls(int(stage), kind, int(micro_batch), tensor)


def format_actions(actions: list[Action]) -> str:
    """One stage's list as one line of space-separated actions."""
    return " ".join(map(str, actions))


def parse_actions(line: str, stage: int | None = None) -> list[Action]:
    """Inverse of `format_actions`; with `stage`, every action must belong to it."""
    actions = [Action.from_str(token) for token in line.split()]
    for action in actions:
        if stage is not None and action.stage != stage:
            raise ValueError(f"action {action} is in the line of stage {stage}; each line holds one stage's actions")
    return actions
