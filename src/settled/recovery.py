"""Recovery (rule 4): Unknown is a real state, and only evidence ends it.

A session whose owner is missing (pid gone or reused, another boot, or a lease that was not
renewed) becomes `unknown` and freezes its task's admission; it is never relabelled failed and
never relaunched. Recovery fences the old owner (the session's generation advances, so its
heartbeat, receipt and claim are refused), inspects the boundary, and only on positive evidence
writes a receipt with `death.source: recovery`, the log closed at the bytes on disk and
`drain: incomplete`. A session whose boundary cannot give evidence stays unknown, with why.
A session no owner was ever claimed for (its launch failed first) is settled by its launcher as
never started without passing through unknown (`settle_unlaunched`): nothing of it can run; one
still unclaimed past the claim bound (its launcher is gone) is settled so by whoever finds it
(`settle_unclaimed`). Recovery runs itself: a waiter or a close that meets a session whose
owner is gone recovers it there (`recover_lost`) instead of waiting for `settled recover`.

This module owns recovery's I/O: it looks (the store, the owners, the sandbox, the last words)
and writes (unknown, take-over, receipts, the logs' close, then their seal where the home's
objects live outside it: owner/sealing.py, after the receipt). What it decides from what it saw
is recovery_decide.py's, pure, and never decided here. Over 400 lines: each way it settles a
session (recovered, vanished host, never started) keeps its receipt's builder beside it.
"""

from __future__ import annotations

import contextlib
import os
import time

from settled import faults
from settled.backends import seals_logs
from settled.errors import SettledError, StaleWrite
from settled.home import journal_socket, last_words_path, log_path
from settled.owner.last_words import read_last_words
from settled.receipts import process_receipt
from settled.records import LiveSession, OwnerFacts, SessionRecord
from settled.recovery_decide import (
    CLOSED_BEFORE_CLAIM,
    SANDBOX_DESTROYED,
    RecoveryFacts,
    Settles,
    StaysUnknown,
    lost_owner,
    never_claimed,
    owner_gone,
    recovery_verdict,
    settled,
    settled_by_another,
    skipped,
    stays_unknown,
    unclaimed_too_long,
    with_last_words,
)
from settled.sessions import SessionWatch
from settled.states import UNKNOWN
from settled.store import Store

CLAIM_BOUND_ENV = "SETTLED_CLAIM_BOUND_S"
# What settling a lost session needs (evidence, the log's close at disk, the sandbox) is
# imported where it settles one: every exec asks `detect`, which needs none of it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from settled.boundary.base import Evidence
    from settled.boundary.sandbox import SandboxProvider


