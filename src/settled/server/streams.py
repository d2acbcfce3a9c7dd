"""Output over HTTP: raw bytes from a cursor (a range, or followed to the final cursor) and
Server-Sent Events whose ids are cursors.

Owns: reading a stream's log (the Runtime's ``StreamLog``) by cursor on worker threads,
following it while the session runs (polling the file from the event loop, asking the Runtime
for the final cursor only once the bytes on disk are caught up), the response headers
(``Settled-From``, ``Settled-Cursor``, ``Settled-Final-Cursor``) and the SSE framing (``id:
<cursor after the chunk>``, ``data: <base64 of up to 64 KiB>``, a final ``event: end`` carrying
the process receipt).

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
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from settled import faults
from settled.errors import CursorOutOfRange
from settled.runtime import Runtime
from settled.server import views
from settled.server.pool import RuntimePool

if TYPE_CHECKING:
    from settled.runtime import StreamLog

RAW_CHUNK = 1 << 20
SSE_EVENT_BYTES = 64 << 10
POLL_MIN_S = 0.005
POLL_MAX_S = 0.1
KEEPALIVE_S = 15.0
OCTETS = "application/octet-stream"


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
    pool: RuntimePool, facts: StreamFacts, start: int, end: int | None, chunk: int
) -> AsyncIterator[bytes | None]:
    """The stream's bytes from ``start`` to ``end`` (``None``: follow to the final cursor).

    Yields ``None`` after ``KEEPALIVE_S`` without bytes, so a caller can keep its connection
    alive; raises LostBytes if the file ends short of a final cursor.
    """
    cursor, pause, quiet_since = start, POLL_MIN_S, time.monotonic()
    while True:
        data, stored = await pool.io(facts.log.read_at, cursor, chunk, end)
        if data:
            cursor += len(data)
            pause, quiet_since = POLL_MIN_S, time.monotonic()
            yield data
            faults.point("server.mid_stream")
            continue
        if end is not None:
            if cursor >= end:
                return
            raise LostBytes(facts.stream, cursor, end, stored)
        end = await pool.call(Runtime.final_cursor, facts.session, facts.stream)
        if end is not None:
            if cursor > end:
                raise CursorOutOfRange(cursor, end, facts.stream)
            continue  # every byte up to the final cursor is in the file now: read them
        if time.monotonic() - quiet_since >= KEEPALIVE_S:
            quiet_since = time.monotonic()
            yield None
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, POLL_MAX_S)


async def _bytes_only(chunks: AsyncIterator[bytes | None]) -> AsyncIterator[bytes]:
    async for data in chunks:
        if data:
            yield data


def raw_response(
    pool: RuntimePool, facts: StreamFacts, start: int, follow: bool, max_bytes: int | None
) -> Response:
    """Raw bytes from ``start``: a range up to what exists now (or ``max_bytes``), or, with
    ``follow``, an open response that ends exactly at the final cursor."""
    facts.check(start)
    headers = {"Settled-From": str(start), "Cache-Control": "no-store"}
    if facts.final is not None:
        headers["Settled-Final-Cursor"] = str(facts.final)
    if follow and facts.final is None:
        headers["Settled-Follow"] = "1"
        body = _bytes_only(tail(pool, facts, start, None, RAW_CHUNK))
        return StreamingResponse(body, media_type=OCTETS, headers=headers)
    end = facts.end if max_bytes is None else min(facts.end, start + max_bytes)
    headers["Settled-Cursor"] = str(end)
    headers["Content-Length"] = str(end - start)
    if end == start:
        return Response(b"", media_type=OCTETS, headers=headers)
    body = _bytes_only(tail(pool, facts, start, end, RAW_CHUNK))
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


async def sse_body(pool: RuntimePool, facts: StreamFacts, start: int) -> AsyncIterator[bytes]:
    cursor = start
    try:
        async for data in tail(pool, facts, start, facts.final, RAW_CHUNK):
            if data is None:
                yield b": keep-alive\n\n"
                continue
            frames, cursor = await pool.io(encode_events, data, cursor)  # base64 off the loop
            yield frames
    except (LostBytes, CursorOutOfRange) as exc:
        problem: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
        yield sse_frame(json.dumps(problem), cursor, "error")
        return
    ending = await pool.call(views.end_of_stream, facts.session)
    yield sse_frame(json.dumps(ending, sort_keys=True), cursor, "end")


def events_response(pool: RuntimePool, facts: StreamFacts, start: int) -> Response:
    facts.check(start)
    headers = {
        "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",
        "Settled-From": str(start),
    }
    return StreamingResponse(
        sse_body(pool, facts, start), media_type="text/event-stream", headers=headers
    )
