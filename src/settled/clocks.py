"""The four clocks of a session, as pure decisions over recorded facts: what `/ui` shows.

Owns, for each session of a task, when each clock settled and which receipt (kind and digest)
settled it, or why it has not: transport (the admission is durable, so a retried request can
never launch twice), process (the process receipt's death evidence), output (the receipt's
final cursors and digests with a complete drain) and workspace (the close's checkpoint, read
back exactly, covering the session's terminal mutation from a scan that began after its death
evidence). Also the task's own line: its state, whether complete, and its close receipt.

Must never: do I/O, or call a clock settled on anything weaker than the rule the close join
decides by (``close.decide.coverage_gaps``): a clock without its receipt is "not yet", one whose
evidence is missing or cannot exist is "unknown", and a drain that lost bytes is "incomplete".
The status projection (``status.session_status``) decides whether a live-looking session is
unknown; this module only reads its answer.
"""

from __future__ import annotations

from settled.close.decide import STEPS, CloseFacts, explain
from settled.records import OwnerFacts, SessionRecord
from settled.states import TASK_COMPLETE, is_live
from settled.status import command_words, session_status, task_state_word

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

SETTLED = "settled"  # a clock's state, not a session's: the same word, another subject
NOT_YET = "not_yet"
UNKNOWN_CLOCK = "unknown"
INCOMPLETE = "incomplete"
CLOCKS = ("transport", "process", "output", "workspace")
SESSIONS_SHOWN = 50  # a task's newest sessions on the page (each row ~1.5 KB); the rest counted


def _clock(
    state: str,
    words: str,
    at: float | None = None,
    by: dict[str, Any] | None = None,
    **facts: Any,
) -> dict[str, Any]:
    return {"state": state, "at": at, "by": by, "words": words, "facts": facts}


def _receipt_ref(receipt: dict[str, Any]) -> dict[str, Any]:
    return {"kind": receipt.get("kind"), "digest": receipt.get("digest")}


def _evidence_at(receipt: dict[str, Any]) -> float | None:
    at = receipt.get("timings", {}).get("settled_at") or receipt.get("issued_at")
    return None if at is None else float(at)


def transport(record: SessionRecord) -> dict[str, Any]:
    """Settled once the admission is recorded: whatever happens to the request that asked, a
    retry with its key returns this session and launches nothing."""
    return _clock(
        SETTLED,
        f"admission recorded under key {record.key}: a retried request gets this session, "
        "never a second launch",
        record.created_at,
        {"kind": "admission", "digest": record.digest},
        key=record.key,
    )


def process(record: SessionRecord, view: dict[str, Any]) -> dict[str, Any]:
    receipt = record.receipt
    if is_live(view["state"]):
        pid = (view.get("owner") or {}).get("pid")
        doing = "running" if record.started_at else "admitted, not yet claimed by its owner"
        words = f"{doing}{f' (owner pid {pid})' if pid else ''}: no death evidence yet"
        return _clock(NOT_YET, words, started_at=record.started_at)
    if receipt is not None and receipt.get("death", {}).get("proven"):
        death = receipt["death"]
        return _clock(
            SETTLED,
            str(death.get("evidence")),
            _evidence_at(receipt),
            _receipt_ref(receipt),
            boundary=death.get("boundary"),
            source=death.get("source"),
            exit=receipt.get("exit"),
            stragglers=len(receipt.get("stragglers") or ()),
        )
    why = view.get("why") or "no process receipt with death evidence"
    return _clock(UNKNOWN_CLOCK, str(why), by=None if receipt is None else _receipt_ref(receipt))


def _streams(output: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {k: (output.get(name) or {}).get(k) for k in ("cursor", "digest", "dropped")}
        for name in ("stdout", "stderr")
    }


def output(record: SessionRecord, view: dict[str, Any]) -> dict[str, Any]:
    receipt = record.receipt
    durable = {"stdout": record.stdout_durable, "stderr": record.stderr_durable}
    if receipt is None:
        if is_live(view["state"]):
            return _clock(NOT_YET, "draining: durable cursors so far", durable=durable)
        return _clock(
            UNKNOWN_CLOCK,
            "no receipt names the final byte of either stream; the durable cursors below "
            "are only what reached the log",
            durable=durable,
        )
    facts = receipt.get("output", {})
    streams = _streams(facts)
    words = ", ".join(f"{n} {s['cursor']} bytes ({s['digest']})" for n, s in streams.items())
    if facts.get("drain") != "complete":
        return _clock(
            INCOMPLETE,
            f"drain {facts.get('drain')}: final cursors {words}, but bytes may be lost "
            "(the owner was lost before it drained to end of file)",
            _evidence_at(receipt),
            _receipt_ref(receipt),
            streams=streams,
        )
    lost = [f"{n}: {s['dropped']} bytes drained, not stored" for n, s in streams.items()
            if s["dropped"]]  # fmt: skip
    note = f"; {'; '.join(lost)}" if lost else ""
    return _clock(
        SETTLED,
        f"drained to end of file: {words}{note}",
        _evidence_at(receipt),
        _receipt_ref(receipt),
        streams=streams,
    )