class Recovery:
    """Detects owners that are gone and settles their sessions from the sandbox's evidence.

    Given the narrow things it uses: the store (every change a compare-and-set), the sessions'
    liveness view, the sandbox provider that inspects boundaries, and the home (where logs and
    the journal socket are)."""

    def __init__(
        self,
        store: Store,
        sessions: SessionWatch,
        sandbox: Callable[[], SandboxProvider],
        home: str,
        host: str | None = None,
    ) -> None:
        """`sandbox` opens the provider (on first use). `host`: this home's host id. Only
        sessions of its tasks are recovered here: a boundary of another host cannot be
        inspected from this one (its cgroup path here is empty, which would read as proof),
        and its owner is alive by its lease alone."""
        self.store, self.sessions, self.home = store, sessions, home
        self._open_sandbox = sandbox
        self.host = host
        self._task_hosts: dict[str, str | None] = {}

    @property
    def sandbox(self) -> SandboxProvider:
        """The provider, opened when a boundary is first inspected (detecting needs none)."""
        return self._open_sandbox()

    def ours(self, record: SessionRecord | LiveSession) -> bool:
        """Whether the session's task runs on this host (a task from before hosts: yes)."""
        if self.host is None:
            return True
        if record.task not in self._task_hosts:
            self._task_hosts[record.task] = self.store.get_task(record.task).host
        return self._task_hosts[record.task] in (None, self.host)

    def owner_missing(
        self, record: SessionRecord | LiveSession, now: float, facts: OwnerFacts | None = None
    ) -> str | None:
        """Why this live session has no owner, or None while it has one (or may still get one).
        `facts`: its owner's, when already looked at (`detect` looks at all of them at once)."""
        if not record.live:
            return None
        if record.owner is None:
            return unclaimed_too_long(record, now, claim_bound_s())
        return owner_gone(facts or self.sessions.liveness.facts(record.owner))

    def detect(self, task: str | None = None, *, force: bool = False) -> list[str]:
        """Mark every live session whose owner is missing as unknown; returns their ids.
        `force` (the sandbox was destroyed) takes every live session of the task. A session
        no owner claimed within the bound (`claim_bound_s`) is settled as never started
        instead (`settle_unclaimed`): it never ran, so it freezes nothing.

        Every new admission asks this of its task, so its owners are looked at together
        (`SessionWatch.owners_facts`): one poll over the pidfds of owners already seen alive
        instead of a read of /proc for each, with the same answer for each owner."""
        return self._look(task, force)[0]

    def _look(self, task: str | None, force: bool) -> tuple[list[str], list[dict[str, Any]]]:
        """`detect`: (the sessions it marked unknown, what settling the unclaimed ones did)."""
        now = time.time()
        records = list(filter(self.ours, self.store.live_owners(task)))
        looked = [None] * len(records) if force else self.sessions.owners_facts(records)
        found, unclaimed = [], []
        for record, facts in zip(records, looked, strict=True):
            why = SANDBOX_DESTROYED if force else self.owner_missing(record, now, facts)
            if why is None:
                continue
            if not force and never_claimed(record):
                settled_now = self.settle_unclaimed(record.session)
                if settled_now is not None:
                    unclaimed.append(settled_now)
                continue
            why = with_last_words(why, self.last_words(record.session))
            with contextlib.suppress(StaleWrite):  # it settled (or another detector won)
                self.store.mark_unknown(record.session, record.generation, why)
                found.append(record.session)
                faults.point("recovery.after_unknown")
        return found, unclaimed

    def last_words(self, session: str) -> dict[str, Any] | None:
        """What the session's owner recorded before it ended without a receipt, if anything."""
        return read_last_words(last_words_path(self.home, session))

    def recover(
        self,
        task: str | None = None,
        *,
        source: str = "recovery",
        evidence: Evidence | None = None,
        destroying: bool = False,
    ) -> list[dict[str, Any]]:
        """Settle every unknown session (of `task`) that has evidence, leaving one whose owner
        is alive and takes it back (`_owner_returns`) unless the task's sandbox is being
        destroyed (`destroying`). `evidence` is the provider's own for the whole task (its
        sandbox confirmed destroyed), which then stands for every session in it instead of
        each one's inspection."""
        unclaimed = self._look(task, False)[1]
        unknown = filter(self.ours, self.store.unknown_sessions(task))
        recovered = unclaimed + [
            self.recover_session(r, source, evidence)
            for r in unknown
            if destroying or not self._owner_returns(r)
        ]
        sweep = getattr(self.sandbox, "sweep", None)  # what dead owners left (limits' cgroups)
        if sweep is not None:
            sweep()
        return recovered

    def recover_lost(
        self, session: str, *, lapsed_lease: bool = False, closing: bool = False
    ) -> dict[str, Any] | None:
        """Recovery run by whoever meets the session (a waiter, a close): one whose owner's
        process is gone (with `lapsed_lease`, also one whose lease lapsed: `lost_owner`) is
        marked unknown, and an unknown one without a receipt is recovered (`recover_session`;
        one its owner settled without proof keeps the owner's why); one no owner
        claimed is settled never started (`settle_unclaimed`; `closing`: the close's deadline
        passed). What it did, or None when it left it: an owner that may still write, or a
        session of another host (only `recover --host` and a provider that can inspect it)."""
        record = self.store.get_session(session)
        if not self.ours(record):
            return None
        if never_claimed(record):
            return self.settle_unclaimed(session, closing=closing)
        if record.live:
            why = lost_owner(self.sessions.owner_facts(record), lapsed_lease=lapsed_lease)
            if why is None:
                return None
            why = with_last_words(why, self.last_words(session))
            try:
                record = self.store.mark_unknown(session, record.generation, why)
            except StaleWrite:  # it settled meanwhile, or another detector marked it
                record = self.store.get_session(session)
            faults.point("recovery.after_unknown")
        if record.state != UNKNOWN or record.receipt is not None:
            return None  # settled; or its owner's own receipt without proof, the best look
        if self._owner_returns(record):
            return None
        return self.recover_session(record, "recovery")

    def _owner_returns(self, record: SessionRecord) -> bool:
        """Whether an unknown session's owner is alive (by its lease, or on this host by its
        local beat: the store was out, not the owner): it takes the session back at its
        generation (states.py), so recovery leaves it, and never kills its command. A stopped
        or hung owner asks for nothing, so neither its lease nor its beat is fresh."""
        if record.receipt is not None:
            return False  # it settled the session unproven: its last word
        facts = self.sessions.owner_facts(record)
        return facts is not None and facts.alive

    def settle_unclaimed(self, session: str, *, closing: bool = False) -> dict[str, Any] | None:
        """Settle, as never started, a session no owner claimed within `claim_bound_s` of its
        admission (its launcher lost the store or was killed), or, `closing`, by its close's
        deadline; None while it may still be claimed, or if claimed or settled meanwhile.
        Safe against a launcher that is only slow: the receipt moves the session from
        `admitted` at its generation (a compare-and-set), a settled session refuses the claim,
        and a launcher whose claim is refused sends its owner no orders (owner/handoff.py)."""
        record = self.store.get_session(session)
        if not never_claimed(record):
            return None
        why = unclaimed_too_long(record, time.time(), claim_bound_s())
        if why is None and not closing:
            return None
        receipt = _unlaunched_receipt(self.home, record, why or CLOSED_BEFORE_CLAIM, "recovery")
        try:  # `unclaimed` is taken only from admitted: a claim made since refuses it
            self.store.write_receipt(session, record.generation, receipt, event="unclaimed")
        except StaleWrite:  # claimed meanwhile after all, or settled by another
            return None
        self._remove_made_ahead(record)  # only now: no owner can be claimed for it any more
        return settled(session, receipt["death"]["evidence"])

    def _remove_made_ahead(self, record: SessionRecord) -> None:
        """What a launcher that died before its claim made ahead (the session's cgroup): the
        provider's inspection of an unclaimed session removes it (no evidence: the receipt's is
        the refused claim), once the receipt makes any later claim fail; a provider that
        cannot answer leaves it to the task's destroy."""
        with contextlib.suppress(SettledError, OSError):
            self.sandbox.inspect(record, self.store.get_task(record.task))

    def recover_session(
        self, record: SessionRecord, source: str, given: Evidence | None = None
    ) -> dict[str, Any]:
        """Fence the lost owner, inspect the boundary (which kills what is left), and write
        what `recovery_verdict` decides from what was seen."""
        try:
            generation = self.store.take_over(record.session, record.generation)
        except StaleWrite as exc:  # another recovery took it, or its owner came back and settled
            return settled_by_another(self.store.get_session(record.session), str(exc))
        faults.point("recovery.after_take_over")
        killed_at = time.monotonic()  # inspect kills what is left of the command
        evidence = given or self.sandbox.inspect(record, self.store.get_task(record.task))
        faults.point("recovery.after_kill")
        owner = self.sessions.owner_facts(record)
        verdict = recovery_verdict(RecoveryFacts(record, evidence, source, owner))
        if isinstance(verdict, StaysUnknown):
            self.store.note_unknown(record.session, verdict.why)
            return stays_unknown(record.session, verdict)
        receipt = _recovered_receipt(self.home, record, generation, evidence, verdict, killed_at)
        faults.point("recovery.before_receipt")
        written = self._write(record, generation, receipt, evidence)
        self._seal_logs(record.session)
        return written

    # Until when recovery asks no object store for a seal: one that could not be reached is
    # not asked again for every recovered session of a pass (a stalled S3 costs ~30 s a try).
    _seals_away_until = 0.0
    SEALS_AWAY_S = 60.0

    def _seal_logs(self, session: str) -> None:
        """Seal a recovered session's logs where the home's objects live outside it, once: a
        seal that fails (the object store away) is the close's to retry and name."""
        if not seals_logs(self.home) or time.monotonic() < self._seals_away_until:
            return
        from settled.objects import open_object_store
        from settled.owner.sealing import seal_session, unreachable

        with contextlib.suppress(SettledError, OSError):
            record = self.store.get_session(session)
            failures = seal_session(self.home, self.store, open_object_store(self.home), record)
            if unreachable(failures) is not None:
                self._seals_away_until = time.monotonic() + self.SEALS_AWAY_S

    def _write(
        self, record: SessionRecord, generation: int, receipt: dict[str, Any], evidence: Evidence
    ) -> dict[str, Any]:
        """Write a recovered receipt at the generation recovery took over at."""
        try:
            self.store.write_receipt(record.session, generation, receipt, event="recover")
        except StaleWrite as exc:  # another recovery (a second destroy) took it over since
            return settled_by_another(self.store.get_session(record.session), str(exc))
        return settled(record.session, evidence.evidence)

    def settle_unlaunched(self, session: str, why: str) -> bool:
        """Settle, as never started, a session whose launch failed before any owner was claimed
        for it; `why` is its launcher's error. Whether it did: a claimed session is its
        owner's, and, should that owner be lost, recovery's.

        The launcher is the authority here, as the owner is for a command it could not start:
        only a launcher claims, it claims once, and an owner runs nothing without the orders
        sent after the claim, so a session still admitted was never run, nor ever will be:
        the receipt moves it from `admitted` at its generation (a compare-and-set), and a
        settled session refuses a claim. Without this, the session would wait out the launch
        timeout, turn unknown and freeze its task until `settled recover`."""
        record = self.store.get_session(session)
        if not never_claimed(record):
            return False
        receipt = _unlaunched_receipt(self.home, record, why, "launcher")
        try:
            self.store.write_receipt(session, record.generation, receipt, event="unclaimed")
        except StaleWrite:  # claimed meanwhile after all, or settled by another
            return False
        return True

    def recover_vanished(
        self, record: SessionRecord, why: str, given: Evidence | None = None
    ) -> dict[str, Any]:
        """Settle a session of a vanished host from its sandbox provider's evidence, or leave
        it unknown saying why. Never relaunched: its task is frozen. The host's logs went with
        it, so the output is the durable cursors its owner last published, `complete: false`,
        and the drain incomplete."""
        if record.live:
            with contextlib.suppress(StaleWrite):
                record = self.store.mark_unknown(record.session, record.generation, why)
        try:
            generation = self.store.take_over(record.session, record.generation)
        except StaleWrite as exc:
            return skipped(record.session, str(exc))
        evidence = given or self._inspect_elsewhere(record)
        verdict = recovery_verdict(RecoveryFacts(record, evidence, vanished=why))
        if isinstance(verdict, StaysUnknown):
            self.store.note_unknown(record.session, verdict.why)
            return stays_unknown(record.session, verdict)
        assert evidence is not None  # no verdict settles without it
        receipt = _vanished_host_receipt(record, generation, evidence, verdict, why)
        return self._write(record, generation, receipt, evidence)

    def _inspect_elsewhere(self, record: SessionRecord) -> Evidence | None:
        """The provider's answer for a session of another host (None from the local one,
        which can only see this host); a provider that fails to answer is no evidence."""
        if self.sandbox.name == "local":
            return None
        try:
            return self.sandbox.inspect(record, self.store.get_task(record.task))
        except SettledError as error:
            from settled.boundary.base import Evidence

            return Evidence("sandbox", False, None, {"why": f"the provider failed: {error}"})


