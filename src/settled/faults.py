"""Named fault points: a test arms one with SETTLED_FAULT=<name>:<action> to fail the process there.

Every step of the owner, the checkpoint, the close and recovery calls `point(name)`, so do the
server's answers that a lost response would leave unsaid, and so does every place that writes
what settled promises (a log, a receipt, a checkpoint blob). The actions: `crash` names the point
on stderr (an owner's is its owner.log) and SIGKILLs the process there; `enospc` and `eio` raise
the OSError a full or failing disk gives (errno ENOSPC / EIO) at every pass through it, so a test
proves that settled answers a disk that refuses it with a typed, honest outcome; `stop` SIGSTOPs
the process there (a slow one, until the test sends SIGCONT). Unarmed, a point
costs one comparison. Never used for control flow.
"""

from __future__ import annotations

import errno
import os

OWNER_POINTS = (
    "owner.before_ready",  # before the owner says its pid: a warm launcher has not claimed yet
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
RECOVERY_POINTS = (
    "recovery.after_unknown",  # detect marked a session unknown: its task's admission is frozen
    "recovery.after_take_over",  # the lost owner is fenced (generation moved on), nothing inspected
    "recovery.after_kill",  # the boundary was inspected and killed, nothing recorded of it
    "recovery.before_receipt",  # the logs are closed at the bytes on disk, the receipt not written
)
SERVER_POINTS = (
    "server.after_admission",  # the session is admitted (and launched), its response not sent
    "server.mid_stream",  # an output stream has sent a chunk and is about to send more
    "server.before_close_response",  # the close join has finished, its receipt not yet answered
)
# The placer's (boundary/placer.py), a child of the owner: a crash there is not the owner's, and
# its session is never started rather than lost (tests/test_limits.py; not the soak's).
PLACER_POINTS = (
    "placer.after_join",  # the placer joined the session's v1 cgroups, nothing placed
    "placer.limits_write",  # as the placer writes the session's limits
)
# The launcher's (owner/handoff.py), in the process that admitted the session: a crash there
# leaves a session no owner claimed, which whoever finds it settles never started
# (tests/test_self_recovery.py; not the soak's).
LAUNCHER_POINTS = ("launcher.before_claim",)
ALL_POINTS: tuple[str, ...] = (
    OWNER_POINTS + CHECKPOINT_POINTS + CLOSE_POINTS + RECOVERY_POINTS + SERVER_POINTS
)
ACTIONS = ("crash", "stop", "enospc", "eio")
_ERRNO_OF = {"enospc": errno.ENOSPC, "eio": errno.EIO}

_ARMED_POINT, _, _ARMED_ACTION = os.environ.get("SETTLED_FAULT", "").partition(":")


def arm(spec: str) -> None:
    """Arm `spec` (SETTLED_FAULT's form) in a process that took another's environment after it
    imported this module: an owner forked by the zygote runs with its caller's fault, not the
    zygote's."""
    global _ARMED_POINT, _ARMED_ACTION
    _ARMED_POINT, _, _ARMED_ACTION = spec.partition(":")


def point(name: str) -> None:
    if name != _ARMED_POINT:
        return
    if _ARMED_ACTION == "crash":
        try:  # which point it was, for whoever reads the process's stderr (if it has one)
            os.write(2, f"settled: crash at fault point {name}\n".encode())
        finally:
            os.kill(os.getpid(), 9)  # SIGKILL: no handler, no cleanup, as a crash
    if _ARMED_ACTION == "stop":  # SIGSTOP: a process slow at the point until a SIGCONT
        os.kill(os.getpid(), 19)
        return
    code = _ERRNO_OF.get(_ARMED_ACTION)
    if code is not None:
        raise OSError(code, f"{os.strerror(code)} (injected at fault point {name})")
