"""Recovery (rule 4): Unknown is a real state, and only evidence ends it.

A session whose owner is missing (pid gone or reused, another boot, or a lease that was not
renewed) becomes `unknown` and freezes its task's admission; it is never relabelled failed and
never relaunched. Recovery fences the old owner (the session's generation advances, so its
heartbeat, receipt and claim are refused), inspects the boundary, and only on positive evidence
writes a receipt with `death.source: recovery`, the log closed at the bytes on disk and
`drain: incomplete`. A session whose boundary cannot give evidence stays unknown, with why.
A session no owner was ever claimed for (its launch failed first) is settled by its launcher as
never started without passing through unknown (`settle_unlaunched`): nothing of it can run.
"""

from __future__ import annotations

import contextlib
import os
import time

from settled import faults
from settled.errors import SettledError, StaleWrite
from settled.home import journal_socket, last_words_path, log_path
from settled.owner.last_words import read_last_words
from settled.receipts import process_receipt
from settled.records import LiveSession, OwnerFacts, SessionRecord
from settled.sessions import SessionWatch
from settled.states import ADMITTED, UNKNOWN
from settled.store import Store

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
            from settled.owner.launcher import READY_TIMEOUT_S

            waited = now - record.created_at
            if record.state == ADMITTED and waited > READY_TIMEOUT_S:
                return f"no owner claimed it in {waited:.0f} s (its launcher died)"
            return None
        facts = facts or self.sessions.liveness.facts(record.owner)
        return None if facts is None or facts.alive else facts.why

    def detect(self, task: str | None = None, *, force: bool = False) -> list[str]:
        """Mark every live session whose owner is missing as unknown; returns their ids.
        `force` (the sandbox was destroyed) takes every live session of the task.

        Every new admission asks this of its task, so its owners are looked at together
        (`SessionWatch.owners_facts`): one poll over the pidfds of owners already seen alive
        instead of a read of /proc for each, with the same answer for each owner."""
        now = time.time()
        records = list(filter(self.ours, self.store.live_owners(task)))
        looked = [None] * len(records) if force else self.sessions.owners_facts(records)
        found = []
        for record, facts in zip(records, looked, strict=True):
            why = (
                "the task's sandbox was destroyed"
                if force
                else self.owner_missing(record, now, facts)
            )
            if why is None:
                continue
            words = self.last_words(record.session)
            if words is not None:
                why = f"{why}; its owner's last words: {words['reason']}"
            with contextlib.suppress(StaleWrite):  # it settled (or another detector won)
                self.store.mark_unknown(record.session, record.generation, why)
                found.append(record.session)
                faults.point("recovery.after_unknown")
        return found

    def last_words(self, session: str) -> dict[str, Any] | None:
        """What the session's owner recorded before it ended without a receipt, if anything."""
        return read_last_words(last_words_path(self.home, session))

    def recover(
        self,
        task: str | None = None,
        *,
        source: str = "recovery",
        evidence: Evidence | None = None,
    ) -> list[dict[str, Any]]:
        """Settle every unknown session (of `task`) that has evidence. `evidence` is the
        provider's own for the whole task (its sandbox confirmed destroyed), which then stands
        for every session in it instead of each one's inspection."""
        self.detect(task)
        recovered = [
            self.recover_session(r, source, evidence)
            for r in filter(self.ours, self.store.unknown_sessions(task))
        ]
        sweep = getattr(self.sandbox, "sweep", None)  # what dead owners left (limits' cgroups)
        if sweep is not None:
            sweep()
        return recovered

    def recover_session(
        self, record: SessionRecord, source: str, given: Evidence | None = None
    ) -> dict[str, Any]:
        try:
            generation = self.store.take_over(record.session, record.generation)
        except StaleWrite as exc:
            return {"session": record.session, "state": "skipped", "why": str(exc)}
        faults.point("recovery.after_take_over")
        killed_at = time.monotonic()  # inspect kills what is left of the command
        evidence = given or self.sandbox.inspect(record, self.store.get_task(record.task))
        faults.point("recovery.after_kill")
        source = str(evidence.observed.get("source") or source)  # "provider": its own word
        if not evidence.proven:
            why = str(
                evidence.observed.get("why") or f"boundary {evidence.boundary} gave no evidence"
            )
            self.store.note_unknown(record.session, why)
            return {"session": record.session, "state": UNKNOWN, "why": why}
        facts = self.sessions.owner_facts(record)
        writer_may_live = facts is None or facts.process_alive
        receipt = _recovered_receipt(
            self.home, record, generation, evidence, source, writer_may_live, killed_at
        )
        faults.point("recovery.before_receipt")
        try:
            self.store.write_receipt(record.session, generation, receipt, event="recover")
        except StaleWrite as exc:  # another recovery (a second destroy) took it over since
            return _as_settled_by_another(self.store.get_session(record.session), exc)
        return {"session": record.session, "state": "settled", "evidence": evidence.evidence}

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
        if record.state != ADMITTED or record.owner is not None:
            return False
        receipt = _unlaunched_receipt(self.home, record, why)
        try:
            self.store.write_receipt(session, record.generation, receipt)
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
            return {"session": record.session, "state": "skipped", "why": str(exc)}
        evidence = given or self._inspect_elsewhere(record)
        if evidence is None or not evidence.proven:
            reason = (
                str(evidence.observed.get("why")) if evidence is not None
                else "the local sandbox of another host cannot be inspected from here; a "
                "sandbox provider that answers for it (SETTLED_SANDBOX=command:CONFIG) can"
            )  # fmt: skip
            self.store.note_unknown(record.session, f"{why}; {reason}")
            return {"session": record.session, "state": UNKNOWN, "why": f"{why}; {reason}"}
        receipt = _vanished_host_receipt(record, generation, evidence, why)
        try:
            self.store.write_receipt(record.session, generation, receipt, event="recover")
        except StaleWrite as exc:
            return _as_settled_by_another(self.store.get_session(record.session), exc)
        return {"session": record.session, "state": "settled", "evidence": evidence.evidence}

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
    record: SessionRecord, generation: int, evidence: Evidence, why: str
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
        death={**evidence.to_json("provider"), "boundary": "sandbox"},
        exit={
            "code": None,
            "signal": None,
            "reason": "owner_lost",
            "note": f"the exit status was lost with the host: {why}",
        },
        output={**output, "drain": "incomplete"},
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


