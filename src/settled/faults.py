"""Named fault points: a test arms one with SETTLED_FAULT=<name>:crash to SIGKILL the process there.

Every step of the owner (and, later, the checkpoint and the close) calls `point(name)`. Unarmed,
a point costs one dict lookup. Never used for control flow.
"""

from __future__ import annotations

import os
import signal

OWNER_POINTS = (
    "owner.after_claim",
    "owner.after_boundary",
    "owner.after_spawn",
    "owner.mid_drain",
    "owner.after_death_evidence",
    "owner.before_receipt",
)
ALL_POINTS: tuple[str, ...] = OWNER_POINTS

_ARMED_POINT, _, _ARMED_ACTION = os.environ.get("SETTLED_FAULT", "").partition(":")


def point(name: str) -> None:
    if name == _ARMED_POINT and _ARMED_ACTION == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
