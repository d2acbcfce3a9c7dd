"""The live view of the tasks (`GET /v1/events`, what `/ui` listens to): one watcher of the store
for the whole server, and for each token a resumable Server-Sent Events stream of the tasks it
may see, each with its sessions' four clocks (settled.clocks through ``Runtime.clocks``).

Owns: the board (the newest ``BOARD_LIMIT`` tasks, plus every task a subscribed scoped token
names), refreshed while anyone listens: woken by the store's change notifications where it has
them (PostgreSQL LISTEN, on a thread of its own), by this server's own writes (``nudge``), by
the exit of a live session's owner on this host (it writes its receipt, then exits: a handle
from ``Runtime.exit_handle`` registered with the event loop), and otherwise by bounded polling
(``FAST_S`` while a task has a live session or is closing, ``IDLE_S`` when nothing moves).
A change is a task whose view differs from the last one sent. Each grant has its own change
log, so an event id (``<server instance>-<n>``) counts only the changes that token may see, and
``Last-Event-ID`` resumes with every task changed since; an id from another server instance,
or older than the log keeps, gets a full snapshot instead.

Must never: show a token a task outside its grant (not even as a gap in its event ids), hold a
worker thread while it waits (the watcher has its own thread and Runtime; the board is computed
in one short pool call), keep polling when nobody listens, or decide a clock itself (the views
are the Runtime's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from settled.errors import BadInput, SettledError
from settled.runtime import Runtime
from settled.server import views
from settled.server.auth import Grant
from settled.server.pool import RuntimePool
from settled.states import is_live

BOARD_LIMIT = 50
EXITS_WATCHED = 256  # live sessions whose owner's exit wakes the view; past that, it polls
RING = 4096  # changes each grant's log keeps for a resume; older ids get a snapshot
FAST_S = 0.25
IDLE_S = 1.0
MIN_GAP_S = 0.05  # notifications (a heartbeat each) never refresh faster than this
REFRESH_SHARE = 0.2  # and refreshes never take more than this share of the time (the GIL's)
NOTIFY_WAIT_S = 1.0
KEEPALIVE_S = float(os.environ.get("SETTLED_SSE_KEEPALIVE_S") or 15.0)  # tests shorten it
EVENT_ID = re.compile(r"([0-9a-f]{8})-([0-9]{1,19})")
log = logging.getLogger("settled.server")


class GrantLog:
    """The changes one grant may see, numbered for it alone."""

    def __init__(self, grant: Grant) -> None:
        self.grant, self.seq = grant, 0
        self.ring: deque[tuple[int, str]] = deque(maxlen=RING)

    def record(self, task: str) -> None:
        if self.grant.sees(task):
            self.seq += 1
            self.ring.append((self.seq, task))

    def since(self, seq: int) -> list[str] | None:
        """The tasks changed after ``seq`` (oldest change first), or None if the log no longer
        reaches back that far (or never issued it)."""
        if seq > self.seq or (seq < self.seq and (not self.ring or self.ring[0][0] > seq + 1)):
            return None
        return list(dict.fromkeys(task for n, task in self.ring if n > seq))


def parse_event_id(text: str | None) -> tuple[str, int] | None:
    """``Last-Event-ID`` as (server instance, change number); BadInput if malformed."""
    if not text:  # absent, or empty as an EventSource with no id yet would send it
        return None
    match = EVENT_ID.fullmatch(text)
    if match is None:
        raise BadInput(
            f"Last-Event-ID {text[:64]!r} is not an id of /v1/events (<instance>-<number>); "
            "leave it out to get a snapshot"
        )
    return match.group(1), int(match.group(2))


def frame(event: str, data: dict[str, Any], event_id: str | None = None) -> bytes:
    lines = [f"event: {event}"] + ([f"id: {event_id}"] if event_id else [])
    lines.append("data: " + json.dumps(data, sort_keys=True, separators=(",", ":")))
    return ("\n".join(lines) + "\n\n").encode("ascii")


def busy(view: dict[str, Any]) -> bool:
    """Whether the task may change any moment: a session still live, or a close under way."""
    if view.get("final"):
        return False
    return view.get("state") != "open" or any(is_live(s["state"]) for s in view["sessions"])


class ChangeFeed:
    """One per server: the board, the grants' change logs, and the refresh loop."""

    def __init__(self, pool: RuntimePool, notifies: bool, stopping: asyncio.Event) -> None:
        self.pool, self.notifies, self.stopping = pool, notifies, stopping
        self.instance = secrets.token_hex(4)
        self.order: list[str] = []
        self.views: dict[str, dict[str, Any]] = {}
        self._logs: dict[Grant, GrantLog] = {}
        self._listeners: dict[Grant, int] = {}
        self._runner: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._refreshed = (0, 0)  # (refreshes started, refreshes done)
        self._watcher: _Watcher | None = None
        self._exits: dict[str, int | None] = {}  # live session -> its owner's exit handle
        self._closing: list[int] = []  # exit handles to close (on a worker, by the Runtime)

    # -- the loop ---------------------------------------------------------------------------

    def nudge(self) -> None:
        """Refresh now: this server just changed something (or the store said it changed)."""
        self._wake.set()

    async def _run(self) -> None:
        try:
            while self._listeners:
                self._wake.clear()
                started = time.monotonic()
                await self._refresh()
                await self._watch_exits()
                pause = FAST_S if any(busy(v) for v in self.views.values()) else IDLE_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), pause)
                await asyncio.sleep(self._gap(started, time.monotonic()))
        finally:
            self._runner = None
            self._stop_watcher()
            with contextlib.suppress(RuntimeError):  # the pool may be closing: so is the process
                await self._forget_exits(list(self._exits))

    @staticmethod
    def _gap(started: float, now: float) -> float:
        """The pause before the next refresh: at least MIN_GAP_S from the last one's start,
        and long enough that refreshing takes at most REFRESH_SHARE of the time. A board of
        tasks with thousands of sessions costs a worker (and the GIL the event loop needs)
        a good fraction of a second; nudged by every admission, it would never rest."""
        spent = max(0.0, now - started)
        return max(MIN_GAP_S - spent, spent * (1.0 / REFRESH_SHARE - 1.0))

    async def _refresh(self) -> None:
        started, done = self._refreshed
        self._refreshed = (started + 1, done)
        extra = frozenset().union(*(g.tasks for g in self._listeners if g.tasks is not None))
        final = frozenset(t for t, v in self.views.items() if v.get("final"))
        try:
            known = dict(self.views)  # compared on the worker: a big board costs the loop nothing
            order, fresh = await self.pool.call(views.board, BOARD_LIMIT, extra, final, known)
        except SettledError as exc:  # the store is down a moment: keep the streams, try again
            log.warning("the live view could not read the store: %s", exc)
        except Exception:  # never the end of the loop: every listener waits on it
            log.exception("the live view's refresh failed; the next one runs as usual")
        else:
            self._apply(order, fresh)
        self._refreshed = (self._refreshed[0], self._refreshed[1] + 1)
        self._changed.set()
        self._changed = asyncio.Event()

    def _apply(self, order: list[str], fresh: dict[str, dict[str, Any]]) -> None:
        self.order = order
        shown = set(order)  # a task past the newest ones is forgotten (read again if it returns)
        self.views = {task: view for task, view in self.views.items() if task in shown}
        for task, view in fresh.items():  # only the views that changed (views.board)
            self.views[task] = view
            for grant_log in self._logs.values():
                grant_log.record(task)

    async def _watch_exits(self) -> None:
        """Register each live session's owner exit with the event loop (the owner writes its
        receipt, then exits: the view refreshes at once); forget the sessions no longer live."""
        live = [
            row["session"]
            for view in self.views.values()
            for row in view["sessions"]
            if is_live(row["state"])
        ]
        await self._forget_exits([s for s in self._exits if s not in set(live)])
        room = EXITS_WATCHED - len(self._exits)
        new = [s for s in live if s not in self._exits][: max(0, room)]
        if not new:
            return
        loop = asyncio.get_running_loop()
        for session, handle in (await self.pool.call(views.exit_handles, new)).items():
            self._exits[session] = handle
            if handle is not None:
                loop.add_reader(handle, self._exited, session)

    def _exited(self, session: str) -> None:
        handle = self._exits.get(session)
        if handle is not None:
            asyncio.get_running_loop().remove_reader(handle)
            self._exits[session] = None  # closed when the session leaves the live ones
            self._closing.append(handle)
        self.nudge()

    async def _forget_exits(self, sessions: list[str]) -> None:
        loop = asyncio.get_running_loop()
        for session in sessions:
            handle = self._exits.pop(session, None)
            if handle is not None:
                loop.remove_reader(handle)
                self._closing.append(handle)
        closing, self._closing = self._closing, []
        if closing:
            await self.pool.call(views.close_handles, closing)

    async def _fresh(self) -> None:
        """Wait for a refresh that began after this call (so it covers a new listener)."""
        wanted = self._refreshed[0] + 1
        self.nudge()
        while self._refreshed[1] < wanted:
            await self._changed.wait()

    # -- listeners --------------------------------------------------------------------------

    def _subscribe(self, grant: Grant) -> GrantLog:
        self._listeners[grant] = self._listeners.get(grant, 0) + 1
        grant_log = self._logs.setdefault(grant, GrantLog(grant))
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())
            self._start_watcher()
        return grant_log

    def _unsubscribe(self, grant: Grant) -> None:
        self._listeners[grant] -= 1
        if not self._listeners[grant]:
            del self._listeners[grant]
        self.nudge()  # the loop sees nobody listens and stops

    def visible(self, grant: Grant, tasks: list[str]) -> list[dict[str, Any]]:
        return [self.views[t] for t in tasks if grant.sees(t) and t in self.views]

    def snapshot(self, grant: Grant, why: str) -> dict[str, Any]:
        shown = [t for t in self.order if grant.sees(t)]
        woken = "store notifications and polling" if self.notifies else "polling the store"
        return {
            "tasks": self.visible(grant, shown),
            "order": shown,
            "reset": why,
            "woken_by": woken,
            "poll_s": {"busy": FAST_S, "idle": IDLE_S},
        }

    async def events(
        self, grant: Grant, resume: tuple[str, int] | None, follow: bool
    ) -> AsyncIterator[bytes]:
        """The stream: a snapshot (or the changes since ``resume``), then, with ``follow``,
        every change as it is seen, with a comment every ``KEEPALIVE_S`` of quiet (so no proxy
        cuts it), and at the server's stop an ``event: stop`` as its last."""
        grant_log = self._subscribe(grant)
        try:
            await self._fresh()
            seq = grant_log.seq
            event_id = f"{self.instance}-{seq}"
            yield self._catch_up(grant, grant_log, resume)
            sent = time.monotonic()
            while follow:
                if self.stopping.is_set():
                    yield frame("stop", {"reason": "the server is stopping"}, event_id)
                    return
                if grant_log.seq == seq:  # refreshes that change nothing it sees are quiet
                    quiet = time.monotonic() - sent
                    if quiet >= KEEPALIVE_S:
                        sent = time.monotonic()
                        yield b": keep-alive\n\n"
                    else:
                        await self._changed_or_stop(KEEPALIVE_S - quiet)
                    continue
                sent = time.monotonic()
                tasks = grant_log.since(seq)
                seq = grant_log.seq
                event_id = f"{self.instance}-{seq}"
                if tasks is None:  # this reader fell behind the log: start it over
                    yield frame("snapshot", self.snapshot(grant, "behind"), event_id)
                else:
                    yield frame("tasks", {"tasks": self.visible(grant, tasks)}, event_id)
        finally:
            self._unsubscribe(grant)

    async def _changed_or_stop(self, seconds: float) -> None:
        """Wait for the next refresh, the server's stop, or ``seconds``."""
        changed = asyncio.ensure_future(self._changed.wait())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait(
                {changed, stop}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            changed.cancel()
            stop.cancel()

    def _catch_up(self, grant: Grant, grant_log: GrantLog, resume: tuple[str, int] | None) -> bytes:
        event_id = f"{self.instance}-{grant_log.seq}"
        if resume is None:
            return frame("snapshot", self.snapshot(grant, "first"), event_id)
        instance, seq = resume
        tasks = grant_log.since(seq) if instance == self.instance else None
        if tasks is None:
            why = "restarted" if instance != self.instance else "behind"
            return frame("snapshot", self.snapshot(grant, why), event_id)
        return frame("tasks", {"tasks": self.visible(grant, tasks)}, event_id)

    # -- the store's notifications ----------------------------------------------------------

    def _start_watcher(self) -> None:
        if self.notifies and self._watcher is None:
            self._watcher = _Watcher(self.pool, asyncio.get_running_loop(), self.nudge)
            self._watcher.start()

    def _stop_watcher(self) -> _Watcher | None:
        """Ask the watcher to stop (it does within ``NOTIFY_WAIT_S``); never waits for it on
        the event loop."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        return watcher

    async def stop(self) -> None:
        """At shutdown: end the loop, then wait (off the loop, bounded) for the watcher."""
        watcher = self._watcher
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        self._stop_watcher()
        if watcher is not None:
            await asyncio.to_thread(watcher.join)


class _Watcher:
    """A thread with a Runtime of its own that sleeps in ``Runtime.await_change`` and nudges
    the feed on every change the store notifies."""

    def __init__(self, pool: RuntimePool, loop: asyncio.AbstractEventLoop, nudge: Any) -> None:
        self.pool, self.loop, self.nudge = pool, loop, nudge
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="settled-feed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        try:
            with Runtime(self.pool.home, shared_launcher=self.pool.launcher) as runtime:
                while not self._stop.is_set():
                    runtime.await_change(("*",), NOTIFY_WAIT_S)
                    if not self._stop.is_set():
                        self.loop.call_soon_threadsafe(self.nudge)
        except Exception:  # the polling goes on without it
            log.exception("the store's notifications stopped; the live view polls")

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        self._thread.join(timeout=NOTIFY_WAIT_S + 5.0)
