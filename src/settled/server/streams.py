"""Output over HTTP: raw bytes from a cursor (a range, or followed to the final cursor) and
Server-Sent Events whose ids are cursors.

Owns: reading a stream's log (the Runtime's ``StreamLog``) by cursor on worker threads,
following it while the session runs (between reads a follower waits on the server's one
watcher, server/follow.py, for its session's next change: it polls nothing itself), the
response headers (``Settled-From``, ``Settled-Cursor``, ``Settled-Final-Cursor``) and the SSE
framing (``id: <cursor after the chunk>``, ``data: <base64 of up to 64 KiB>``, a comment every
``KEEPALIVE_S`` of quiet so no proxy cuts an idle stream, and a last event saying why the
stream ends: ``end`` carrying the process receipt, ``error`` for lost bytes, or ``stop`` when
the server stops, whose id resumes). An SSE stream ends with nothing else: a store down a
moment while the receipt is asked is asked again.

Must never: write to a log, signal or cancel a session (a reader that is slow or goes away only
ends its own response; the owner writes the log and readers only read files), hold a file
descriptor or a worker thread between chunks, send a byte past the final cursor, or end a
response cleanly when bytes are missing (a lost range aborts a raw response and is an
``event: error`` in SSE, never a silent gap).

HTTP/1.1 responses from uvicorn carry no trailers, so a followed raw response whose final
cursor was not known when it started has no ``Settled-Cursor`` header: the client's next cursor
is ``Settled-From`` plus the bytes received, and a response that ends cleanly ended exactly at
the final cursor.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from settled import faults
from settled.errors import CursorOutOfRange, SettledError
from settled.server import views
from settled.server.follow import FollowHub
from settled.server.pool import RuntimePool

if TYPE_CHECKING:
    from settled.runtime import StreamLog

RAW_CHUNK = 1 << 20
SSE_EVENT_BYTES = 64 << 10
ENDING_RETRY_S = 1.0
KEEPALIVE_S = float(os.environ.get("SETTLED_SSE_KEEPALIVE_S") or 15.0)  # tests shorten it
OCTETS = "application/octet-stream"


class ServerStopping(Exception):
    """The server stops while a follower waits: its stream ends with an ``event: stop``."""

    def __init__(self, cursor: int) -> None:
        super().__init__(f"the server stopped at cursor {cursor}")
        self.cursor = cursor


class LostBytes(RuntimeError):
    """The log holds fewer bytes than its final cursor: a range was lost (or deleted)."""

    def __init__(self, stream: str, cursor: int, final: int, stored: int) -> None:
        super().__init__(
            f"{stream} has final cursor {final} but only {stored} bytes are stored; bytes "
            f"[{stored}, {final}) are lost, so the stream cannot continue past cursor {cursor}"
        )
        self.cursor, self.final, self.stored = cursor, final, stored


@dataclass(frozen=True)
class StreamFacts:
    session: str
    stream: str
    log: StreamLog
    final: int | None
    stored: int

    @property
    def end(self) -> int:
        """What exists now: the final cursor once known, else the bytes stored."""
        return self.stored if self.final is None else self.final

    def check(self, start: int) -> None:
        if start > self.end:
            raise CursorOutOfRange(start, self.end, self.stream)


async def tail(
    pool: RuntimePool,
    hub: FollowHub,
    facts: StreamFacts,
    start: int,
    end: int | None,
    chunk: int,
    stopping: asyncio.Event | None = None,
) -> AsyncIterator[bytes | None]:
    """The stream's bytes from ``start`` to ``end`` (``None``: follow to the final cursor,
    waiting on the hub between reads, never polling).

    Yields ``None`` after ``KEEPALIVE_S`` without bytes, so a caller can keep its connection
    alive; raises LostBytes if the file ends short of a final cursor, and ServerStopping once
    ``stopping`` is set while it waits.
    """
    if end is not None:
        async for data in _read_to(pool, facts, start, end, chunk):
            yield data
        return
    with hub.follow(facts.session, facts.stream, facts.log) as watched:
        cursor, sent = start, time.monotonic()
        while True:
            seen = watched.generation
            data, _ = await pool.io(facts.log.read_at, cursor, chunk, None)
            if data:
                cursor, sent = cursor + len(data), time.monotonic()
                yield data
                faults.point("server.mid_stream")
                continue
            final = watched.final(facts.stream)
            if final is not None:
                if cursor > final:
                    raise CursorOutOfRange(cursor, final, facts.stream)
                break  # every byte up to the final cursor is in the file now: read them
            if time.monotonic() - sent >= KEEPALIVE_S:  # quiet since the last byte sent
                sent = time.monotonic()
                yield None
            left = KEEPALIVE_S - (time.monotonic() - sent)
            if await watched.wait(seen, left, stopping or hub.never) == "stop":
                raise ServerStopping(cursor)
    async for data in _read_to(pool, facts, cursor, final, chunk):
        yield data


async def _read_to(
    pool: RuntimePool, facts: StreamFacts, cursor: int, end: int, chunk: int
) -> AsyncIterator[bytes]:
    """The bytes from ``cursor`` to ``end``, all of which exist (LostBytes if they do not)."""
    while cursor < end:
        data, stored = await pool.io(facts.log.read_at, cursor, chunk, end)
        if not data:
            raise LostBytes(facts.stream, cursor, end, stored)
        cursor += len(data)
        yield data
        faults.point("server.mid_stream")


async def _bytes_only(chunks: AsyncIterator[bytes | None]) -> AsyncIterator[bytes]:
    async for data in chunks:
        if data:
            yield data


def raw_response(
    pool: RuntimePool,
    hub: FollowHub,
    facts: StreamFacts,
    start: int,
    follow: bool,
    max_bytes: int | None,
) -> Response:
    """Raw bytes from ``start``: a range up to what exists now (or ``max_bytes``), or, with
    ``follow``, an open response that ends exactly at the final cursor."""
    facts.check(start)
    headers = {"Settled-From": str(start), "Cache-Control": "no-store"}
    if facts.final is not None:
        headers["Settled-Final-Cursor"] = str(facts.final)
    if follow and facts.final is None:
        headers["Settled-Follow"] = "1"
        body = _bytes_only(tail(pool, hub, facts, start, None, RAW_CHUNK))
        return StreamingResponse(body, media_type=OCTETS, headers=headers)
    end = facts.end if max_bytes is None else min(facts.end, start + max_bytes)
    headers["Settled-Cursor"] = str(end)
    headers["Content-Length"] = str(end - start)
    if end == start:
        return Response(b"", media_type=OCTETS, headers=headers)
    body = _bytes_only(tail(pool, hub, facts, start, end, RAW_CHUNK))
    return StreamingResponse(body, media_type=OCTETS, headers=headers)


# -- Server-Sent Events ---------------------------------------------------------------------


def sse_frame(data: str, event_id: int | None = None, event: str | None = None) -> bytes:
    lines = []
    if event is not None:
        lines.append(f"event: {event}")
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append(f"data: {data}")
    return ("\n".join(lines) + "\n\n").encode("ascii")


def encode_events(data: bytes, cursor: int) -> tuple[bytes, int]:
    """SSE events for ``data`` read at ``cursor``: base64 of each 64 KiB piece, each with the
    cursor after it as its id. Returns the events and the cursor after the last one."""
    frames = []
    view = memoryview(data)
    for offset in range(0, len(data), SSE_EVENT_BYTES):
        piece = view[offset : offset + SSE_EVENT_BYTES]
        cursor += len(piece)
        frames.append(b"id: %d\ndata: %s\n\n" % (cursor, base64.b64encode(piece)))
    return b"".join(frames), cursor


async def sse_body(
    pool: RuntimePool, hub: FollowHub, facts: StreamFacts, start: int
) -> AsyncIterator[bytes]:
    """The events from ``start``; the last one says why the stream ends: ``end`` (the
    receipt), ``error`` (bytes lost) or ``stop`` (the server stops; resume from its id)."""
    cursor = start
    try:
        chunks = tail(pool, hub, facts, start, facts.final, RAW_CHUNK, hub.stopping)
        async for data in chunks:
            if data is None:
                yield b": keep-alive\n\n"
                continue
            frames, cursor = await pool.io(encode_events, data, cursor)  # base64 off the loop
            yield frames
    except (LostBytes, CursorOutOfRange) as exc:
        problem: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
        yield sse_frame(json.dumps(problem), cursor, "error")
        return
    except ServerStopping:
        yield stop_frame(cursor)
        return
    ending = await _ending(pool, hub, facts.session)
    yield (
        stop_frame(cursor)
        if ending is None
        else sse_frame(json.dumps(ending, sort_keys=True), cursor, "end")
    )


def stop_frame(cursor: int) -> bytes:
    stop = {"reason": "the server is stopping", "cursor": cursor,
            "resume": "reconnect with Last-Event-ID"}  # fmt: skip
    return sse_frame(json.dumps(stop, sort_keys=True), cursor, "stop")


async def _ending(pool: RuntimePool, hub: FollowHub, session: str) -> dict[str, Any] | None:
    """The `end` event's receipt; asked again while the store is down a moment (the stream
    stays open); None if the server stops first."""
    while True:
        try:
            return await pool.call(views.end_of_stream, session)
        except SettledError:
            if hub.stopping.is_set():
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hub.stopping.wait(), ENDING_RETRY_S)


def events_response(pool: RuntimePool, hub: FollowHub, facts: StreamFacts, start: int) -> Response:
    facts.check(start)
    headers = {
        "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",
        "Settled-From": str(start),
    }
    return StreamingResponse(
        sse_body(pool, hub, facts, start), media_type="text/event-stream", headers=headers
    )
