"""Recovery's verdicts as pure functions of what it observed (rule 4), like close/decide.py.

recovery.py gathers the facts (the session's record, what its boundary or sandbox provider
answered, its lost owner as last seen, the owner's last words) and writes what these functions
decide: whether a live session's owner is missing and why, whether an unknown session settles
and with which receipt (recovered on this host, or of a vanished host) and what it says of the
exit and the drain, or why it stays unknown; and what a recovery that lost a compare-and-set
reports (another recovery settled it, or is still at it).

Must never: read /proc, a log, the store or a sandbox, or write anything. It imports records
and states only, so a test hands it facts and nothing runs (tests/test_recovery_decide.py).
"""

from __future__ import annotations

from settled.records import Frozen, OwnerFacts, SessionRecord
from settled.states import ADMITTED, UNKNOWN

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    from settled.records import LiveSession

    class Observed(Protocol):
        """What a boundary or sandbox provider answered (boundary/base.py `Evidence`)."""

        boundary: str
        proven: bool
        evidence: str | None
        observed: dict[str, object]


# Why a session of another host stays unknown when nothing here can inspect its sandbox.
NOT_INSPECTABLE = (
    "the local sandbox of another host cannot be inspected from here; a "
    "sandbox provider that answers for it (SETTLED_SANDBOX=command:CONFIG) can"
)
SANDBOX_DESTROYED = "the task's sandbox was destroyed"


def unclaimed_too_long(
    record: SessionRecord | LiveSession, now: float, ready_timeout_s: float
) -> str | None:
    """Why a live session no owner has claimed is missing one: still admitted past the time
    a launcher has to claim it (its launcher died); None while it may still be claimed."""
    waited = now - record.created_at
    if record.state == ADMITTED and waited > ready_timeout_s:
        return f"no owner claimed it in {waited:.0f} s (its launcher died)"
    return None


def owner_gone(owner: OwnerFacts | None) -> str | None:
    """Why a live session's recorded owner is missing (its pid gone or reused, another boot,
    a lease not renewed), or None while it is alive or cannot be looked at."""
    return None if owner is None or owner.alive else owner.why


def lost_owner(owner: OwnerFacts | None, *, lapsed_lease: bool) -> str | None:
    """Why a session met by a waiter or a close has lost its owner, or None while the owner may
    still write (alive; or, unless `lapsed_lease`, its process still runs with only its lease
    lapsed: stopped, hung or starved, which only the lease rules of `detect`, `settled
    recover` and the server's pass take over). A waiter recovers a session whose owner's
    process is gone; a close past its wait bound takes the lease's word too."""
    if owner is None or owner.alive or (owner.process_alive and not lapsed_lease):
        return None
    return owner.why


def with_last_words(why: str, words: dict[str, Any] | None) -> str:
    """Why a session becomes unknown, with what its owner recorded before it ended, if it did."""
    return why if words is None else f"{why}; its owner's last words: {words['reason']}"


# Why a close settles, as never started, a session no owner claimed by the close's deadline.
CLOSED_BEFORE_CLAIM = "the close's deadline passed before any owner claimed it"


def never_claimed(record: SessionRecord | LiveSession) -> bool:
    """Whether a session no owner was ever claimed for can be settled as never started by its
    launcher: still admitted with no owner (a claimed one is its owner's, then recovery's)."""
    return record.state == ADMITTED and record.owner is None


class RecoveryFacts(Frozen):
    """What recovery observed of one unknown session it took over. `evidence` None: nothing
    here can inspect its boundary. `owner`: its lost owner as looked at after the inspection
    (None: gone, or not looked at). `vanished`: why its host is gone, for a session of a
    vanished host (None: one of this host)."""

    __slots__ = ("evidence", "owner", "record", "source", "vanished")
    record: SessionRecord
    evidence: Observed | None
    source: str
    owner: OwnerFacts | None
    vanished: str | None

    def __init__(
        self,
        record: SessionRecord,
        evidence: Observed | None,
        source: str = "recovery",
        owner: OwnerFacts | None = None,
        vanished: str | None = None,
    ) -> None:
        self._fill(locals())


