"""The owner's first drain: both pipes read, in order, while the rest of the owner loads.

A fresh owner's command runs some 40 ms before its log writers and supervise loop exist
(session.py loads meanwhile). The pipes would keep every byte it writes (1 MiB each), but not
the order between the two streams: a command alternating between them would come back as one
batch per stream, and the interleave index would record that. This thread reads both pipes
from the command's first byte and keeps each read as (stream, bytes), in the order it read
them, until the session takes them over (`handover`) and appends them to the logs and the
index exactly as its own drain would have. Bounded: with LIMIT bytes held it stops reading, and
the pipes hold the rest (the command then waits, as on any full pipe).

The first COPY_LIMIT bytes of each stream (never past its cap) are also written to its log at
once, in the order read: an owner killed before its writers exist then leaves them where
recovery reads a lost owner's logs, instead of only in its memory. The log only grows, as
readers expect of it. At the handover each writer adopts what was written (it counts and
digests the bytes from this thread's own copy, never from the file) and appends the rest; the
index records every read in order. Bounded so that what is written before the writer can ask
the home's reserve stays small: the reserve is asked for everything after it.

Started before the command, with the owner's other threads (it starts none after:
settled.nothreads), at the interpreter's switch interval; once the command runs, `quicken`
shortens it. A `_thread`, not a `threading.Thread`: the builtin is loaded with the
interpreter, and threading.py would cost the owner 2-3 ms before its drain starts. Must never:
write, drop or reorder a byte, or outlive `handover`.
"""

from __future__ import annotations

import os
import sys

from settled import faults
from settled.boundary import linux
from settled.rawthread import RawThread

TYPE_CHECKING = False
if TYPE_CHECKING:
    from settled.owner.supervise import Streams

LIMIT = 4 << 20  # bytes held at most: the owner's RSS while it loads
COPY_LIMIT = 64 << 10  # bytes of each stream written to its log before its writer exists
READ = 1 << 16  # bytes per read: fresh bytes objects past 128 KiB fault page by page
# While the owner's main thread imports, this thread waits for the GIL up to the switch
# interval (5 ms by default) each time a pipe becomes readable: a shorter one meanwhile keeps
# two streams' writes apart when they come a few ms apart.
SWITCH_INTERVAL_S = 0.0005


class EarlyDrain:
    def __init__(
        self, fds: dict[str, int], logs: dict[str, int] | None = None, cap: int | None = None
    ) -> None:
        """`fds`: each stream's pipe; `logs`: each stream's log, where the first reads are
        written; `cap`: the per-stream cap of the writers to come (None: none)."""
        self.reads: list[tuple[str, bytes]] = []
        self._logs = dict(logs or {})
        limit = COPY_LIMIT if cap is None else min(COPY_LIMIT, max(0, cap))
        self.room = dict.fromkeys(self._logs, limit)  # what each log may still take here
        self.written = dict.fromkeys(self._logs, 0)  # bytes of each stream in its log
        self.ended: set[str] = set()
        self._held = 0
        self._by_fd = {fd: name for name, fd in fds.items()}
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._interval: float | None = None  # the switch interval before `quicken`
        self._thread = RawThread(self._drain)
        self._thread.start()

    def quicken(self) -> None:
        """Once the command runs (this thread starts before it, with the owner's others, and
        must not slow the launch by taking the GIL every 0.5 ms meanwhile)."""
        if self._interval is None:
            self._interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)

    def _drain(self) -> None:
        """poll through the boundary's C binding (linux.poll_in), not the select module: this
        thread starts before the command, on a fresh owner's launch path."""
        while self._by_fd and self._held < LIMIT:
            ready = linux.poll_in([self._stop_r, *self._by_fd])
            if self._stop_r in ready:
                return
            for fd in ready:
                self._read(fd)

    def _read(self, fd: int) -> None:
        name = self._by_fd[fd]
        data = os.read(fd, READ)  # readable: returns at once, with what the pipe holds
        if not data:
            self.ended.add(name)
            del self._by_fd[fd]
            return
        self.reads.append((name, data))
        self._held += len(data)
        self._copy(name, data)

    def _copy(self, name: str, data: bytes) -> None:
        """Write what fits of one read to its log; a log that refuses a write (no space, an
        I/O error) gets nothing more here, and the read is held all the same."""
        fd = self._logs.get(name)
        if fd is None or self.room[name] == 0:
            return
        view = memoryview(data)[: self.room[name]]
        try:
            while view:
                faults.point("owner.log_write")  # a write of drained output, as the writer's
                done = os.write(fd, view)
                self.written[name] += done
                self.room[name] -= done
                view = view[done:]
        except OSError:
            del self._logs[name]

    def handover(self) -> tuple[list[tuple[str, bytes]], set[str]]:
        """Stop reading; every read so far, in order, and the streams that reached EOF."""
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")
            self._thread.join()
            if self._interval is not None:
                sys.setswitchinterval(self._interval)
            for fd in (self._stop_r, self._stop_w):
                os.close(fd)
            self._stop_r = self._stop_w = -1
        return self.reads, self.ended

    def hand_to(self, streams: Streams) -> None:
        """Stop, then append every read to the session's logs and index in its order, as the
        supervise loop's own drain would have (log first, then the index), and mark the
        streams that reached EOF meanwhile."""
        reads, ended = self.handover()
        in_log = dict(self.written)  # the first bytes of each stream, written here already
        for name, data in reads:
            writer = streams.writers[name]
            before = writer.cursor
            if streams.index is not None:
                streams.index.before_storing(name)
            there = min(len(data), in_log.get(name, 0))
            if there:
                writer.adopt(data[:there])
                in_log[name] -= there
            if there < len(data):
                writer.append(data[there:])
            if streams.index is not None and writer.cursor != before:
                streams.index.record(name, before, writer.cursor)
        streams.open -= ended
        if reads:  # the first drain, for the fault point as for the loop's own first drain
            streams.drained = True
            faults.point("owner.mid_drain")
