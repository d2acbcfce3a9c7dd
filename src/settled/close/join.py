"""The close join's driver: performs the one step decide.py names, records its fact, repeats.

Owns the I/O of the close: sealing admission, settling sessions through their owners (never by
touching processes itself), asking the workspace service for the final scan and checkpoint,
fencing the generation and publishing the close receipt. Each step is recorded in the store
before the next begins, so a crash at any fault point leaves a state a retried close finishes,
and a repeated close returns the same close receipt without running anything again. What a
step changes in the store itself (the task's transitions into closing and complete, the fence)
is written in the same transaction as its fact (``_recorded_with``), and the facts are read
again only when another close may have moved them (``_after``).

The deadline is one scope for the whole close, across a crash and a resume (deadline.py):
recorded with ``final_pending`` as a wall-clock time, kept by a resumed close unless it is given
a sooner one (never a later one; it cancels at once if the deadline passed), and, past it, every
late session is asked to stop at once and all the live ones are waited for under one bound from
that cancel (the longest ``CANCEL_SETTLE_S + grace`` among them), never one bound after another.

Recovery runs itself: a session whose owner is gone is recovered while the close waits for it
(sessions.py), one no owner claimed by the deadline is settled never started at once, and a
close blocked on a session (a retried one, whose wait is over) recovers it and decides again;
only what recovery cannot end (unknown without evidence, a live owner) blocks it, saying why.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from settled import faults
from settled.canonical import canonical_bytes
from settled.close.deadline import close_deadline, seconds_left, settle_bound
from settled.close.decide import (
    STEPS,
    Blocked,
    CloseFacts,
    Done,
    Next,
    command_outcomes,
    next_decision,
    output_losses,
)
from settled.close.facts import read_close_facts
from settled.errors import StaleWrite
from settled.netledger import brief
from settled.receipts import seal
from settled.records import SessionRecord, TaskRecord
from settled.states import TASK_COMPLETE, TASK_OPEN, TASK_SEALED, UNKNOWN, did_not_succeed
from settled.store import Store

CLOSE_RECEIPT_VERSION = "settled.receipt.close/v1"
DEFAULT_DEADLINE_S = 600.0
CANCEL_SETTLE_S = 30.0
# Only the last step's fact is committed durably (fsynced). The others are committed without
# waiting for the disk: a power cut can lose a tail of them (never a step without those before
# it: the store replays its log as a prefix), which leaves the facts of a crash after the last
# kept step, and the close resumes there, as from any crash (decide.py); the last step's fsync
# makes every earlier one durable before the close receipt is returned. Seven fsyncs of the
# store's log cost a close ~1.8 ms here.
LAST_STEP = STEPS[-1].name
# A close that loses a compare-and-set to another close of the same task re-reads the facts and
# resumes; each retry follows a write the other close made, so a few are enough, and a bound
# keeps a lost write that never resolves from looping.
MAX_LOST_WRITES = 16


@dataclass(frozen=True)
class CloseResult:
    complete: bool
    receipt: dict[str, Any] | None
    blocked_on: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        if self.receipt is not None:
            return self.receipt
        return {"complete": False, "blocked_on": self.blocked_on}


class Sessions(Protocol):
    """What the close asks of sessions: it never touches their processes (their owners do)."""

    def cancel(self, session: str, reason: str) -> Any: ...

    def settles_within(self, session: str, seconds: float) -> bool: ...

    def recover_lost(
        self, session: str, *, lapsed_lease: bool = False, closing: bool = False
    ) -> str | None:
        """Recovery of a session whose owner is gone, or never started if none claimed it
        (sessions.py); why recovery could not run, else None."""
        ...

    def status(self, session: str) -> dict[str, Any]: ...


class Workspace(Protocol):
    """The workspace service's part of the close: the final scan and the checkpoint."""

    def final_scan(self, task: TaskRecord) -> dict[str, Any]: ...

    def checkpoint(
        self, task: TaskRecord, scan_fact: dict[str, Any], sessions: list[SessionRecord]
    ) -> dict[str, Any]: ...

    def release(self, task: TaskRecord) -> None: ...


class Pod(Protocol):
    """The task's pod (boundary/pod.py): its own /tmp, /var/tmp, /dev/shm and HOME and its
    namespaces, which no checkpoint covers. The close says what they held, then ends them."""

    def held(self, task: str) -> dict[str, Any] | None: ...

    def release(self, task: str) -> None: ...


