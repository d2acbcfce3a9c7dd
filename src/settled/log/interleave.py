"""The order in which the owner stored stdout and stderr bytes, and the merged view it gives.

Owns: ``interleave.idx`` beside the logs, a 16-byte header then fixed-size 24-byte records
``(stream, start, end)`` (little-endian u8 + 7 pad, u64, u64): bytes ``[start, end)`` of that
stream were stored in this order relative to the other stream. The index is written only when
the stream switches (the last record's final end, then the new record) and when it is synced
(the last record's end so far, in place: one aligned 24-byte pwrite), never per chunk: consecutive
chunks of one stream only move the last record's end in memory, so the drain pays no syscall for
the order. The owner moves an end only after its bytes were written to the log, so the index
never claims bytes the log lacks; readers clamp every record to the limits they are given (the
durable or final cursors) and append whatever the index does not cover, stdout then stderr,
flagged as unordered.

The last record may end short of its stream's stored bytes (not yet synced). Those bytes are
still in order when the other stream has nothing past its records: every byte of the other
stream was then stored before the last record's bytes began, so the tail of the last record's
stream comes after all of it. A live reader checks that with the other stream's length read
after the limits were (``ordered_limits``), so a byte stored in between is never put ahead of
one stored before it.

The order is the owner's read order: across two pipes, true arrival order is only what the owner
observed (bytes the command wrote to both pipes between two reads may be reordered).

The merged cursor is a byte offset into the merged view; it is resumable because the merged view
of a prefix of each stream is a prefix of the merged view of more.

Must never: serve a byte that is not in the stream's log at that cursor, serve a byte twice, or
stop the drain when the index cannot be written (it then stops recording; readers fall back).
"""

from __future__ import annotations

import os
import struct
import threading
import time

from settled.errors import CursorOutOfRange
from settled.log.reader import pread_exact, stored_length
from settled.records import Frozen

TYPE_CHECKING = False  # loaded by every owner: no typing, dataclasses or collections.abc
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Final

INDEX_NAME: Final = "interleave.idx"
HEADER: Final = b"settled-ilv-v1\n\0"
RECORD: Final = struct.Struct("<B7xQQ")
TAGS: Final = {"stdout": 1, "stderr": 2}
NAMES: Final = {1: "stdout", 2: "stderr"}


def index_path(log_dir: str) -> str:
    return os.path.join(log_dir, INDEX_NAME)


class IndexWriter:
    """The owner's side: one record per stream switch; the last one's end is moved in memory
    while its stream runs and written at the next switch, sync or close.

    ``record`` belongs to the drain loop; ``sync`` may run in another thread (the flusher, the
    heartbeat). Both write under one lock, so the last record on disk is always the current
    one (a stale end is never written over a newer one); the fsync runs outside the lock, so a
    switch never waits for the disk."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        """`fd`: the index at `path` as its caller created it (O_WRONLY | O_CREAT | O_EXCL,
        0600, as here), owned by the writer from here."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o600) if fd is None else fd
        self._failed: str | None = None
        self._lock = threading.Lock()
        self._last_tag = 0
        self._last_start = 0
        self._last_end = 0  # moved by `record` alone, without the lock
        self._written_end = 0  # the last record's end as on disk
        self._offset = len(HEADER)  # where the next new record goes
        self._write(HEADER, 0)

    @property
    def failed(self) -> str | None:
        """Why the index stopped recording (readers then fall back for the rest)."""
        return self._failed

    def record(self, stream: str, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of ``stream`` were just stored in its log."""
        if end <= start or self._failed is not None:
            return
        tag = TAGS[stream]
        if tag == self._last_tag:
            self._last_end = end  # one int: the flusher's sync writes it, or the next switch
            return
        with self._lock:
            if self._last_tag and self._last_end != self._written_end:
                self._write_last()  # the finished record's final end, before the next one
                if self._failed is not None:
                    return
            self._last_tag, self._last_start, self._last_end = tag, start, end
            self._offset += RECORD.size
            self._write_last()

    def before_storing(self, stream: str) -> None:
        """Called by the drain before bytes of ``stream`` are stored in its log. When the last
        record is the other stream's, its end is written now, first: a live reader may have
        served that record's unsynced tail as ordered (`pieces` does while this stream ends at
        its records), and once this stream's log grows it would no longer; with the end on
        disk before then, the ordered prefix a live follow serves only ever grows."""
        if self._last_tag in (0, TAGS[stream]) or self._failed is not None:
            return
        with self._lock:
            if self._last_end != self._written_end:
                self._write_last()

    def sync(self) -> None:
        """Write the last record's end so far, then fsync (outside the lock)."""
        with self._lock:
            if self._fd < 0 or self._failed is not None:
                return
            if self._last_tag and self._last_end != self._written_end:
                self._write_last()
            fd = self._fd
        try:
            os.fsync(fd)
        except OSError as exc:
            self._failed = self._failed or f"fsync failed: {exc}"

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            with self._lock:
                fd, self._fd = self._fd, -1
            os.close(fd)

    def _write_last(self) -> None:
        end = self._last_end
        self._write(RECORD.pack(self._last_tag, self._last_start, end), self._offset - RECORD.size)
        self._written_end = end

    def _write(self, data: bytes, offset: int) -> None:
        try:
            if os.pwrite(self._fd, data, offset) != len(data):
                self._failed = "short write"
        except OSError as exc:
            self._failed = f"write failed: {exc}"


