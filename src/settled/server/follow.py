"""One watcher for every follower of a running session's output (`output?follow=1`, `events`).

Owns: the sessions that open responses follow, each watched once however many follow it: the
stored length of each followed stream (one ``stat`` per stream per tick, all in one worker job),
the final cursors (asked of the Runtime for all due sessions in one worker job: at once when
the session's owner on this host exits, its exit handle registered with the event loop, and
otherwise every ``FINAL_EVERY_S``), and a generation per session that wakes its followers when
either changed. The tick is ``FAST_S`` while some stream grew lately, ``IDLE_S`` otherwise.
The server's stop (``stop``) wakes every follower for the last time.

Why: a follower that polled for itself cost two worker jobs (a read and a store query) every
0.1 s, so 500 idle followers kept the worker pool, the store and the GIL busy and the service
stopped answering; now an idle follower costs nothing and the watching costs a few jobs a
second whatever the number of followers.

Must never: hold a worker thread, a store connection or a descriptor for a follower while it
waits (exit handles are the watcher's, closed on a worker when their session is no longer
followed), read or serve a log's bytes (followers read their own, from their cursor), decide a
final cursor (the Runtime's), or let a failed look end a follower: the store down a moment is
logged and looked at again on the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from settled.errors import SettledError, UnknownSession
from settled.runtime import Runtime
from settled.server import views
from settled.server.pool import RuntimePool

TYPE_CHECKING = False
if TYPE_CHECKING:
    from settled.runtime import StreamLog

FAST_S = 0.02
IDLE_S = 0.1
FAST_FOR_S = 1.0  # a stream grew within this: tick fast
FINAL_EVERY_S = 1.0  # an owner elsewhere (or none yet): its final cursors looked at this often
log = logging.getLogger("settled.server")


class Watched:
    """A followed session: its streams' stored lengths and final cursors as last seen."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.logs: dict[str, StreamLog] = {}
        self.stored: dict[str, int] = {}
        self.finals: dict[str, int | None] = {}
        self.followers = 0
        self.generation = 0
        self.final_due = True  # look at the final cursors on the next tick
        self.final_at = 0.0
        self.handle: int | None = None
        self.handle_asked = False
        self._changed = asyncio.Event()

    def final(self, stream: str) -> int | None:
        return self.finals.get(stream)

    def bump(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, generation: int, seconds: float, stopping: asyncio.Event) -> str:
        """Until this session changes after ``generation`` ("changed"), the server stops
        ("stop"), or ``seconds`` pass ("quiet")."""
        if stopping.is_set():
            return "stop"
        if self.generation != generation:
            return "changed"
        changed = asyncio.ensure_future(self._changed.wait())
        stop = asyncio.ensure_future(stopping.wait())
        try:
            done, _ = await asyncio.wait({changed, stop}, timeout=seconds,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            changed.cancel()
            stop.cancel()
        if stop in done:
            return "stop"
        return "changed" if changed in done else "quiet"


class FollowHub:
    """Every followed session of one server, and the loop that watches them."""

    def __init__(self, pool: RuntimePool) -> None:
        self.pool = pool
        self.stopping = asyncio.Event()
        self.never = asyncio.Event()  # what a raw follow waits on instead: uvicorn ends it
        self._watched: dict[str, Watched] = {}
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._grew_at = 0.0
        self._closing: list[int] = []

    @contextlib.contextmanager
    def follow(self, session: str, stream: str, stream_log: StreamLog) -> Iterator[Watched]:
        """Watch ``session``'s ``stream`` while the caller follows it."""
        watched = self._watched.get(session)
        if watched is None:
            watched = self._watched[session] = Watched(session)
        watched.logs[stream] = stream_log
        watched.followers += 1
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()
        try:
            yield watched
        finally:
            watched.followers -= 1
            if not watched.followers:
                self._forget(watched)

    def stop(self) -> None:
        """The server stops: every follower ends now (with its last word)."""
        self.stopping.set()

    def _forget(self, watched: Watched) -> None:
        self._watched.pop(watched.session, None)
        if watched.handle is not None:
            asyncio.get_running_loop().remove_reader(watched.handle)
            self._closing.append(watched.handle)
            watched.handle = None
        self._wake.set()

    async def _run(self) -> None:
        try:
            while self._watched or self._closing:
                self._wake.clear()
                await self._tick()
                fast = time.monotonic() - self._grew_at < FAST_FOR_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), FAST_S if fast else IDLE_S)
        finally:
            self._runner = None

    async def _tick(self) -> None:
        try:
            await self._close_handles()
            await self._look_at_lengths()
            await self._look_at_finals()
            await self._ask_handles()
        except SettledError as exc:  # the store down a moment: every follower keeps waiting
            log.warning("following sessions: %s; looking again", exc)
        except RuntimeError:  # the pool is closing: so is the server
            raise
        except Exception:  # never the end of the loop: every follower waits on it
            log.exception("following sessions failed; the next look runs as usual")

    async def _look_at_lengths(self) -> None:
        watched = list(self._watched.values())
        logs = [(w, stream, stream_log) for w in watched for stream, stream_log in w.logs.items()]
        lengths = await self.pool.io(_lengths, [stream_log for _, _, stream_log in logs])
        for (w, stream, _), length in zip(logs, lengths, strict=True):
            if w.stored.get(stream) != length:
                w.stored[stream] = length
                self._grew_at = time.monotonic()
                w.bump()

    async def _look_at_finals(self) -> None:
        now = time.monotonic()
        due = [
            w for w in self._watched.values() if w.final_due or now - w.final_at >= FINAL_EVERY_S
        ]
        if not due:
            return
        asked = {w.session: sorted(w.logs) for w in due}
        finals = await self.pool.call(_finals, asked)
        for w in due:
            w.final_due, w.final_at = False, now
            for stream, final in finals.get(w.session, {}).items():
                if final is not None and w.finals.get(stream) != final:
                    w.finals[stream] = final
                    w.bump()

    async def _ask_handles(self) -> None:
        """Each live session's owner exit, registered with the loop (asked once a session
        has an owner; one on another host has none and is looked at every FINAL_EVERY_S)."""
        new = [w.session for w in self._watched.values() if not w.handle_asked and not w.finals]
        if not new:
            return
        handles = await self.pool.call(views.exit_handles, new)
        loop = asyncio.get_running_loop()
        for session, handle in handles.items():
            w = self._watched.get(session)
            if w is None or w.handle_asked:
                if handle is not None:
                    self._closing.append(handle)
                continue
            w.handle_asked, w.handle = True, handle
            if handle is not None:
                loop.add_reader(handle, self._exited, w)

    def _exited(self, watched: Watched) -> None:
        if watched.handle is not None:
            asyncio.get_running_loop().remove_reader(watched.handle)
            self._closing.append(watched.handle)
            watched.handle = None
        watched.final_due = True
        self._wake.set()

    async def _close_handles(self) -> None:
        closing, self._closing = self._closing, []
        if closing:
            await self.pool.call(views.close_handles, closing)

    async def close(self) -> None:
        """At shutdown: stop watching; the exit handles are closed on a worker."""
        self.stop()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        for watched in list(self._watched.values()):
            self._forget(watched)
        with contextlib.suppress(RuntimeError):
            await self._close_handles()


def _lengths(logs: list[StreamLog]) -> list[int]:
    return [stream_log.stored_length() for stream_log in logs]


def _finals(rt: Runtime, asked: dict[str, list[str]]) -> dict[str, dict[str, int | None]]:
    """Each session's final cursor of each stream asked (None while it may grow)."""
    finals: dict[str, dict[str, int | None]] = {}
    for session, streams in asked.items():
        try:
            finals[session] = {stream: rt.final_cursor(session, stream) for stream in streams}
        except UnknownSession:  # discarded while followed: nothing more will come
            finals[session] = {}
    return finals
