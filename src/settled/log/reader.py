"""Read a stream's byte log by cursor: ranges, and following a log that is still being written.

Owns: byte ranges ``[start, start + max)`` addressed by cursor (a byte offset counting only
stored bytes), one short read at a cursor (``StreamLog``, what an async streamer polls), and
``follow`` up to the stream's final cursor. A cursor outside what is stored
raises ``settled.errors.CursorOutOfRange``.

Must never: split on lines, decode, or otherwise interpret the bytes; read past the file's size
or past a known final cursor; wait without a bound when given a timeout; load a whole log to
answer a range.
"""

from __future__ import annotations

import os
import time

from settled.errors import CursorOutOfRange
from settled.records import Frozen

TYPE_CHECKING = False  # loaded by every owner (interleave.py): no dataclasses, collections.abc
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


def stream_name(path: str) -> str:
    """``.../stdout.log`` -> ``stdout``: the name used in messages."""
    name = os.path.basename(path)
    return name[:-4] if name.endswith(".log") else name


def stored_length(path: str) -> int:
    """The number of bytes stored so far; 0 if the file does not exist yet."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def pread_exact(fd: int, offset: int, size: int) -> bytes:
    """Read ``size`` bytes at ``offset``, looping on short reads; shorter only at end of file."""
    first = os.pread(fd, size, offset)
    if len(first) == size or not first:
        return first
    parts = [first]
    got = len(first)
    while got < size:
        part = os.pread(fd, size - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_at(path: str, cursor: int, size: int, limit: int | None) -> tuple[bytes, int]:
    """Up to ``size`` bytes at ``cursor``, never past ``limit``; and the bytes stored now.

    A file not created yet reads as empty. Opens and closes the file each call, so a cancelled
    reader never leaves a descriptor (or a read racing its close) behind.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return b"", 0
    try:
        stored = os.fstat(fd).st_size
        end = stored if limit is None else min(stored, limit)
        count = min(size, end - cursor)
        return (pread_exact(fd, cursor, count) if count > 0 else b""), stored
    finally:
        os.close(fd)


class StreamLog(Frozen):
    """One stream's log file, named so its reader never needs the layout of the home: each
    call is one short read (open, fstat, pread, close) that holds nothing between calls, so
    any thread may make it, and an event loop can hand each one to a worker."""

    __slots__ = ("path", "stream")
    path: str
    stream: str

    def __init__(self, path: str, stream: str) -> None:
        self._fill(locals())

    def stored_length(self) -> int:
        """The bytes stored so far (0 before the file exists)."""
        return stored_length(self.path)

    def read_at(self, cursor: int, size: int, limit: int | None = None) -> tuple[bytes, int]:
        """Up to ``size`` bytes at ``cursor``, never past ``limit``; and the bytes stored now."""
        return read_at(self.path, cursor, size, limit)


def read_range(path: str, start: int, max_bytes: int, end: int | None = None) -> bytes:
    """Bytes ``[start, start + max_bytes)`` of the stored stream (fewer at its end).

    ``end`` (a settled stream's final cursor) is where the stream ends even when the file holds
    more: bytes a lost owner appended after recovery named the cursor are never served.
    ``start == length`` gives ``b""``; ``start < 0`` or ``start > length`` raises
    :class:`CursorOutOfRange`.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if start != 0:
            raise CursorOutOfRange(start, 0, stream_name(path)) from None
        return b""
    try:
        length = os.fstat(fd).st_size
        if end is not None:
            length = min(length, end)
        if start < 0 or start > length:
            raise CursorOutOfRange(start, length, stream_name(path))
        size = min(max_bytes, length - start)
        return pread_exact(fd, start, size) if size else b""
    finally:
        os.close(fd)


def follow(
    path: str,
    start: int,
    final_cursor: Callable[[], int | None],
    *,
    chunk: int = 1 << 20,
    poll_interval: float = 0.05,
    timeout: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[bytes]:
    """Yield the stream from ``start`` as it grows, ending exactly at its final cursor.

    While ``final_cursor()`` returns None the stream is still being written: wait (polling every
    ``poll_interval`` seconds) for more bytes. Once it returns an int, yield up to exactly that
    cursor and stop. ``timeout`` bounds the whole follow, measured from the first request for a
    chunk and checked between chunks; when it elapses, TimeoutError names the cursor reached.
    The file may not exist yet when following starts. ``sleep`` waits between looks, at most
    ``poll_interval``: the Runtime's pause ends when a byte is stored in the log (inotify,
    log/watch.py) or the session's owner exits, so it passes a long interval and the follower
    wakes on events; ``time.sleep`` polls.
    """
    if start < 0:
        raise CursorOutOfRange(start, stored_length(path), stream_name(path))
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    return _follow(path, start, final_cursor, chunk, poll_interval, timeout, sleep)


def _follow(
    path: str,
    start: int,
    final_cursor: Callable[[], int | None],
    chunk: int,
    poll_interval: float,
    timeout: float | None,
    sleep: Callable[[float], None],
) -> Iterator[bytes]:
    deadline = None if timeout is None else time.monotonic() + timeout
    stream = stream_name(path)
    cursor = start
    fd = -1
    try:
        while True:
            # Ask for the final cursor before the size: a final cursor is published only after
            # all its bytes are in the file, so the size read next can never be short of it.
            final = final_cursor()
            if fd < 0:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    fd = -1
            size = os.fstat(fd).st_size if fd >= 0 else 0
            if final is not None:
                if cursor > final:
                    raise CursorOutOfRange(cursor, final, stream)
                if size < final:
                    raise CursorOutOfRange(final, size, stream, what="final cursor")
                size = final
            while cursor < size:
                _check_deadline(deadline, cursor, stream, timeout)  # a steady stream too
                data = pread_exact(fd, cursor, min(chunk, size - cursor))
                if not data:  # the file shrank under us; let the checks above decide
                    break
                cursor += len(data)
                yield data
            if final is not None and cursor == final:
                return
            _check_deadline(deadline, cursor, stream, timeout)
            if deadline is None:
                sleep(poll_interval)
            else:
                sleep(max(0.0, min(poll_interval, deadline - time.monotonic())))
    finally:
        if fd >= 0:
            os.close(fd)


def _check_deadline(
    deadline: float | None, cursor: int, stream: str, timeout: float | None
) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(
            f"follow of {stream} timed out after {timeout}s at cursor {cursor}; "
            f"resume with --from {cursor}"
        )
