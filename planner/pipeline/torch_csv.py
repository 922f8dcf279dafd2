"""Our schedules in the CSV that `torch.distributed.pipelining` loads (`_PipelineScheduleRuntime._load_csv`).

Row r is pipeline rank r's actions, one stage per rank (stage r), each cell torch's action text:
`0F3` (stage 0, forward, micro-batch 3), `B` whole backward, `I`/`W` its input/weight parts.
Two forms, named as torch names its `format` argument:

- `compute_only`: our compute order; torch's lowering adds sends, receives and grad reduction.
- `compute_comms`: also our sends and receives where we placed them (torch's action names them
  per stage and micro-batch, not per tensor, so several tensors of one step become one action),
  and `REDUCE_GRAD` after each stage's last backward, as torch's own lowering puts it.

torch passes each stage's outputs to the next stage only, with its gradients back, so only
chain pipelines export: every boundary tensor from stage s to s+1, with a backward.

>>> actions = [[Action(0, "F", 0), Action(0, "SEND_F", 0, "h0"), Action(0, "RECV_B", 0, "h0"), Action(0, "B", 0)],
...            [Action(1, "RECV_F", 0, "h0"), Action(1, "F", 0), Action(1, "B", 0), Action(1, "SEND_B", 0, "h0")]]
>>> print(torch_csv(actions, "compute_comms"), end="")
0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD\r
1RECV_F0,1F0,1B0,1SEND_B0,1REDUCE_GRAD\r
>>> print(torch_csv(actions, "compute_only"), end="")
0F0,0B0\r
1F0,1B0\r
"""

from __future__ import annotations

import csv
import io

from xmesh_plan.schemas.pipeline import PipelineProblem

from .actions import Action

TORCH_FORMATS = ("compute_only", "compute_comms")
GRADIENT_DONE = ("B", "W")  # torch counts these per stage and reduces gradients after the last one
TorchAction = tuple[int, str, int | None]  # torch's _Action less its sub-actions: stage, kind, micro-batch


def check_torch_chain(problem: PipelineProblem) -> None:
    """Refuse, naming the tensor or stage, a pipeline that torch's pipelining runtime cannot run."""
    for tensor in problem.tensors:
        if tensor.dst_stage != tensor.src_stage + 1:
            raise ValueError(f"tensor {tensor.name!r} goes from stage {tensor.src_stage} to {tensor.dst_stage}; "
                             "torch.distributed.pipelining passes outputs only to the next stage, so export a pipeline "
                             "whose tensors all go from stage s to s+1")
        if not tensor.backward:
            raise ValueError(f"tensor {tensor.name!r} has backward off; torch.distributed.pipelining sends every "
                             "activation's gradient back, so set backward to true to export")
    linked = {t.src_stage for t in problem.tensors}
    for stage in range(len(problem.stages) - 1):
        if stage not in linked:
            raise ValueError(f"no boundary tensor goes from stage {stage} to {stage + 1}; torch.distributed.pipelining "
                             "passes every stage's output to the next stage, so add the tensor that links them")


def torch_action_text(action: TorchAction) -> str:
    """torch's text for an action, as its `_Action.__repr__` writes it: `0F3`, `0SEND_F3`, `0REDUCE_GRAD`."""
    stage, kind, micro_batch = action
    return f"{stage}{kind}{'' if micro_batch is None else micro_batch}"


def torch_rows(stage_actions: list[list[Action]], form: str = "compute_only") -> list[list[str]]:
    """Per rank, torch's action texts in our order (see the module docstring for the two forms)."""
    if form not in TORCH_FORMATS:
        raise ValueError(f"unknown torch CSV format {form!r}; use one of {', '.join(TORCH_FORMATS)}")
    return [[torch_action_text(a) for a in torch_actions(actions, form == "compute_comms")] for actions in stage_actions]


def torch_actions(actions: list[Action], comms: bool) -> list[TorchAction]:
    """One rank's actions in torch's terms; with `comms`, sends and receives too and the gradient reduction."""
    out: list[TorchAction] = []
    for action in actions:
        step = (action.stage, action.kind, action.micro_batch)  # the tensor name dropped
        if (comms or action.is_compute) and step not in out[-1:]:  # several tensors of one step: one torch action
            out.append(step)
    return _with_reduce_grad(out) if comms else out


def _with_reduce_grad(actions: list[TorchAction]) -> list[TorchAction]:
    """`sREDUCE_GRAD` after the stage's last B or W and the sends that follow it, where torch's lowering puts it."""
    done = [i for i, (_, kind, _) in enumerate(actions) if kind in GRADIENT_DONE]
    if not done:
        return actions
    at = done[-1] + 1
    while at < len(actions) and actions[at][1].startswith("SEND"):
        at += 1
    return [*actions[:at], (actions[0][0], "REDUCE_GRAD", None), *actions[at:]]


def torch_csv(stage_actions: list[list[Action]], form: str = "compute_only") -> str:
    """The CSV text, written as torch's `_dump_csv` writes it (csv module, one row per rank, `\\r\\n`)."""
    buffer = io.StringIO()
    csv.writer(buffer).writerows(torch_rows(stage_actions, form))
    return buffer.getvalue()