class Piece(Frozen):
    """A run of one stream in the merged view: ``[start, end)`` of ``stream`` at merged ``at``."""

    __slots__ = ("stream", "start", "end", "at", "ordered", "tail")  # noqa: RUF023 - field order
    stream: str
    start: int
    end: int
    at: int
    ordered: bool  # False: the index did not cover it (no index, or a tail it missed)
    tail: bool  # ordered as the last record's unsynced tail (see the module docstring)

    def __init__(
        self, stream: str, start: int, end: int, at: int, ordered: bool, tail: bool = False
    ) -> None:
        self._fill(locals())


def pieces(log_dir: str, limits: dict[str, int]) -> list[Piece]:
    """The merged view's layout up to ``limits`` (bytes of each stream that may be served).

    Records are trusted only while they are contiguous per stream; from the first that is not,
    the rest of each stream is appended unordered, stdout then stderr. When every record was
    trusted and the other stream ends at its records, the last record's stream goes on in
    order up to its limit (its tail not synced yet)."""
    cursors = {"stdout": 0, "stderr": 0}
    out: list[Piece] = []
    at = 0
    last: str | None = None
    whole = True  # every record trusted and inside the limits
    for stream, start, end in _records(index_path(log_dir)):
        if start != cursors[stream] or end <= start:
            whole = False
            break
        clamped = min(end, limits[stream])
        if clamped > start:
            out.append(Piece(stream, start, clamped, at, True))
            at += clamped - start
            cursors[stream] = clamped
        last = stream
        if clamped < end:
            whole = False
            break  # a limit cut the order here: what follows is not known to be stored
    if whole and last is not None:
        other = "stderr" if last == "stdout" else "stdout"
        if cursors[other] == limits[other] and cursors[last] < limits[last]:
            out.append(Piece(last, cursors[last], limits[last], at, True, tail=True))
            at += limits[last] - cursors[last]
            cursors[last] = limits[last]
    for stream in ("stdout", "stderr"):
        if cursors[stream] < limits[stream]:
            out.append(Piece(stream, cursors[stream], limits[stream], at, False))
            at += limits[stream] - cursors[stream]
    return out