class Seals(Protocol):
    """Retry the seal of every settled session's logs not sealed yet (their logs are on this
    host); returns each stream left unsealed `{session, stream, why}`."""

    def __call__(self, sessions: list[SessionRecord]) -> list[dict[str, Any]]: ...


StepFunction = Callable[["CloseJoin", CloseFacts], dict[str, Any]]


class CloseJoin:
    def __init__(
        self,
        store: Store,
        workspace: Workspace,
        sessions: Sessions,
        task: str,
        final: str | None = None,
        deadline: float | None = None,
        pod: Pod | None = None,
        seals: Seals | None = None,
    ) -> None:
        self.store, self.workspace, self.sessions, self.pod = store, workspace, sessions, pod
        self.seals = seals  # retries the logs' seals before the outcome (owner/sealing.py)
        self.task, self.final = task, final
        self.deadline = deadline  # None: the caller named none (a resume keeps the recorded)

    def facts(self) -> CloseFacts:
        return read_close_facts(self.store, self.task)

    def run(self) -> CloseResult:
        """Perform steps until the close is done or blocked. Closes of one task may run at once
        (two `settled close`, two HTTP requests): a step's fact is recorded once (the first
        stands), and a close whose transition lost to the other's (StaleWrite) re-reads the
        facts and goes on from them, so both return the one recorded close receipt."""
        lost = 0
        facts, read = self.facts(), True
        recovered: dict[str, str | None] = {}  # blocked sessions recovered here: why it failed
        while True:
            decision = next_decision(facts)
            if isinstance(decision, Done):
                outcome = facts.steps["outcome"]
                if not read:  # the receipt as the store holds it: the canonical text this
                    # close recorded, parsed, which is what reading the store back returns
                    # (~0.9 ms for every session and step); never this close's own dict
                    outcome = json.loads(canonical_bytes(outcome))
                self._end_pod()  # also a close that crashed after recording its outcome
                return CloseResult(True, outcome["receipt"], None)
            if isinstance(decision, Blocked):
                session = decision.session
                if session is not None and session not in recovered:  # its wait is over:
                    # recovered as `settled recover` would (never a live owner), then decided
                    # again, so a retried close converges by itself
                    recovered[session] = self.sessions.recover_lost(
                        session, lapsed_lease=True, closing=True
                    )
                    facts, read = self.facts(), True
                    continue
                return CloseResult(False, None, self._blocked(decision, recovered))
            assert isinstance(decision, Next)
            name = decision.step.name
            try:
                fact = PERFORM[name](self, facts)
                with_fact = _recorded_with(name, facts)
                recorded = self.store.record_close_step(
                    self.task, name, fact, durable=name == LAST_STEP, **with_fact
                )
            except StaleWrite:
                lost += 1
                if lost > MAX_LOST_WRITES:
                    raise
                facts, read = self.facts(), True
                continue  # another close moved the task on: decide again from what it recorded
            faults.point(f"close.after_{name}")
            facts, read = self._after(facts, name, fact, recorded)

    def _blocked(self, decision: Blocked, recovered: dict[str, str | None]) -> dict[str, Any]:
        """What the close is blocked on, with `why` (what this close's recovery of the session
        found) and `next` (the command that goes on) once it tried."""
        blocked, session = decision.to_json(), decision.session
        if session is None or session not in recovered:
            return blocked
        view, failed = self.sessions.status(session), recovered[session]
        if view["state"] != UNKNOWN:  # its owner holds it, alive with its lease fresh
            why = f"it is {view['state']} and its owner is alive (its lease fresh)"
            return {**blocked, "why": why, "next": f"settled cancel {session}"}
        if failed is not None:  # not "still running": its owner is gone
            blocked["obligation"] = f"death evidence for session {session}: it is unknown"
            why = f"its owner is gone, and recovering it here failed: {failed}"
        else:
            why = f"no evidence that it stopped: {view.get('why')}; it stays "
            why += "unknown (never failed) until evidence arrives"
        return {**blocked, "why": why, "next": f"settled recover --task {self.task}"}

    def _after(
        self, facts: CloseFacts, name: str, fact: dict[str, Any], recorded: dict[str, Any]
    ) -> tuple[CloseFacts, bool]:
        """The facts after this close recorded ``name``: read again from the store when
        another close recorded that step first (its fact stands, and it may be further on) or
        when the sessions may have changed (they settle in ``sessions_settled``); otherwise
        the facts this close read, with its own step added and the task re-read (each step
        may move its state or generation). Reading every session's receipt and every step's
        fact again after each step cost a close of one session ~0.4 ms a step."""
        if recorded is not fact or name == "sessions_settled":
            return self.facts(), True
        steps = {**facts.steps, name: fact}
        return CloseFacts(self.store.get_task(self.task), facts.sessions, steps, facts.seals), False

    # -- the steps, in the order of decide.STEPS ------------------------------------------

    def _step_final_pending(self, facts: CloseFacts) -> dict[str, Any]:
        """The final response and the close's deadline, which every resume keeps."""
        now = time.time()
        deadline = close_deadline({}, self.deadline, now, DEFAULT_DEADLINE_S)  # none recorded yet
        return {
            "final": self.final,
            "received_at": now,
            "deadline_s": deadline.seconds,
            "deadline_at": deadline.at,
        }

    def _step_sealed(self, facts: CloseFacts) -> dict[str, Any]:
        if facts.task.state == TASK_OPEN:
            self.store.task_event(self.task, "seal")
        sessions = self.store.list_sessions(self.task)  # the admitted set, now frozen
        return {"sealed_at": time.time(), "sessions": [s.session for s in sessions]}

    def _step_sessions_settled(self, facts: CloseFacts) -> dict[str, Any]:
        """Stop services; wait for the required sessions until the recorded deadline; then
        cancel every one still live at once and wait for all the live ones under one bound.
        Those that still have not settled are named ``unsettled`` (the next step blocks on
        them, or recovery's Unknown does)."""
        live = [s for s in facts.sessions if s.live]
        services = [s for s in live if s.spec.get("service")]
        for service in services:
            self.sessions.cancel(service.session, "service stopped at close")
        required = [s for s in live if not s.spec.get("service")]
        deadline = close_deadline(
            facts.steps["final_pending"], self.deadline, time.time(), DEFAULT_DEADLINE_S
        )
        late = self._not_settled_by(required, seconds_left(deadline, time.time()))
        for session in late:
            self.sessions.cancel(session.session, f"close deadline of {deadline.seconds} s passed")
        cancelled_at = time.time()
        for session in [*late, *services]:  # unclaimed by now: never started, not waited for
            self.sessions.recover_lost(session.session, closing=True)
        bound = settle_bound([float(s.spec["grace"]) for s in live], CANCEL_SETTLE_S)
        unsettled = self._not_settled_by(live, bound)
        for session in unsettled:  # what the bound left, by the lease rules too
            self.sessions.recover_lost(session.session, lapsed_lease=True, closing=True)
        return {
            "settled_at": time.time(),
            "stopped_services": [s.session for s in services],
            "cancelled_at_deadline": [s.session for s in late],
            "unsettled": [s.session for s in unsettled],
            "deadline": deadline.to_json(),
            "cancelled_at": cancelled_at,
            "settle_bound_s": bound,
        }

    def _not_settled_by(self, sessions: list[SessionRecord], seconds: float) -> list[SessionRecord]:
        """The sessions that have not settled `seconds` from now. One bound for them all: each
        is waited for only what is left of it, so N sessions wait as long as the slowest."""
        give_up = time.monotonic() + seconds
        return [
            s
            for s in sessions
            if not self.sessions.settles_within(s.session, give_up - time.monotonic())
        ]

    def _step_receipts(self, facts: CloseFacts) -> dict[str, Any]:
        return {  # recorded with the task's close_begin (``_recorded_with``)
            "sessions": [
                {"session": s.session, "receipt": (s.receipt or {}).get("digest")}
                for s in facts.sessions
            ]
        }

    def _step_final_scan(self, facts: CloseFacts) -> dict[str, Any]:
        return self.workspace.final_scan(facts.task)

    def _step_checkpoint(self, facts: CloseFacts) -> dict[str, Any]:
        scan = facts.steps["final_scan"]
        receipt = self.workspace.checkpoint(facts.task, scan, facts.sessions)
        return {"receipt": receipt}

    def _step_fenced(self, facts: CloseFacts) -> dict[str, Any]:
        """Recorded with the fence itself (``_recorded_with``), unless the generation is past
        the checkpoint's already (a close that fenced, then crashed before recording, under a
        version that made them two writes); any other generation is another close's."""
        generation = int(facts.steps["checkpoint"]["receipt"]["generation"])
        if facts.task.generation not in (generation, generation + 1):
            raise StaleWrite(
                f"task {self.task} is at generation {facts.task.generation}, not the "
                f"checkpoint's {generation} (or the one after it)"
            )
        return {
            "fenced_generation": generation,
            "generation": generation + 1,
            "fenced_at": time.time(),
        }

    def _step_outcome(self, facts: CloseFacts) -> dict[str, Any]:
        checkpoint = facts.steps["checkpoint"]["receipt"]
        outcomes = command_outcomes(facts.sessions)
        receipt = seal(
            {
                "kind": "close",
                "v": CLOSE_RECEIPT_VERSION,
                "authority": "close",
                "task": self.task,
                "generation": facts.steps["fenced"]["fenced_generation"],
                "final": facts.steps["final_pending"]["final"],
                "workspace": {  # the checkpoint is this task's work alone only if shared by none
                    "path": facts.task.workspace,
                    "shared_workspace": facts.task.shared_workspace,
                    "shared_with": self.store.workspace_shares(self.task),
                },
                "sealed_at": facts.steps["sealed"]["sealed_at"],
                "sessions": [
                    {
                        "session": s.session,
                        "key": s.key,
                        "receipt": (s.receipt or {}).get("digest"),
                        "exit": (s.receipt or {}).get("exit"),
                        "terminal_mutation": (s.receipt or {}).get("terminal_mutation"),
                        **_network_line(s.receipt),
                    }
                    for s in facts.sessions
                ],
                "final_scan": {
                    k: v for k, v in facts.steps["final_scan"].items() if k != "index_ref"
                },
                "checkpoint": checkpoint,
                # what the task's own /tmp, HOME and namespaces held, outside the checkpoint,
                # now that nothing of the task can run (discarded once this is recorded)
                "pod": self.pod.held(self.task) if self.pod is not None else None,
                "fence": facts.steps["fenced"],
                "outcome": {
                    "complete": True,
                    "all_commands_succeeded": did_not_succeed(outcomes) == 0,
                    "commands": outcomes,
                    "output_incomplete": output_losses(facts.sessions),
                    "output_unsealed": self.seals(facts.sessions) if self.seals else [],
                },
            }
        )
        self.workspace.release(facts.task)  # then recorded with the task's complete
        return {"receipt": receipt}

    def _end_pod(self) -> None:
        """Release the task's pod once its outcome is recorded; a pod that cannot be released
        now is not the close's failure (the receipt stands), and a later close releases it."""
        if self.pod is not None:
            with contextlib.suppress(Exception):
                self.pod.release(self.task)