def _vanished_host_receipt(
    record: SessionRecord, generation: int, evidence: Evidence, verdict: Settles, why: str
) -> dict[str, Any]:
    lost = "the log stayed on the vanished host; its owner last published this durable cursor"
    output = {
        name: {"cursor": cursor, "digest": None, "drained": None, "not_stored": None,
               "cap": None, "complete": False, "closed": lost}
        for name, cursor in (("stdout", record.stdout_durable), ("stderr", record.stderr_durable))
    }  # fmt: skip
    return process_receipt(
        session=record.session,
        task=record.task,
        key=record.key,
        command_digest=record.digest,
        generation=generation,
        death={**evidence.to_json(verdict.source), "boundary": "sandbox"},
        exit=verdict.exit,
        output={**output, "drain": verdict.drain},
        stragglers=[],
        terminal_mutation={
            "seq": None,
            "source": "none",
            "why": "the workspace journal was on the vanished host",
        },
        isolation=record.isolation,
        owner={
            "pid": os.getpid(),
            "role": "recovery",
            "lost_owner": record.owner.to_json() if record.owner else None,
            "unknown_why": why,
        },
        timings={"settled_at": time.time(), "admitted_at": record.created_at},
    )


def _network(home: str, record: SessionRecord, killed_at: float | None) -> dict[str, Any] | None:
    if ((record.isolation or {}).get("network") or {}).get("mode") != "proxy":
        return None
    from settled.netproxy.sealing import sealed_facts

    return sealed_facts(home, record.session, list(record.spec.get("allow_hosts", ())), killed_at)


