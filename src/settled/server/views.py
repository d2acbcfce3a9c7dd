"""What each endpoint asks the Runtime, as plain functions run on a worker thread.

Owns: the scope check of every task and session a request names (outside the token's scope it
is reported exactly as unknown), and the JSON each endpoint answers with. Every function takes
the worker's ``Runtime`` first and the request's ``Grant`` second, and returns JSON-ready data.

Must never: run on the event loop, wait without a bound (the close join's deadline bounds it
and runs on a thread of its own), touch processes (the owner does; ``signal`` only asks it), or
decide anything the Runtime decides (status, completion, reuse are the Runtime's answers).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from settled.errors import BadInput, UnknownSession, UnknownTask
from settled.identity import parse_user
from settled.records import SessionRecord, TaskRecord
from settled.render import explain_brief
from settled.requests import ExecRequest, TaskRequest
from settled.runtime import Runtime
from settled.server.auth import Grant
from settled.server.errors import NotPermitted
from settled.states import SETTLED, UNKNOWN

if TYPE_CHECKING:
    from settled.runtime import StreamLog

ESCALATION = (
    "TERM, KILL and INT are all delivered as a cancel of the session: its owner (not this "
    "server, not the reader) sends TERM to the whole boundary, waits the session's grace, then "
    "sends KILL, and writes the receipt; the signal actually sent is in the receipt's `exit`"
)


def visible_task(rt: Runtime, grant: Grant, task: str) -> TaskRecord:
    if not grant.sees(task):
        raise UnknownTask(task)
    return rt.task_record(task)


def visible_session(rt: Runtime, grant: Grant, session: str) -> SessionRecord:
    record = rt.session_record(session)
    if not grant.sees(record.task):
        raise UnknownSession(session)
    return record


def new_task(rt: Runtime, grant: Grant, request: TaskRequest) -> dict[str, Any]:
    if not grant.creates_tasks:
        raise NotPermitted(
            f"this token is scoped to task(s) {grant.describe()} and cannot create tasks; "
            'use a token whose scope is "*"'
        )
    return rt.create_task(request).to_json()


def task_status(rt: Runtime, grant: Grant, task: str) -> dict[str, Any]:
    visible_task(rt, grant, task)
    return rt.task_status(task)


def explain(rt: Runtime, grant: Grant, task: str) -> dict[str, Any]:
    """``Runtime.explain``, with ``brief``: its short form for a person (`/ui` shows it)."""
    visible_task(rt, grant, task)
    explained = rt.explain(task)
    return {**explained, "brief": explain_brief(explained)}


def admit(rt: Runtime, grant: Grant, task: str, request: ExecRequest) -> dict[str, Any]:
    """``Runtime.admit``: the store decides new (201) or reused (200); a conflict raises."""
    record = visible_task(rt, grant, task)
    if not grant.creates_tasks:
        _refuse_weakening(grant, record, request)
    return rt.admit(task, request).to_json()


def _refuse_weakening(grant: Grant, task: TaskRecord, request: ExecRequest) -> None:
    """A task-scoped token is what an agent holds: it may run commands in its task, never
    loosen the sandbox they run in (no isolation, a granted host path, another user, a
    limit above its task's)."""
    weakened = []
    if request.isolation == "none":
        weakened.append("isolation none")
    for grant_kind in ("writable", "readable"):
        if getattr(request, grant_kind):
            weakened.append(f"{grant_kind} {getattr(request, grant_kind)}")
    defaults = task.defaults or {}
    strictness = ("host", "proxy", "none")  # each reaches less than the one before
    asked_network, standing_network = request.network, defaults.get("network", "proxy")
    if (
        asked_network in strictness
        and standing_network in strictness
        and strictness.index(asked_network) < strictness.index(standing_network)
    ):
        weakened.append(f"network {asked_network} (its task's is {standing_network})")
    standing_hosts = set(defaults.get("allow_hosts") or ())
    asked_hosts = set(request.allow_hosts or ())
    if standing_hosts and asked_hosts - standing_hosts:
        weakened.append(f"allow_hosts {sorted(asked_hosts - standing_hosts)} (beyond its task's)")
    for limit in ("memory", "pids", "cpus"):
        asked, standing = getattr(request, limit), defaults.get(limit)
        if asked is not None and (standing is None or asked > standing):
            weakened.append(f"{limit} {asked} (its task's is {standing or 'the host default'})")
    if request.user is not None and parse_user(str(request.user)) != task.user:
        weakened.append(f"user {request.user}")
    if weakened:
        raise NotPermitted(
            f"this token is scoped to task(s) {grant.describe()}: it cannot ask for "
            f"{', '.join(weakened)}; the task's own isolation and user apply"
        )


def session_status(rt: Runtime, grant: Grant, session: str) -> dict[str, Any]:
    visible_session(rt, grant, session)
    return rt.session_status(session)


def recover_lost(rt: Runtime, grant: Grant, session: str) -> dict[str, Any]:
    """What a long poll does before it answers unknown or not yet (as ``Runtime.wait`` does):
    recover the session if its owner's process is gone, settle it never started if no owner
    claimed it within the claim bound; its status after."""
    visible_session(rt, grant, session)
    return rt.recover_lost(session)


def exit_handle(rt: Runtime, grant: Grant, session: str) -> int | None:
    visible_session(rt, grant, session)
    return rt.exit_handle(session)


def is_settled(view: dict[str, Any]) -> bool:
    """The long poll's end: a receipt exists, or the session is unknown. (``Runtime.wait``
    also waits out an unknown whose owner process still runs; the long poll answers it.)"""
    return view["state"] == UNKNOWN or (view["state"] == SETTLED and "receipt" in view)


def signal(
    rt: Runtime, grant: Grant, session: str, name: str, reason: str | None
) -> tuple[bool, dict[str, Any]]:
    """(delivered, answer): a live session gets a cancel request; a finished one nothing."""
    record = visible_session(rt, grant, session)
    live = record.live
    view = rt.cancel(session, reason or f"SIG{name} requested over HTTP") if live else None
    return live, {
        "session": session,
        "signal": name,
        "delivered_as": "cancel" if live else "nothing (the session is not live)",
        "escalation": ESCALATION,
        "grace_s": record.spec.get("grace"),
        "status": view if view is not None else rt.session_status(session),
    }


def close(
    rt: Runtime, grant: Grant, task: str, final: str | None, deadline: float | None
) -> tuple[bool, dict[str, Any]]:
    visible_task(rt, grant, task)
    result = rt.close_task(task, final, deadline)
    return result.complete, result.to_json()


def recover(rt: Runtime, grant: Grant, task: str | None) -> dict[str, Any]:
    if task is not None:
        visible_task(rt, grant, task)
        return {"sessions": rt.recover(task)}
    if grant.tasks is None:
        return {"sessions": rt.recover()}
    results: list[dict[str, Any]] = []
    for mine in sorted(grant.tasks):
        try:
            rt.task_record(mine)
        except UnknownTask:
            continue
        results += rt.recover(mine)
    return {"sessions": results}


# -- output ---------------------------------------------------------------------------------


def stream_facts(
    rt: Runtime, grant: Grant, session: str, stream: str
) -> tuple[StreamLog, int | None, int]:
    """(the stream's log, final cursor or None while it may grow, bytes stored now).

    The final cursor is asked before the size: it is published only once its bytes are in the
    file, so the size read after it is never short of it.
    """
    visible_session(rt, grant, session)
    final = rt.final_cursor(session, stream)
    log = rt.stream_log(session, stream)
    return log, final, log.stored_length()


def merged(rt: Runtime, grant: Grant, session: str, start: int, size: int) -> dict[str, Any]:
    """Both streams in the owner's stored order from merged cursor ``start``: each chunk names
    its stream, stream cursor, merged cursor and whether the index ordered it; ``cursor`` is
    the merged cursor to resume from, ``final`` whether both streams are settled."""
    visible_session(rt, grant, session)
    chunks = rt.read_merged(session, start, size)
    final = all(rt.final_cursor(session, n) is not None for n in ("stdout", "stderr"))
    end = chunks[-1].at + len(chunks[-1].data) if chunks else start
    return {
        "from": start,
        "cursor": end,
        "final": final,
        "order": "the owner's read order across the two pipes",
        "chunks": [
            {
                "stream": c.stream,
                "stream_cursor": c.cursor,
                "at": c.at,
                "ordered": c.ordered,
                "data": base64.b64encode(c.data).decode("ascii"),
            }
            for c in chunks
        ],
    }


def end_of_stream(rt: Runtime, session: str) -> dict[str, Any]:
    """What the SSE `end` event carries: the process receipt, or (a session that stayed
    unknown, so it has none) its status view, whose `why` says what recovery still needs."""
    view = rt.session_status(session)
    receipt = view.get("receipt")
    return receipt if isinstance(receipt, dict) else view


# -- the live view (settled.server.feed) ----------------------------------------------------


def clocks(rt: Runtime, grant: Grant, task: str) -> dict[str, Any]:
    """The task's four clocks per session, its state and its close receipt, if recorded."""
    visible_task(rt, grant, task)
    return rt.clocks(task)


def board(
    rt: Runtime,
    limit: int,
    extra: frozenset[str],
    final: frozenset[str],
    known: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(the newest ``limit`` tasks and then those of ``extra`` that exist, the clocks of each
    of them not in ``final`` that differ from its view in ``known``, if given). A complete
    task never changes again, so the feed passes the ones it holds as ``final`` and they are
    not read again. Every token's view is cut from this one board (settled.server.feed), so it is
    computed without a grant."""
    order = rt.task_ids(limit)
    for task in sorted(extra - set(order)):
        try:
            rt.task_record(task)
        except (UnknownTask, BadInput):  # a tokens file may name a task that is not (yet)
            continue
        order.append(task)
    fresh = {}
    for task in order:
        if task not in final:
            try:
                view = rt.clocks(task)
            except UnknownTask:  # discarded since it was listed
                continue
            view.pop("close_receipt", None)  # the page asks for it when it shows it
            fresh[task] = view
    shown = [t for t in order if t in fresh or t in final]
    known = known or {}
    return shown, {t: v for t, v in fresh.items() if known.get(t) != v}


def exit_handles(rt: Runtime, sessions: list[str]) -> dict[str, int | None]:
    """For each live session whose owner has claimed it, a handle that wakes when that owner
    exits (None: none to watch here, e.g. another host's); the feed refreshes at once instead
    of at its next poll. A session not claimed yet is left out, to be asked again."""
    handles: dict[str, int | None] = {}
    for session in sessions:
        try:
            if rt.session_record(session).owner is not None:
                handles[session] = rt.exit_handle(session)
        except UnknownSession:
            handles[session] = None
    return handles


def close_handles(rt: Runtime, handles: list[int]) -> None:
    for handle in handles:
        rt.close_exit_handle(handle)