def _recorded_with(name: str, facts: CloseFacts) -> dict[str, Any]:
    """What a step changes in the same transaction as its fact (``Store.record_close_step``):
    the task's transition into closing and into complete, and the fence. One commit where
    there were two, and no crash can leave one without the other."""
    state = facts.task.state
    if name == "receipts" and state == TASK_SEALED:
        return {"event": "close_begin"}
    if name == "fenced":
        generation = int(facts.steps["checkpoint"]["receipt"]["generation"])
        return {"fence": generation} if facts.task.generation == generation else {}
    if name == "outcome" and state != TASK_COMPLETE:
        return {"event": "complete"}
    return {}


# The function that performs each step, by the names of decide.STEPS (test_close checks both).
PERFORM: dict[str, StepFunction] = {
    "final_pending": CloseJoin._step_final_pending,
    "sealed": CloseJoin._step_sealed,
    "sessions_settled": CloseJoin._step_sessions_settled,
    "receipts": CloseJoin._step_receipts,
    "final_scan": CloseJoin._step_final_scan,
    "checkpoint": CloseJoin._step_checkpoint,
    "fenced": CloseJoin._step_fenced,
    "outcome": CloseJoin._step_outcome,
}


def _network_line(receipt: dict[str, Any] | None) -> dict[str, Any]:
    """What left the sandbox through the proxy in this session, in one line (its receipt has
    the ledger), or nothing for a session without one."""
    ledger = ((receipt or {}).get("network") or {}).get("ledger")
    return {"network": brief(ledger)} if ledger is not None else {}
