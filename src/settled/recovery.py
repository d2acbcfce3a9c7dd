"""Recovery (rule 4): Unknown is a real state, and only evidence ends it.

A session whose owner is missing (pid gone or reused, another boot, or a lease that was not
renewed) becomes `unknown` and freezes its task's admission; it is never relabelled failed and
never relaunched. Recovery fences the old owner (the session's generation advances, so its
heartbeat, receipt and claim are refused), inspects the boundary, and only on positive evidence
writes a receipt with `death.source: recovery`, the log closed at the bytes on disk and
`drain: incomplete`. A session whose boundary cannot give evidence stays unknown, with why.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

import blake3

from settled.atomic import replacing
from settled.boundary import inspect as boundary_inspect
from settled.boundary.base import Evidence
from settled.boundary.isolation import recorded_cgroup_contained
from settled.errors import StaleWrite
from settled.home import journal_socket, log_path
from settled.owner.launcher import READY_TIMEOUT_S
from settled.receipts import process_receipt
from settled.records import SessionRecord
from settled.states import ADMITTED, UNKNOWN

if TYPE_CHECKING:
    from settled.runtime import Runtime

COPY_CHUNK = 1 << 20


def owner_missing(rt: Runtime, record: SessionRecord, now: float) -> str | None:
    """Why this live session has no owner, or None while it has one (or may still get one)."""
    if not record.live:
        return None
    if record.owner is None:
        waited = now - record.created_at
        if record.state == ADMITTED and waited > READY_TIMEOUT_S:
            return f"no owner claimed it in {waited:.0f} s (its launcher died)"
        return None
    facts = rt.owner_facts(record)
    return None if facts is None or facts.alive else facts.why


def detect(rt: Runtime, task: str | None = None, *, force: bool = False) -> list[str]:
    """Mark every live session whose owner is missing as unknown; returns their ids.
    `force` (the sandbox was destroyed) takes every live session of the task."""
    now = time.time()
    found = []
    for record in rt.store.live_sessions(task):
        why = "the task's sandbox was destroyed" if force else owner_missing(rt, record, now)
        if why is None:
            continue
        with contextlib.suppress(StaleWrite):  # it settled (or another detector won) meanwhile
            rt.store.mark_unknown(record.session, record.generation, why)
            found.append(record.session)
    return found


def recover(
    rt: Runtime, task: str | None = None, *, source: str = "recovery"
) -> list[dict[str, Any]]:
    detect(rt, task)
    return [recover_session(rt, record, source) for record in rt.store.unknown_sessions(task)]


def recover_session(rt: Runtime, record: SessionRecord, source: str) -> dict[str, Any]:
    try:
        generation = rt.store.take_over(record.session, record.generation)
    except StaleWrite as exc:
        return {"session": record.session, "state": "skipped", "why": str(exc)}
    evidence = _inspect(record)
    if not evidence.proven:
        why = str(evidence.observed.get("why") or f"boundary {evidence.boundary} gave no evidence")
        rt.store.note_unknown(record.session, why)
        return {"session": record.session, "state": UNKNOWN, "why": why}
    receipt = _recovered_receipt(rt, record, generation, evidence, source)
    rt.store.write_receipt(record.session, generation, receipt, event="recover")
    return {"session": record.session, "state": "settled", "evidence": evidence.evidence}


def _inspect(record: SessionRecord) -> Evidence:
    """Positive evidence that nothing of this session can run, or why there is none."""
    if record.owner is None:
        return Evidence(
            "none",
            True,
            "no owner ever claimed this session and its claim is now fenced: its command can "
            "never start",
            {"claimed": False},
        )
    kind, ref = record.boundary, record.boundary_ref
    if kind is None:
        return Evidence(
            "none",
            True,
            "the owner died before it created a boundary, so before it started the command",
            {"boundary_recorded": False},
        )
    if kind == "cgroup2+pidns":
        return boundary_inspect.kill_cgroup_pidns(
            ref, boundary_inspect.cgroup_path_of(record.task, record.session)
        )
    if kind == "cgroup2":
        path = ref or boundary_inspect.cgroup_path_of(record.task, record.session)
        if path is None:
            return Evidence(kind, False, None, {"why": "cgroup2 is not available to recovery"})
        if not recorded_cgroup_contained(record.isolation):
            boundary_inspect.kill_cgroup(path)  # stop what is inside, even without evidence
            return Evidence(
                kind,
                False,
                None,
                {
                    "why": "the command ran without a cgroup namespace, so a process of it could "
                    "have moved to another cgroup, and only its owner (a subreaper) could have "
                    "found it; destroy the task's sandbox"
                },
            )
        return boundary_inspect.kill_cgroup(path)
    if kind == "pidns":
        if ref is None:
            return Evidence(
                kind,
                False,
                None,
                {"why": "the owner died between forking the namespace init and recording it"},
            )
        return boundary_inspect.kill_pidns_init(ref)
    return Evidence(
        kind,
        False,
        None,
        {
            "why": f"boundary {kind} gives no evidence once its owner is gone: its orphans "
            "were re-parented to init and cannot be enumerated; destroy the task's sandbox"
        },
    )


def _close_log(path: str) -> dict[str, Any]:
    """The stream ends at the bytes on disk. The file is replaced by a copy of exactly those
    bytes, so a fenced owner that wakes up appends to an orphaned inode, never to this log."""
    hasher = blake3.blake3()
    size = 0
    if os.path.exists(path):
        with open(path, "rb") as source, replacing(path, 0o400) as copy:
            while chunk := source.read(COPY_CHUNK):
                hasher.update(chunk)
                copy.write(chunk)
                size += len(chunk)
    return {"cursor": size, "digest": "blake3:" + hasher.hexdigest(), "drained": None,
            "not_stored": None, "cap": None}  # fmt: skip


def _recovered_receipt(
    rt: Runtime, record: SessionRecord, generation: int, evidence: Evidence, source: str
) -> dict[str, Any]:
    from settled.workspace.journal import client as journal_client

    output = {
        stream: _close_log(log_path(rt.home, record.session, stream))
        for stream in ("stdout", "stderr")
    }
    never_ran = not evidence.observed.get("claimed", True) or evidence.boundary == "none"
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
        terminal_mutation=journal_client.terminal_mutation(journal_socket(rt.home, record.task)),
        isolation=record.isolation,
        owner={
            "pid": os.getpid(),
            "role": "recovery",
            "lost_owner": record.owner.to_json() if record.owner else None,
            "unknown_why": record.unknown_why,
        },
        timings={"settled_at": time.time(), "admitted_at": record.created_at},
    )
