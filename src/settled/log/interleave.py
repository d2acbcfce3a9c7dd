"""The order in which the owner stored stdout and stderr bytes, and the merged view it gives.

Owns: ``interleave.idx`` beside the logs, a 16-byte header then fixed-size 24-byte records
``(stream, start, end)`` (little-endian u8 + 7 pad, u64, u64): bytes ``[start, end)`` of that
stream were stored in this order relative to the other stream. Consecutive chunks of one stream
extend the last record in place (one aligned 24-byte pwrite), so the index grows only when the
stream switches. The owner writes a record only after its bytes were written to the log, so
the index never claims bytes the log lacks; readers clamp every record to the limits they are
given (the durable or final cursors) and append whatever the index does not cover, stdout then
stderr, flagged as unordered.

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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from settled.errors import CursorOutOfRange
from settled.log.reader import pread_exact

INDEX_NAME: Final = "interleave.idx"
HEADER: Final = b"settled-ilv-v1\n\0"
RECORD: Final = struct.Struct("<B7xQQ")
TAGS: Final = {"stdout": 1, "stderr": 2}
NAMES: Final = {1: "stdout", 2: "stderr"}


def index_path(log_dir: str) -> str:
    return os.path.join(log_dir, INDEX_NAME)


class IndexWriter:
    """The owner's side: one record per stream switch, extended in place while a stream runs."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        """`fd`: the index at `path` as its caller created it (O_WRONLY | O_CREAT | O_EXCL,
        0600, as here), owned by the writer from here."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o600) if fd is None else fd
        self._failed: str | None = None
        self._last_tag = 0
        self._last_start = 0
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
            self._write(RECORD.pack(tag, self._last_start, end), self._offset - RECORD.size)
            return
        self._last_tag, self._last_start = tag, start
        self._write(RECORD.pack(tag, start, end), self._offset)
        self._offset += RECORD.size

    def sync(self) -> None:
        if self._fd >= 0 and self._failed is None:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                self._failed = f"fsync failed: {exc}"

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            fd, self._fd = self._fd, -1
            os.close(fd)

    def _write(self, data: bytes, offset: int) -> None:
        try:
            if os.pwrite(self._fd, data, offset) != len(data):
                self._failed = "short write"
        except OSError as exc:
            self._failed = f"write failed: {exc}"


@dataclass(frozen=True)
class Piece:
    """A run of one stream in the merged view: ``[start, end)`` of ``stream`` at merged ``at``."""

    stream: str
    start: int
    end: int
    at: int
    ordered: bool  # False: the index did not cover it (no index, or a tail it missed)


def pieces(log_dir: str, limits: dict[str, int]) -> list[Piece]:
    """The merged view's layout up to ``limits`` (bytes of each stream that may be served).

    Records are trusted only while they are contiguous per stream; from the first that is not,
    the rest of each stream is appended unordered, stdout then stderr."""
    cursors = {"stdout": 0, "stderr": 0}
    out: list[Piece] = []
    at = 0
    for stream, start, end in _records(index_path(log_dir)):
        if start != cursors[stream] or end <= start:
            break
        clamped = min(end, limits[stream])
        if clamped > start:
            out.append(Piece(stream, start, clamped, at, True))
            at += clamped - start
            cursors[stream] = clamped
        if clamped < end:
            break  # a limit cut the order here: what follows is not known to be stored
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


@dataclass(frozen=True)
class Chunk:
    """Bytes of one stream in the merged view: merged cursor ``at``, stream cursor ``cursor``."""

    stream: str
    cursor: int
    at: int
    data: bytes
    ordered: bool


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
    tail is what the index will order on its next record)."""
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
        sleep(poll_interval)


def ordered_limits(log_dir: str, limits: dict[str, int]) -> dict[str, int]:
    """What the index orders within ``limits``: a live follow serves only that prefix."""
    covered = {"stdout": 0, "stderr": 0}
    for piece in pieces(log_dir, limits):
        if piece.ordered:
            covered[piece.stream] = piece.end
    return covered
