"""Named fault points: a test arms one with SETTLED_FAULT=<name>:<action> to fail the process there.

Every step of the owner, the checkpoint and the close calls `point(name)`, and so does every
place that writes what settled promises (a log, a receipt, a checkpoint blob). The actions:
`crash` SIGKILLs the process at the point; `enospc` and `eio` raise the OSError a full or failing
disk gives (errno ENOSPC / EIO) at every pass through it, so a test proves that settled answers a
disk that refuses it with a typed, honest outcome. Unarmed, a point costs one comparison. Never
used for control flow.
"""

from __future__ import annotations

import errno
import os

OWNER_POINTS = (
    "owner.after_claim",
    "owner.after_boundary",
    "owner.after_spawn",
    "owner.mid_drain",
    "owner.after_death_evidence",
    "owner.before_receipt",
    "owner.log_write",  # before each write of drained output to its log
    "owner.log_sync",  # before each fsync of a log
    "owner.receipt_write",  # as the owner writes its receipt to the store
)
CHECKPOINT_POINTS = (
    "checkpoint.after_blobs",
    "checkpoint.after_manifest",
    "checkpoint.before_read_back",
    "checkpoint.blob_write",  # before each object is written to the object store
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
ACTIONS = ("crash", "enospc", "eio")
_ERRNO_OF = {"enospc": errno.ENOSPC, "eio": errno.EIO}

_ARMED_POINT, _, _ARMED_ACTION = os.environ.get("SETTLED_FAULT", "").partition(":")


def point(name: str) -> None:
    if name != _ARMED_POINT:
        return
    if _ARMED_ACTION == "crash":
        os.kill(os.getpid(), 9)  # SIGKILL: no handler, no cleanup, as a crash
    code = _ERRNO_OF.get(_ARMED_ACTION)
    if code is not None:
        raise OSError(code, f"{os.strerror(code)} (injected at fault point {name})")