def _as_settled_by_another(record: SessionRecord, lost: StaleWrite) -> dict[str, Any]:
    """What a recovery that lost its receipt write to another one reports: the receipt the other
    wrote when there is one, else that the other is still at it."""
    if record.receipt is not None:
        return {
            "session": record.session,
            "state": record.state,
            "evidence": record.receipt["death"].get("evidence"),
        }
    return {"session": record.session, "state": "skipped", "why": str(lost)}


def _logs_at_disk(home: str, session: str, *, writer_may_live: bool) -> dict[str, Any]:
    """Each stream's fact, closed at the bytes its log holds (log/recovered.py)."""
    from settled.log.recovered import close_at_disk

    return {
        stream: close_at_disk(log_path(home, session, stream), writer_may_live=writer_may_live)
        for stream in ("stdout", "stderr")
    }


def _unlaunched_receipt(home: str, record: SessionRecord, why: str) -> dict[str, Any]:
    """The receipt of a session no owner was ever claimed for: never started, at `launch`."""
    from settled.boundary.base import Evidence
    from settled.receipts import not_started_fact

    evidence = Evidence(
        "none",
        True,
        "no owner was ever claimed for this session (its launch failed first), and this "
        "receipt settles it from admitted, which refuses any later claim: its command never "
        "started",
        {"claimed": False},
    )
    output = _logs_at_disk(home, record.session, writer_may_live=False)
    return process_receipt(
        session=record.session,
        task=record.task,
        key=record.key,
        command_digest=record.digest,
        generation=record.generation,
        death=evidence.to_json("launcher"),
        exit=not_started_fact("launch", why),
        output={**output, "drain": "complete"},
        stragglers=[],
        terminal_mutation={"seq": None, "source": "none", "why": "the command never ran"},
        isolation=record.isolation,
        owner={"pid": os.getpid(), "role": "launcher", "claimed": False},
        timings={"settled_at": time.time(), "admitted_at": record.created_at},
    )


def _recovered_receipt(
    home: str,
    record: SessionRecord,
    generation: int,
    evidence: Evidence,
    source: str,
    writer_may_live: bool,
    killed_at: float | None = None,
) -> dict[str, Any]:
    """The receipt of a lost owner's session. Its logs are closed in place (nothing written,
    so a full disk does not stop it) unless the lost owner may still be running, when a copy
    fences its late appends off (log/recovered.py). Under `--network proxy`, its ledger is
    sealed here, as its owner would have (`killed_at`: when recovery's inspection began)."""
    from settled.workspace.journal import wire as journal_client

    output = _logs_at_disk(home, record.session, writer_may_live=writer_may_live)
    never_ran = (
        not evidence.observed.get("claimed", True)
        or evidence.boundary == "none"
        or record.owner is None
        or record.boundary is None
    )
    return process_receipt(
        session=record.session,
        task=record.task,
        key=record.key,
        command_digest=record.digest,
        generation=generation,
        death=evidence.to_json(source),
        exit={
            "code": None,
            "signal": None,
            "reason": "not_started" if never_ran else "owner_lost",
            "note": "the owner died before it started the command"
            if never_ran
            else "the exit status was lost with the owner",
        },
        output={**output, "drain": "complete" if never_ran else "incomplete"},
        stragglers=[],
        terminal_mutation=journal_client.terminal_mutation(journal_socket(home), record.task),
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
