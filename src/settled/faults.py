"""Named fault points: a test arms one with SETTLED_FAULT=<name>:crash to SIGKILL the process there.

Every step of the owner, the checkpoint and the close calls `point(name)`. Unarmed,
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
CHECKPOINT_POINTS = (
    "checkpoint.after_blobs",
    "checkpoint.after_manifest",
    "checkpoint.before_read_back",
)
CLOSE_POINTS = (
    "close.after_final_pending",
    "close.after_sealed",
    "close.after_sessions_settled",
    "close.after_receipts",
    "close.after_final_scan",
    "close.after_checkpoint",
    "close.after_fenced",
    "close.after_outcome",
)
ALL_POINTS: tuple[str, ...] = OWNER_POINTS + CHECKPOINT_POINTS + CLOSE_POINTS

_ARMED_POINT, _, _ARMED_ACTION = os.environ.get("SETTLED_FAULT", "").partition(":")


def point(name: str) -> None:
    if name == _ARMED_POINT and _ARMED_ACTION == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