def _logs_at_disk(home: str, session: str, *, writer_may_live: bool) -> dict[str, Any]:
    """Each stream's fact, closed at the bytes its log holds (log/recovered.py)."""
    from settled.log.recovered import close_at_disk

    return {
        stream: close_at_disk(log_path(home, session, stream), writer_may_live=writer_may_live)
        for stream in ("stdout", "stderr")
    }


# What proves a session no owner was claimed for never started, by who settled it.
_UNCLAIMED_EVIDENCE = {
    "launcher": "no owner was ever claimed for this session (its launch failed first)",
    "recovery": "no owner claimed this session (its launcher is gone, or its close's deadline "
    "passed first)",
}


def _unlaunched_receipt(home: str, record: SessionRecord, why: str, by: str) -> dict[str, Any]:
    """The receipt of a session no owner was ever claimed for: never started, at `launch`.
    `by`: "launcher" (its launch failed) or "recovery" (found unclaimed by another)."""
    from settled.boundary.base import Evidence
    from settled.receipts import not_started_fact

    evidence = Evidence(
        "none",
        True,
        f"{_UNCLAIMED_EVIDENCE[by]}, and this receipt settles it from admitted, which refuses "
        "any later claim: its command never started",
        {"claimed": False},
    )
    output = _logs_at_disk(home, record.session, writer_may_live=False)
    return process_receipt(
        session=record.session,
        task=record.task,
        key=record.key,
        command_digest=record.digest,
        generation=record.generation,
        death=evidence.to_json(by),
        exit=not_started_fact("launch", why),
        output={**output, "drain": "complete"},
        stragglers=[],
        terminal_mutation={"seq": None, "source": "none", "why": "the command never ran"},
        isolation=record.isolation,
        owner={"pid": os.getpid(), "role": by, "claimed": False},
        timings={"settled_at": time.time(), "admitted_at": record.created_at},
    )


