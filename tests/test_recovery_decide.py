"""Recovery's verdicts (recovery_decide.py) as tables: facts in, a verdict out, nothing runs.

tests/test_recovery.py proves the same verdicts with real owners killed and real boundaries
inspected; these tables name every case the verdict distinguishes.
"""

from __future__ import annotations

from typing import Any

import pytest

from settled.boundary.base import Evidence
from settled.records import OwnerFacts, OwnerInfo, SessionRecord
from settled.recovery_decide import (
    NOT_INSPECTABLE,
    RecoveryFacts,
    Settles,
    StaysUnknown,
    never_claimed,
    owner_gone,
    recovery_verdict,
    settled_by_another,
    unclaimed_too_long,
    with_last_words,
)

NOW = 1_000_000.0
OWNER = OwnerInfo(pid=4242, start_time=7, boot_id="boot", lease_until=NOW + 5, host=None)
GONE = OwnerFacts(False, "owner pid 4242 is gone", lease_fresh=False, process_alive=False)
STOPPED = OwnerFacts(False, "its lease ran out", lease_fresh=False, process_alive=True)
ALIVE = OwnerFacts(True, None, lease_fresh=True, process_alive=True)


def session(
    state: str = "unknown",
    owner: OwnerInfo | None = OWNER,
    boundary: str | None = "cgroup2+pidns",
    created_at: float = NOW - 100,
    receipt: dict[str, Any] | None = None,
) -> SessionRecord:
    return SessionRecord(
        "s_1", "t_1", "k", "sha256:x", {"grace": 1.0}, state, 3, owner, boundary, None, None,
        None, 0, 0, None, created_at, None, None, receipt,
    )  # fmt: skip


PROVEN = Evidence("cgroup2+pidns", True, "cgroup.events populated 0", {"existed": True})
PROVIDER = Evidence("sandbox", True, "destroyed", {"source": "provider"})
NONE_BOUNDARY = Evidence("none", True, "nothing was started", {})
UNCLAIMED = Evidence("cgroup2+pidns", True, "empty", {"claimed": False})
NO_PROOF = Evidence("pgroup", False, None, {})
SAID_WHY = Evidence("pgroup", False, None, {"why": "a member left the group"})

LOST = {
    "code": None, "signal": None, "reason": "owner_lost",
    "note": "the exit status was lost with the owner",
}  # fmt: skip
NEVER = {
    "code": None, "signal": None, "reason": "not_started",
    "note": "the owner died before it started the command",
}  # fmt: skip


@pytest.mark.parametrize(
    ("facts", "verdict"),
    [
        # proven dead: settled, the exit lost with the owner, the drain incomplete
        (RecoveryFacts(session(), PROVEN, "recovery", GONE),
         Settles("recovered", "recovery", LOST, "incomplete", False)),
        # a stopped owner (its process still there) may still append: its logs are copied
        (RecoveryFacts(session(), PROVEN, "recovery", STOPPED),
         Settles("recovered", "recovery", LOST, "incomplete", True)),
        # an owner that cannot be looked at is assumed to be writing
        (RecoveryFacts(session(), PROVEN, "destroy", None),
         Settles("recovered", "destroy", LOST, "incomplete", True)),
        # the provider's own word for its evidence wins over recovery's
        (RecoveryFacts(session(), PROVIDER, "recovery", GONE),
         Settles("recovered", "provider", LOST, "incomplete", False)),
        # nothing was ever started: not_started, the drain complete
        (RecoveryFacts(session(), NONE_BOUNDARY, "recovery", GONE),
         Settles("recovered", "recovery", NEVER, "complete", False)),
        (RecoveryFacts(session(), UNCLAIMED, "recovery", GONE),
         Settles("recovered", "recovery", NEVER, "complete", False)),
        (RecoveryFacts(session(owner=None), PROVEN, "recovery", None),
         Settles("recovered", "recovery", NEVER, "complete", True)),
        (RecoveryFacts(session(boundary=None), PROVEN, "recovery", GONE),
         Settles("recovered", "recovery", NEVER, "complete", False)),
        # no evidence: unknown, never failed, saying why
        (RecoveryFacts(session(), NO_PROOF, "recovery", GONE),
         StaysUnknown("boundary pgroup gave no evidence")),
        (RecoveryFacts(session(), SAID_WHY, "recovery", GONE),
         StaysUnknown("a member left the group")),
        # a vanished host: the provider's evidence settles it; the exit went with the host
        (RecoveryFacts(session(), PROVEN, vanished="host h_2 vanished"),
         Settles("vanished_host", "provider",
                 {**LOST, "note": "the exit status was lost with the host: host h_2 vanished"},
                 "incomplete", False)),
        (RecoveryFacts(session(), None, vanished="host h_2 vanished"),
         StaysUnknown(f"host h_2 vanished; {NOT_INSPECTABLE}")),
        (RecoveryFacts(session(), SAID_WHY, vanished="host h_2 vanished"),
         StaysUnknown("host h_2 vanished; a member left the group")),
        (RecoveryFacts(session(), NO_PROOF, vanished="gone"), StaysUnknown("gone; None")),
    ],
)  # fmt: skip
def test_recovery_verdict(facts: RecoveryFacts, verdict: StaysUnknown | Settles) -> None:
    assert recovery_verdict(facts) == verdict


@pytest.mark.parametrize(
    ("state", "created_at", "why"),
    [
        ("admitted", NOW - 31, "no owner claimed it in 31 s (its launcher died)"),
        ("admitted", NOW - 29, None),  # its launcher may still claim it
        ("running", NOW - 100, None),
    ],
)
def test_an_unclaimed_session_is_missing_its_owner_only_past_the_ready_timeout(
    state: str, created_at: float, why: str | None
) -> None:
    record = session(state=state, owner=None, created_at=created_at)
    assert unclaimed_too_long(record, NOW, 30.0) == why


@pytest.mark.parametrize(
    ("facts", "why"),
    [(None, None), (ALIVE, None), (GONE, "owner pid 4242 is gone"), (STOPPED, "its lease ran out")],
)
def test_an_owner_is_gone_only_when_seen_not_alive(
    facts: OwnerFacts | None, why: str | None
) -> None:
    assert owner_gone(facts) == why


def test_last_words_are_added_to_why() -> None:
    assert with_last_words("gone", None) == "gone"
    assert with_last_words("gone", {"reason": "oom"}) == "gone; its owner's last words: oom"


@pytest.mark.parametrize(
    ("state", "owner", "claimable"),
    [("admitted", None, True), ("admitted", OWNER, False), ("running", None, False),
     ("settled", None, False)],
)  # fmt: skip
def test_only_a_session_never_claimed_is_settled_by_its_launcher(
    state: str, owner: OwnerInfo | None, claimable: bool
) -> None:
    assert never_claimed(session(state=state, owner=owner)) is claimable


def test_a_lost_receipt_write_reports_the_other_recoverys_receipt_or_a_skip() -> None:
    won = session(state="settled", receipt={"death": {"evidence": "rmdir"}})
    assert settled_by_another(won, "lost") == {
        "session": "s_1", "state": "settled", "evidence": "rmdir"
    }  # fmt: skip
    assert settled_by_another(session(), "lost") == {
        "session": "s_1", "state": "skipped", "why": "lost"
    }  # fmt: skip