class StaysUnknown(Frozen):
    """No evidence: the session stays unknown (never relabelled failed), saying why."""

    __slots__ = ("why",)
    why: str

    def __init__(self, why: str) -> None:
        self._fill(locals())


class Settles(Frozen):
    """Positive evidence: the session settles with a receipt of `kind` ("recovered", or
    "vanished_host"), its death written as `source`'s, with this exit and drain. When the lost
    owner may still be running (`writer_may_live`), its logs are closed by a copy that fences
    its late appends off, not in place."""

    __slots__ = ("drain", "exit", "kind", "source", "writer_may_live")
    kind: str
    source: str
    exit: dict[str, Any]
    drain: str
    writer_may_live: bool

    def __init__(
        self, kind: str, source: str, exit: dict[str, Any], drain: str, writer_may_live: bool
    ) -> None:
        self._fill(locals())


Verdict = StaysUnknown | Settles


def recovery_verdict(facts: RecoveryFacts) -> Verdict:
    """Whether the unknown session settles, and with which receipt, or why it stays unknown."""
    evidence = facts.evidence
    if facts.vanished is not None:
        return _vanished_verdict(facts.vanished, evidence)
    if evidence is None or not evidence.proven:
        return StaysUnknown(_no_evidence_words(evidence))
    never_ran = (
        not evidence.observed.get("claimed", True)
        or evidence.boundary == "none"
        or facts.record.owner is None
        or facts.record.boundary is None
    )
    return Settles(
        "recovered",
        str(evidence.observed.get("source") or facts.source),  # "provider": its own word
        {
            "code": None,
            "signal": None,
            "reason": "not_started" if never_ran else "owner_lost",
            "note": "the owner died before it started the command"
            if never_ran
            else "the exit status was lost with the owner",
        },
        "complete" if never_ran else "incomplete",
        facts.owner is None or facts.owner.process_alive,
    )


def _vanished_verdict(why: str, evidence: Observed | None) -> Verdict:
    """A session of a vanished host: settled on its provider's evidence, its exit and the tail
    of its output lost with the host, or unknown saying why there is no evidence."""
    if evidence is None or not evidence.proven:
        reason = str(evidence.observed.get("why")) if evidence is not None else NOT_INSPECTABLE
        return StaysUnknown(f"{why}; {reason}")
    exit_fact = {
        "code": None,
        "signal": None,
        "reason": "owner_lost",
        "note": f"the exit status was lost with the host: {why}",
    }
    return Settles("vanished_host", "provider", exit_fact, "incomplete", False)


def _no_evidence_words(evidence: Observed | None) -> str:
    if evidence is None:
        return "no boundary gave evidence"
    return str(evidence.observed.get("why") or f"boundary {evidence.boundary} gave no evidence")


# -- what recovery reports for each session ----------------------------------------------


def skipped(session: str, why: str) -> dict[str, Any]:
    """Another recovery took the session over first (a lost compare-and-set)."""
    return {"session": session, "state": "skipped", "why": why}


def stays_unknown(session: str, verdict: StaysUnknown) -> dict[str, Any]:
    return {"session": session, "state": UNKNOWN, "why": verdict.why}


def settled(session: str, evidence: str | None) -> dict[str, Any]:
    return {"session": session, "state": "settled", "evidence": evidence}


def settled_by_another(record: SessionRecord, lost: str) -> dict[str, Any]:
    """What a recovery that lost its receipt write to another one reports: the receipt the other
    wrote when there is one, else that the other is still at it."""
    if record.receipt is not None:
        return {
            "session": record.session,
            "state": record.state,
            "evidence": record.receipt["death"].get("evidence"),
        }
    return skipped(record.session, lost)
