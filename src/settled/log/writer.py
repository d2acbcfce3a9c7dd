"""Write one stream of a session's output to its append-only byte log.

Owns: creating ``stdout.log`` / ``stderr.log``, appending every drained byte (up to an optional
cap, and while the home stays above its reserve), the running BLAKE3 digest over exactly the
stored bytes, the cursor, the durable cursor (published only after a successful fsync) and the
final :class:`StreamSummary`.

When the log cannot be written (ENOSPC, EIO, a failed fsync, or the reserve reached) the writer
does not raise and the owner does not stop draining: from that byte on it stores nothing more
(the log stays a prefix of the output, never a prefix with a hole), counts every later byte in
``dropped`` and keeps the first reason in ``dropped_reason``. The summary then says the stream is
incomplete. After a failed fsync the file is never fsynced again (the kernel may have dropped
dirty pages and a later fsync can "succeed"), so the durable cursor stays where it was.

Must never: split, decode or look at the bytes; drop a byte silently (bytes past the cap are
counted in ``not_stored``, bytes it could not store in ``dropped``); stop draining; retry a
failed write or fsync; reuse an existing file. This runs on the supervisor's hot path: it
allocates nothing per read and imports only os, fcntl, errno, threading, blake3 and settled's
foundation (no dataclasses or typing: every fresh owner loads this).

Splice (``splice=True``; off unless ``SETTLED_LOG_SPLICE=1``, as it measured slower than read +
write on this machine, bench/drain.py; and then chosen by the owner only where nothing but itself
can write the log:
the home hidden from the command by its mount namespace, the owner out of its PID namespace's
view): ``splice_from`` moves bytes from the pipe to the file in the kernel, at the writer's own
offset (a file opened ``O_APPEND`` refuses splice), and the digest is computed behind the drain
from the file's own bytes (``sync``, ``close``), so it covers exactly what is in the file. The
price: a write into the log by someone else before it is hashed would be in the digest; what
keeps anyone else out is that the file is created ``O_EXCL``, private, in a home the command
cannot see, through a descriptor it cannot reach, and host root is trusted. A splice the kernel
refuses (EINVAL, ENOSYS, ...) falls back to ``readv`` + ``append`` for good, storing on; one that
fails (ENOSPC, EIO) stops storing like a failed write; either way the bytes stay in the pipe and
the next read drains and counts them. Past the cap or the reserve the loop reads and counts, as
always. A read-back that fails ends the digest there: the receipt's cursor is the hashed prefix
and the rest is counted dropped, so it never names a digest of bytes it did not read.

Threads: ``append`` belongs to the drain loop alone; ``sync`` may be called from any thread (the
flusher behind the drain, the lease heartbeat, ``close``) and takes a lock that ``append`` never
takes, so an fsync never stalls the copy. The cursor an fsync publishes is read before the fsync
starts, and an append moves the cursor only after its write returned, so every byte the durable
cursor names was in the file before the fsync began.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading

from blake3 import blake3

from settled import faults
from settled.home import SpaceGuard
from settled.records import Frozen

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

DIGEST_ALGORITHM: Final = "blake3"

F_SETPIPE_SZ: Final = 1031
F_GETPIPE_SZ: Final = 1032

_OPEN_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
_SPLICE_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC  # read back to hash
# errno of a splice the kernel does not offer for this pipe and file: read and write instead
_SPLICE_REFUSED: Final = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV})
SPLICE_BLOCK: Final = 8 << 20  # bytes asked of the space guard at a time while splicing
_HASH_CHUNK: Final = 1 << 20
_FILE_MODE: Final = 0o600


class StreamSummary(Frozen):
    """What one stream's receipt says about its log."""

    __slots__ = (  # noqa: RUF023 - field order
        "cursor", "digest", "drained", "not_stored", "cap", "dropped", "dropped_reason",
    )  # fmt: skip
    cursor: int  # bytes stored in the file == final cursor
    digest: str  # "blake3:<hex>" over exactly the stored bytes
    drained: int  # all bytes read from the pipe (stored + not_stored)
    not_stored: int  # bytes drained past the cap, counted but not written
    cap: int | None  # per-stream cap in bytes, None = unlimited
    dropped: int  # bytes drained that could not be stored (disk full, I/O error, reserve)
    dropped_reason: str | None  # why the first of them was not stored

    def __init__(
        self,
        cursor: int,
        digest: str,
        drained: int,
        not_stored: int,
        cap: int | None,
        dropped: int = 0,
        dropped_reason: str | None = None,
    ) -> None:
        self._fill(locals())

    @property
    def complete(self) -> bool:
        """Every drained byte was stored, or deliberately not stored past the cap."""
        return self.dropped == 0 and self.dropped_reason is None

    def to_json(self) -> dict[str, object]:
        return {
            "cursor": self.cursor,
            "digest": self.digest,
            "drained": self.drained,
            "not_stored": self.not_stored,
            "cap": self.cap,
            "dropped": self.dropped,
            "dropped_reason": self.dropped_reason,
            "complete": self.complete,
        }


