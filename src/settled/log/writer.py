"""Write one stream of a session's output to its append-only byte log.

Owns: creating ``stdout.log`` / ``stderr.log``, appending every drained byte (up to an optional
cap), the running BLAKE3 digest over exactly the stored bytes, the cursor, the durable cursor
(published only after a successful fsync) and the final :class:`StreamSummary`.

Must never: split, decode or look at the bytes; drop a byte silently (bytes past the cap are
counted in ``not_stored``); stop draining because of the cap; retry a failed fsync silently;
reuse an existing file; accept bytes after a failed write or fsync (the writer is then poisoned
and every later call raises). This runs on the supervisor's hot path: it allocates nothing per read
and imports only os, fcntl, errno, dataclasses, typing and blake3.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from typing import Final

from blake3 import blake3

DIGEST_ALGORITHM: Final = "blake3"

F_SETPIPE_SZ: Final = 1031
F_GETPIPE_SZ: Final = 1032

_OPEN_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
_FILE_MODE: Final = 0o600


@dataclass(frozen=True)
class StreamSummary:
    """What one stream's receipt says about its log."""

    cursor: int  # bytes stored in the file == final cursor
    digest: str  # "blake3:<hex>" over exactly the stored bytes
    drained: int  # all bytes read from the pipe (stored + not_stored)
    not_stored: int  # bytes drained past the cap, counted but not written
    cap: int | None  # per-stream cap in bytes, None = unlimited

    def to_json(self) -> dict[str, object]:
        return {
            "cursor": self.cursor,
            "digest": self.digest,
            "drained": self.drained,
            "not_stored": self.not_stored,
            "cap": self.cap,
        }


class StreamWriter:
    """Append-only writer for one stream's log file."""

    def __init__(self, path: str, cap: int | None = None) -> None:
        if cap is not None and cap < 0:
            raise ValueError(f"cap must be >= 0 or None, got {cap}")
        self._path = path
        self._cap = cap
        self._hasher = blake3()
        self._cursor = 0
        self._durable = 0
        self._drained = 0
        self._not_stored = 0
        self._failure: OSError | None = None
        self._summary: StreamSummary | None = None
        # O_EXCL: FileExistsError if the log already exists; a log is never reused.
        self._fd = os.open(path, _OPEN_FLAGS, _FILE_MODE)

    @property
    def path(self) -> str:
        return self._path

    @property
    def cursor(self) -> int:
        """Stored bytes written so far."""
        return self._cursor

    @property
    def durable(self) -> int:
        """The cursor as of the last successful fsync."""
        return self._durable

    def append(self, data: memoryview | bytes) -> None:
        """Write all of ``data`` (looping on short writes); bytes past the cap are only counted."""
        if self._fd < 0:
            raise ValueError(f"append to closed log {self._path}")
        self._check_failure()
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        size = len(view)
        self._drained += size
        keep = size
        if self._cap is not None:
            keep = min(size, max(0, self._cap - self._cursor))
            self._not_stored += size - keep
        offset = 0
        fd = self._fd
        while offset < keep:
            try:
                written = os.write(fd, view[offset:keep])
            except OSError as exc:
                # The writer is poisoned: every later append, sync and close raises too.
                self._failure = exc
                raise
            self._hasher.update(view[offset : offset + written])
            offset += written
            self._cursor += written

    def sync(self) -> int:
        """fsync the log; return and record the durable cursor. An fsync error always raises."""
        if self._fd < 0:
            if self._summary is not None:
                return self._durable
            raise ValueError(f"sync of closed log {self._path}")
        self._check_failure()
        cursor = self._cursor
        if cursor == self._durable and cursor > 0:
            return cursor  # nothing new since the last fsync: a silent stream costs nothing
        try:
            os.fsync(self._fd)
        except OSError as exc:
            # After a failed fsync the kernel may have dropped dirty pages and a later fsync
            # can "succeed": never trust this file as durable again.
            self._failure = exc
            raise
        self._durable = cursor
        return cursor

    def close(self) -> StreamSummary:
        """sync, close the fd and return the summary; a second call returns the same summary."""
        if self._summary is not None:
            return self._summary
        if self._fd < 0:
            self._check_failure()
            raise ValueError(f"log {self._path} is closed without a summary")
        try:
            self.sync()
        finally:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self._summary = StreamSummary(
            cursor=self._cursor,
            digest=f"{DIGEST_ALGORITHM}:{self._hasher.hexdigest()}",
            drained=self._drained,
            not_stored=self._not_stored,
            cap=self._cap,
        )
        return self._summary

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise OSError(
                self._failure.errno,
                f"log {self._path} failed earlier and is not trusted: {self._failure.strerror}",
            ) from self._failure


def drain_once(fd: int, buf: bytearray, writer: StreamWriter) -> int:
    """One readv into the caller's buffer, appended to ``writer``; return n (0 = EOF).

    BlockingIOError and InterruptedError propagate to the caller's event loop.
    """
    n = os.readv(fd, [buf])
    if n:
        writer.append(memoryview(buf)[:n])
    return n


def enlarge_pipe(fd: int, size: int = 1 << 20) -> int:
    """Set the pipe's capacity with F_SETPIPE_SZ; on EPERM return the current capacity."""
    try:
        return fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except OSError as exc:
        if exc.errno != errno.EPERM:  # above /proc/sys/fs/pipe-max-size without privilege
            raise
        return fcntl.fcntl(fd, F_GETPIPE_SZ)