def workspace(
    record: SessionRecord, view: dict[str, Any], steps: Mapping[str, dict[str, Any]]
) -> dict[str, Any]:
    """Settled by the close's checkpoint under the same rule the close decides by: a verified
    read-back, a watermark at or past the terminal mutation, a scan begun after the death."""
    receipt = record.receipt
    if receipt is None or not receipt.get("death", {}).get("proven"):
        state = NOT_YET if is_live(view["state"]) else UNKNOWN_CLOCK
        return _clock(state, "waits on the process clock: a checkpoint covers a dead tree only")
    mutation = receipt.get("terminal_mutation") or {}
    seq = mutation.get("seq")
    checkpoint = (steps.get("checkpoint") or {}).get("receipt")
    scan = steps.get("final_scan")
    if checkpoint is None or scan is None:
        return _clock(
            NOT_YET,
            f"terminal mutation {seq}; no checkpoint yet: the close takes one after every "
            "session's death evidence",
            terminal_mutation=mutation,
        )
    gap = _coverage_gap(checkpoint, scan, seq, _evidence_at(receipt) or 0.0)
    if gap is not None:
        return _clock(NOT_YET, gap, by=_receipt_ref(checkpoint), terminal_mutation=mutation)
    close = (steps.get("outcome") or {}).get("receipt")
    return _clock(
        SETTLED,
        f"checkpoint {checkpoint.get('manifest')} covers mutation {seq} (watermark "
        f"{checkpoint.get('watermark')}) and read back exactly",
        float(checkpoint.get("issued_at") or 0.0) or None,
        _receipt_ref(checkpoint),
        terminal_mutation=mutation,
        manifest=checkpoint.get("manifest"),
        close=None if close is None else close.get("digest"),
    )


def _coverage_gap(
    checkpoint: dict[str, Any], scan: dict[str, Any], seq: Any, evidence_at: float
) -> str | None:
    watermark = checkpoint.get("watermark")
    if seq is not None and (watermark is None or watermark < seq):
        return f"checkpoint watermark {watermark} does not cover mutation {seq}"
    if float(scan.get("started_at", 0.0)) < evidence_at:
        return "the checkpoint's scan started before this session's death evidence"
    if not checkpoint.get("read_back", {}).get("verified"):
        return f"manifest {checkpoint.get('manifest')} did not read back exactly"
    return None


def session_clocks(
    record: SessionRecord, owner: OwnerFacts | None, steps: Mapping[str, dict[str, Any]]
) -> dict[str, Any]:
    """One row of the page: the session, its command and state, and its four clocks."""
    view = session_status(record, owner)
    return {
        "session": record.session,
        "key": record.key,
        "command": command_words(record.spec),
        "state": view["state"],
        "exit": (record.receipt or {}).get("exit"),
        "network": view.get("network"),  # what left through the proxy, once it settled
        "created_at": record.created_at,
        "clocks": {
            "transport": transport(record),
            "process": process(record, view),
            "output": output(record, view),
            "workspace": workspace(record, view, steps),
        },
    }


def task_clocks(
    facts: CloseFacts, owners: Mapping[str, OwnerFacts | None], limit: int = SESSIONS_SHOWN
) -> dict[str, Any]:
    """The task's line and its newest ``limit`` sessions' clocks (``owners`` holds what was
    observed of each live session's owner; a settled session needs none)."""
    explained = explain(facts)
    task = facts.task
    state = task_state_word(task)
    if task.state != "open" and not explained["complete"] and explained.get("blocked"):
        state = "blocked"
    newest = sorted(facts.sessions, key=lambda s: (s.created_at, s.session))[-limit:]
    close = (facts.steps.get("outcome") or {}).get("receipt")
    return {
        "task": task.task,
        "key": task.key,
        "workspace": task.workspace,
        "state": state,
        "final": task.state == TASK_COMPLETE,
        "complete": bool(explained["complete"]),
        "created_at": task.created_at,
        "words": explained["words"],
        "blocked_on": explained.get("blocked_on"),
        "close_steps": [s.name for s in STEPS if s.name in facts.steps],
        "close": None if close is None else {**_receipt_ref(close), "at": close.get("issued_at")},
        "close_receipt": close,
        **({"frozen": task.frozen} if task.frozen else {}),
        "sessions_total": len(facts.sessions),
        "sessions": [
            session_clocks(s, owners.get(s.session), facts.steps) for s in reversed(newest)
        ],
    }
