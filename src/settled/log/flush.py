"""fsync a session's logs behind the drain, from a thread of its own, every few MiB stored.

Why: a log that is only fsynced at the heartbeat and at the end makes the end wait for every
dirty page at once (1 GiB of output: ~0.4 s of disk after the last byte, bench/drain.py). Synced
behind the drain, the disk writes overlap the copy, the final fsync finds almost nothing left,
and the durable cursors published at each heartbeat are closer to the stored ones.

The drain loop only calls ``due`` (an integer compare) and, every ``every`` bytes of a stream,
``poke`` (one Event set): it never waits for the disk. The thread calls each writer's ``sync``,
which reads the cursor before its fsync and takes the writer's own lock (writer.py), so the
durable cursor still names only bytes that were in the file before the fsync began, whichever
thread made it. An fsync that fails is the writer's business as it always was: it stores nothing
more and its durable cursor stays put.

``SETTLED_LOG_FLUSH`` (bytes; ``0`` for none, as before this existed) sets the interval for an
owner, so a benchmark can measure the drain with and without it in one run.

The thread is started before the owner's command (an owner starts no thread after it:
settled.nothreads); it idles until the streams are attached. Built on `_thread` and an eventfd,
not threading, whose imports would cost a fresh owner several ms on its launch path.

Must never: write or read a log's bytes, raise into the drain, or outlive ``close``.
"""

from __future__ import annotations

import os

from settled.rawthread import RawThread, await_event

TYPE_CHECKING = False  # loaded by every owner: no typing or collections.abc at run time
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Final, Protocol

    class Syncable(Protocol):
        def sync(self) -> object: ...


FLUSH_EVERY: Final = 8 << 20  # bytes of one stream between two fsyncs behind the drain
FLUSH_ENV: Final = "SETTLED_LOG_FLUSH"


def flush_every(text: str | None) -> int | None:
    """The interval ``SETTLED_LOG_FLUSH`` asks for: unset or empty the default, ``0`` none."""
    if not text:
        return FLUSH_EVERY
    every = int(text)
    if every < 0:
        raise ValueError(f"{FLUSH_ENV} must be >= 0 bytes, got {text!r}")
    return every or None


class Flusher:
    """One thread that syncs what it is given whenever the drain pokes it; with ``every``
    None it never starts, and the logs are fsynced at the heartbeat and the end only."""

    def __init__(self, every: int | None = FLUSH_EVERY) -> None:
        if every is not None and every <= 0:
            raise ValueError(f"every must be > 0 or None, got {every}")
        self.every = every
        self.syncs = 0  # completed rounds, for tests and the receipt's curious reader
        self._targets: tuple[Syncable, ...] = ()
        self._poked = os.eventfd(0, os.EFD_CLOEXEC)  # the thread blocks reading it
        self._stopping = False
        self._thread = RawThread(self._run)

    def start(self) -> None:
        if self.every is not None:
            self._thread.start()

    def attach(self, targets: Sequence[Syncable]) -> None:
        """What each poke syncs, in order (the stream logs, then the interleave index)."""
        self._targets = tuple(targets)

    def poke(self) -> None:
        """Sync soon; never waits. Pokes while a round runs fold into one more round."""
        if self._poked >= 0:
            os.eventfd_write(self._poked, 1)

    def close(self) -> None:
        """Stop the thread after the round it may be in; idempotent."""
        self._stopping = True
        if self._poked < 0:
            return
        os.eventfd_write(self._poked, 1)
        self._thread.join()
        os.close(self._poked)
        self._poked = -1

    def _run(self) -> None:
        while True:
            await_event(self._poked)  # blocks (without the GIL) until poked; clears it
            if self._stopping:
                return
            for target in self._targets:
                target.sync()
            self.syncs += 1