def _records(path: str) -> Iterator[tuple[str, int, int]]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if pread_exact(fd, 0, len(HEADER)) != HEADER:
            return
        offset = len(HEADER)
        while True:
            block = pread_exact(fd, offset, RECORD.size * 4096)
            whole = len(block) - len(block) % RECORD.size
            for tag, start, end in RECORD.iter_unpack(block[:whole]):
                if tag not in NAMES:
                    return
                yield NAMES[tag], start, end
            if whole < RECORD.size * 4096:
                return
            offset += whole
    finally:
        os.close(fd)


class Chunk(Frozen):
    """Bytes of one stream in the merged view: merged cursor ``at``, stream cursor ``cursor``."""

    __slots__ = ("stream", "cursor", "at", "data", "ordered")  # noqa: RUF023 - field order
    stream: str
    cursor: int
    at: int
    data: bytes
    ordered: bool

    def __init__(self, stream: str, cursor: int, at: int, data: bytes, ordered: bool) -> None:
        self._fill(locals())


def read_merged(
    log_dir: str, limits: dict[str, int], start: int = 0, max_bytes: int = 1 << 20
) -> list[Chunk]:
    """Chunks of the merged view from merged cursor ``start``, at most ``max_bytes`` in all."""
    layout = pieces(log_dir, limits)
    total = layout[-1].at + layout[-1].end - layout[-1].start if layout else 0
    if start < 0 or start > total:
        raise CursorOutOfRange(start, total, "merged")
    out: list[Chunk] = []
    budget = max_bytes
    fds: dict[str, int] = {}
    try:
        for piece in layout:
            size = piece.end - piece.start
            if piece.at + size <= start or budget <= 0:
                continue
            skip = max(0, start - piece.at)
            count = min(size - skip, budget)
            fd = fds.get(piece.stream)
            if fd is None:
                fd = fds[piece.stream] = os.open(
                    os.path.join(log_dir, f"{piece.stream}.log"), os.O_RDONLY | os.O_CLOEXEC
                )
            data = pread_exact(fd, piece.start + skip, count)
            if len(data) < count:
                raise CursorOutOfRange(piece.start + skip + count, piece.start + skip + len(data),
                                       piece.stream, what="limit")  # fmt: skip
            out.append(
                Chunk(piece.stream, piece.start + skip, piece.at + skip, data, piece.ordered)
            )
            budget -= count
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def follow_merged(
    log_dir: str,
    limits: Callable[[], tuple[dict[str, int], bool]],
    start: int = 0,
    *,
    poll_interval: float = 0.05,
    timeout: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Chunk]:
    """The merged view from ``start`` as it grows; ``limits()`` gives the cursors that may be
    served now and whether they are final. Unordered tails are served only once final (a live
    tail is what the index will order on its next record). ``sleep`` waits between looks, at
    most ``poll_interval`` and never past the timeout (the Runtime's ends on a stored byte)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    cursor = start
    while True:
        now, final = limits()
        if not final:
            now = ordered_limits(log_dir, now)
        for chunk in read_merged(log_dir, now, cursor, 1 << 20):
            cursor = chunk.at + len(chunk.data)
            yield chunk
        if final and not read_merged(log_dir, now, cursor, 1):
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"follow of merged timed out at merged cursor {cursor}")
        left = poll_interval if deadline is None else deadline - time.monotonic()
        sleep(max(0.0, min(poll_interval, left)))


def ordered_limits(log_dir: str, limits: dict[str, int]) -> dict[str, int]:
    """What the index orders within ``limits``: a live follow serves only that prefix.

    ``limits`` are stored lengths read before this call. The last record's unsynced tail is
    served only if the other stream, read again now (after ``limits`` were), still ends at its
    records: a byte of it stored after the tail's length was read would otherwise be served
    after tail bytes stored later than it."""
    covered = {"stdout": 0, "stderr": 0}
    for piece in pieces(log_dir, limits):
        if not piece.ordered:
            continue
        if piece.tail:
            other = "stderr" if piece.stream == "stdout" else "stdout"
            if stored_length(os.path.join(log_dir, f"{other}.log")) != limits[other]:
                continue
        covered[piece.stream] = piece.end
    return covered