class StreamWriter:
    """Append-only writer for one stream's log file."""

    def __init__(
        self,
        path: str,
        cap: int | None = None,
        space: SpaceGuard | None = None,
        *,
        splice: bool = False,
        fd: int | None = None,
    ) -> None:
        """`fd`: the log at `path` as its caller created it, with the flags and mode used here
        (those of `splice` when it splices; 0600): an owner creates its logs before its command
        runs, and loads this module while it runs. The writer owns it from here."""
        if cap is not None and cap < 0:
            raise ValueError(f"cap must be >= 0 or None, got {cap}")
        self._path = path
        self._cap = cap
        self._space = space
        self._dropped = 0
        self._dropped_reason: str | None = None
        self._sync_failed = False
        self._hasher = blake3()
        self._cursor = 0
        self._durable = 0
        self._drained = 0
        self._not_stored = 0
        self._summary: StreamSummary | None = None
        self._sync_lock = threading.Lock()  # one fsync at a time; the durable cursor only grows
        self._behind = splice  # the digest is read back from the file, for the writer's life
        self._splicing = splice  # until the kernel refuses, storing stops, or the cap is reached
        self._granted = 0  # splice: bytes the space guard allowed and not used yet
        self._hashed = 0  # behind: bytes [0, _hashed) of the file are in the digest
        self._hash_error: str | None = None
        self._back: bytearray | None = None
        # O_EXCL: FileExistsError if the log already exists; a log is never reused.
        if fd is None:
            fd = os.open(path, _SPLICE_FLAGS if splice else _OPEN_FLAGS, _FILE_MODE)
        self._fd = fd

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

    @property
    def splicing(self) -> bool:
        """Whether the drain may call ``splice_from`` (else it reads and appends)."""
        return self._splicing

    def splice_from(self, pipe: int, size: int) -> int | None:
        """Move up to ``size`` bytes from ``pipe`` into the log in the kernel; n moved (0: EOF),
        or None when this read must go through ``readv`` + ``append`` (splice refused or
        failed, storing stopped, the cap or the reserve reached: they count what they drain).
        BlockingIOError propagates, as from ``readv``."""
        if not self._splicing or self._dropped_reason is not None or self._fd < 0:
            self._splicing = False
            return None
        want = size if self._cap is None else min(size, self._cap - self._cursor)
        if self._space is not None and want > 0:
            if self._granted <= 0:
                self._granted = self._space.room(SPLICE_BLOCK)
            want = min(want, self._granted)
        if want <= 0:
            self._splicing = False
            return None
        try:
            faults.point("owner.log_write")
            moved = os.splice(pipe, self._fd, want, offset_dst=self._cursor)
        except (BlockingIOError, InterruptedError):
            raise
        except OSError as exc:
            self._splicing = False
            if exc.errno not in _SPLICE_REFUSED:
                self._stop_storing(f"splice failed: {_os_reason(exc)}")
            return None
        self._cursor += moved
        self._drained += moved
        self._granted -= moved
        return moved

    def adopt(self, data: bytes) -> None:
        """Count ``data`` as stored: it is in the file already at the cursor, written there
        before this writer existed by the owner's first drain (owner/early.py), within the
        cap. Digested from ``data`` itself, the bytes that were read from the pipe, never read
        back from the file (in splice mode the read-back digests the file, as for every byte)."""
        size = len(data)
        if self._cap is not None and self._cursor + size > self._cap:
            raise ValueError(f"adopting {size} bytes at {self._cursor} passes the cap {self._cap}")
        self._drained += size
        self._cursor += size
        if not self._behind:
            self._hasher.update(data)

    def append(self, data: memoryview | bytes) -> None:
        """Store all of ``data`` (looping on short writes); bytes past the cap are only counted,
        and so are bytes that cannot be stored once the log could not be written."""
        if self._fd < 0:
            raise ValueError(f"append to closed log {self._path}")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        size = len(view)
        self._drained += size
        wanted = size
        if self._cap is not None:
            wanted = min(size, max(0, self._cap - self._cursor))
            self._not_stored += size - wanted
        keep = wanted if self._dropped_reason is None else 0
        if keep and self._space is not None:
            keep = self._space.room(wanted)
            if keep < wanted:
                self._stop_storing(self._space.refused or "the reserve was reached")
        offset = 0
        fd = self._fd
        while offset < keep:
            try:
                faults.point("owner.log_write")
                if self._behind:  # no O_APPEND (splice refuses it): the writer's own offset
                    written = os.pwrite(fd, view[offset:keep], self._cursor)
                else:
                    written = os.write(fd, view[offset:keep])
            except OSError as exc:
                self._stop_storing(f"write failed: {_os_reason(exc)}")
                break
            if not self._behind:
                self._hasher.update(view[offset : offset + written])
            offset += written
            self._cursor += written
        self._dropped += wanted - offset

    def sync(self) -> int:
        """fsync the log; return and record the durable cursor. A failed fsync is never
        retried: the log stores nothing more and its durable cursor stays where it was.
        Safe from any thread, beside the drain's appends (see the module's docstring)."""
        with self._sync_lock:
            if self._fd < 0:
                if self._summary is not None:
                    return self._durable
                raise ValueError(f"sync of closed log {self._path}")
            self._hash_behind()
            return self._sync_locked()

    def _hash_behind(self) -> None:
        """Digest the file's bytes stored since the last call (splice mode; under the lock)."""
        if not self._behind or self._hash_error is not None:
            return
        end = self._cursor  # read once: every byte below it is in the file
        if self._back is None:
            self._back = bytearray(_HASH_CHUNK)
        view = memoryview(self._back)
        while self._hashed < end:
            try:
                got = os.preadv(
                    self._fd, [view[: min(_HASH_CHUNK, end - self._hashed)]], self._hashed
                )
            except OSError as exc:
                got, why = 0, _os_reason(exc)
            else:
                why = "the file is shorter than its cursor"
            if got <= 0:
                self._hash_error = (
                    f"reading the log back to hash it failed at {self._hashed}: {why}"
                )
                self._stop_storing(self._hash_error)
                return
            self._hasher.update(view[:got])
            self._hashed += got

    def _sync_locked(self) -> int:
        cursor = self._cursor  # read once, before the fsync: every byte below it is written
        if self._sync_failed or (cursor == self._durable and cursor > 0):
            return self._durable  # nothing new since the last fsync: a silent stream costs nothing
        try:
            faults.point("owner.log_sync")
            os.fsync(self._fd)
        except OSError as exc:
            # After a failed fsync the kernel may have dropped dirty pages and a later fsync
            # can "succeed": never trust this file as durable again.
            self._sync_failed = True
            self._stop_storing(
                f"fsync failed: {_os_reason(exc)}; bytes after cursor {self._durable} are "
                "not known to be on disk"
            )
            return self._durable
        self._durable = cursor
        return cursor

    def close(self) -> StreamSummary:
        """sync, close the fd and return the summary; a second call returns the same summary.
        Under the sync lock, so no other thread's fsync can reach a closed (or reused) fd."""
        with self._sync_lock:
            if self._summary is not None:
                return self._summary
            if self._fd < 0:
                raise ValueError(f"log {self._path} is closed without a summary")
            try:
                self._hash_behind()
                self._sync_locked()
            finally:
                fd, self._fd = self._fd, -1
                os.close(fd)
            cursor, dropped = self._cursor, self._dropped
            if self._hash_error is not None:  # the digest ends where reading back failed
                cursor, dropped = self._hashed, dropped + self._cursor - self._hashed
                self._durable = min(self._durable, cursor)
            self._summary = StreamSummary(
                cursor=cursor,
                digest=f"{DIGEST_ALGORITHM}:{self._hasher.hexdigest()}",
                drained=self._drained,
                not_stored=self._not_stored,
                cap=self._cap,
                dropped=dropped,
                dropped_reason=self._dropped_reason,
            )
            return self._summary

    @property
    def dropped(self) -> int:
        """Bytes drained that could not be stored so far."""
        return self._dropped

    def _stop_storing(self, reason: str) -> None:
        """From now on nothing more is stored: the first reason is the one the receipt names."""
        if self._dropped_reason is None:
            self._dropped_reason = f"{reason} (stored {self._cursor} bytes before it)"


def _os_reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{name}: {exc.strerror}"


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