def claim_bound_s() -> float:
    """How long after its admission a session may still be claimed: its launcher's readiness
    bound (owner/launcher.py `READY_TIMEOUT_S`), or SETTLED_CLAIM_BOUND_S (a test's shorter
    one). Past it, whoever finds the session unclaimed settles it never started."""
    with contextlib.suppress(ValueError):
        return float(os.environ.get(CLAIM_BOUND_ENV) or "")
    from settled.owner.launcher import READY_TIMEOUT_S

    return READY_TIMEOUT_S


def _recovered_receipt(
    home: str,
    record: SessionRecord,
    generation: int,
    evidence: Evidence,
    verdict: Settles,
    killed_at: float | None = None,
) -> dict[str, Any]:
    """The receipt of a lost owner's session, as `verdict` decided it. Its logs are closed in
    place (nothing written, so a full disk does not stop it) unless the lost owner may still be
    running, when a copy fences its late appends off (log/recovered.py). Under `--network
    proxy`, its ledger is sealed here, as its owner would have (`killed_at`: when recovery's
    inspection began)."""
    from settled.workspace.journal import wire as journal_wire

    output = _logs_at_disk(home, record.session, writer_may_live=verdict.writer_may_live)
    return process_receipt(
        session=record.session,
        task=record.task,
        key=record.key,
        command_digest=record.digest,
        generation=generation,
        death=evidence.to_json(verdict.source),
        exit=verdict.exit,
        output={**output, "drain": verdict.drain},
        stragglers=[],
        terminal_mutation=journal_wire.terminal_mutation(journal_socket(home), record.task),
        isolation=record.isolation,
        owner={
            "pid": os.getpid(),
            "role": "recovery",
            "lost_owner": record.owner.to_json() if record.owner else None,
            "unknown_why": record.unknown_why,
            "last_words": read_last_words(last_words_path(home, record.session)),
        },
        timings={"settled_at": time.time(), "admitted_at": record.created_at},
        network=_network(home, record, killed_at),
    )
