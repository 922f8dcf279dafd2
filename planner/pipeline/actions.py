"""The schedule IR (defined in `schemas.pipeline`, shared with the executor's pipeline runner).

>>> str(Action.from_str("0SEND_F[h0]3"))
'0SEND_F[h0]3'
"""

from xmesh_plan.schemas.pipeline import COMM_KINDS, COMPUTE_KINDS, KINDS, Action, format_actions, parse_actions

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "KINDS", "Action", "format_actions", "parse_actions"]
