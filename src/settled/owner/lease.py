"""The owner's lease, renewed by a thread of its own so that a slow store never stops the drain.

A renewal is a blocking store write: the lease, the durable stdout/stderr cursors (each log
fsynced just before), and the pending cancel reason back. Made inline by the supervise loop, it
left both pipes undrained for as long as the store took. Here the loop only asks (`request`), and
the keeper's thread renews on a store connection it opens itself (a SQLite connection serves one
thread).

The lease still means "the supervise loop is alive", never "a thread is alive":
- the thread renews only when the loop asked, and anchors the new lease at the moment the loop
  asked (`alive_at`), never at the moment the store answers;
- a request older than `stale_after` is dropped unrenewed (the loop has not asked since, so it may
  be stuck), unless the loop is waiting for exactly that answer (`confirm`);
so a stuck or SIGSTOPped loop asks for nothing and its lease runs out as it always did. Each
request is also written, by the loop's thread, as the owner's local beat (`beat`: local_beat.py),
which keeps a live owner alive on its own host while the store is out and its lease lapses.

A renewal that meets an outage is the owner's to wait out (store_retry.py): the renew function
returns without renewing (that beat fails, the next one tries again) and never blocks the loop.
The keeper lives until the owner's receipt is written: the owner asks for renewals while it
settles, so a slow settle (a seal, a receipt waiting for its store) never lapses its lease.

What comes back, comes back to the loop: the first cancel reason, or the failure of a renewal
(StaleWrite when the session was fenced, or any other exception), makes `fileno()` (an eventfd the
loop selects on) readable, and `collect()` returns the reason or raises the failure in the loop's
thread, so it leaves the loop exactly as an inline renewal's exception did. `close()` stops the
thread and waits for it: it never outlives the supervisor.

The owner starts the keeper before its command (it starts no thread after: settled.nothreads),
and the thread connects only at its first request, so while the owner starts its command the
thread holds nothing but a blocked read of its eventfd. Built on `_thread` and eventfds, not
threading: a fresh owner starts it on its launch path, where threading's imports (functools,
collections) would cost it several ms.

Must never: renew without a request from the owner, swallow a failure, or outlive `close()`.
"""

from __future__ import annotations

import _thread
import os
import time

from settled.rawthread import RawThread, await_event

TYPE_CHECKING = False  # started on the owner's launch path: no typing or contextlib there
if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    Renew = Callable[[float], str | None]  # renew a lease from this wall time; cancel back
    Connect = Callable[[], AbstractContextManager[Renew]]  # entered in the thread, as its store
else:  # importable names at run time (annotations are never evaluated)
    Renew = Connect = object

STALE_BEATS = 2  # a loop that has not asked for this many heartbeat periods may be stuck
HEARTBEATS_PER_LEASE = 5  # a starved owner has four renewals to spare


def lease_seconds() -> float:
    """The lease an owner holds (SETTLED_LEASE_S; tests shorten it), read when asked."""
    return float(os.environ.get("SETTLED_LEASE_S") or 15.0)


class _Request:
    """A plain class, not a dataclass: every owner imports this on its launch path."""

    __slots__ = ("alive_at", "asked_at", "number")

    def __init__(self, number: int, asked_at: float, alive_at: float) -> None:
        self.number = number
        self.asked_at = asked_at  # the loop's monotonic clock
        self.alive_at = alive_at  # the same moment on the wall clock, where the new lease starts


class LeaseKeeper:
    """Renews the lease from its own thread whenever the supervise loop asks."""

    def __init__(self, connect: Connect, *, stale_after: float) -> None:
        self._connect = connect
        self._stale_after = stale_after
        self.beat: Callable[[float], None] | None = None  # the local beat, set by the owner
        self._mutex = _thread.allocate_lock()  # guards every field below
        self._asked = 0
        self._answered = 0
        self._pending: _Request | None = None
        self._waited_for = 0  # the request `confirm` waits for: never dropped as stale
        self._stopping = False
        self._cancel: str | None = None
        self._failure: BaseException | None = None
        self._thread = RawThread(self._run)
        # the thread blocks reading `_work` until asked; `confirm` reads `_answers`
        self._work = os.eventfd(0, os.EFD_CLOEXEC)
        self._answers = os.eventfd(0, os.EFD_CLOEXEC)
        # made here, so the loop can watch it before the thread starts
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    # -- the supervise loop's side ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.started

    def fileno(self) -> int:
        """Readable once a cancel reason or a failure came back."""
        return self._wake

    def request(self) -> None:
        """Ask for a renewal as of now; replaces a request the thread has not taken yet."""
        self._ask(waiting=False)

    def confirm(self) -> str | None:
        """Ask for a renewal and wait for its answer: for a loop that was away long enough to
        have lost its lease, so that it hears from the store before it acts again."""
        number = self._ask(waiting=True)
        while True:
            with self._mutex:
                if self._answered >= number or self._failure is not None or self._stopping:
                    break
            await_event(self._answers)  # the thread answered something: look again
        return self.collect()

    def _ask(self, *, waiting: bool) -> int:
        with self._mutex:
            if self._stopping:  # closed or closing (the owner asks while it settles): no-op
                return self._asked
            self._asked += 1
            request = self._pending = _Request(self._asked, time.monotonic(), time.time())
            if waiting:
                self._waited_for = self._asked
            number = self._asked
        if self.beat is not None:
            self.beat(request.alive_at)  # never raises (local_beat.py)
        os.eventfd_write(self._work, 1)
        return number

    def on_wake(self) -> str | None:
        """The eventfd was readable: clear it, then `collect()`."""
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        return self.collect()

    def collect(self) -> str | None:
        """The first cancel reason a renewal brought back; a renewal's failure is raised here."""
        with self._mutex:
            if self._failure is not None:
                raise self._failure
            return self._cancel

    def stop(self) -> None:
        """No renewal is started after this (one in flight finishes); does not wait."""
        with self._mutex:
            self._stopping = True
            if self._work < 0:  # closed already
                return
        os.eventfd_write(self._work, 1)
        os.eventfd_write(self._answers, 1)

    def close(self) -> None:
        """Stop, wait for the thread, release the eventfds. Never raises: `collect()` does."""
        self.stop()
        self._thread.join()
        for name in ("_work", "_answers", "_wake"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """Connects at the first request, so that until then (the owner starts its command
        meanwhile) the thread holds nothing but a blocked read."""
        try:
            request = self._take()
            if request is None:
                return
            with self._connect() as renew:
                while request is not None:
                    reason = renew(request.alive_at) if self._fresh(request) else None
                    self._answer(request, reason)
                    request = self._take()
        except BaseException as exc:  # handed to the loop, which raises it: never swallowed
            with self._mutex:
                self._failure = exc
            os.eventfd_write(self._answers, 1)
            self._signal()

    def _take(self) -> _Request | None:
        while True:
            with self._mutex:
                if self._stopping:
                    return None
                if self._pending is not None:
                    request, self._pending = self._pending, None
                    return request
            await_event(self._work)  # blocks (without the GIL) until asked or stopped

    def _fresh(self, request: _Request) -> bool:
        with self._mutex:
            waited_for = self._waited_for == request.number
        return waited_for or time.monotonic() - request.asked_at <= self._stale_after

    def _answer(self, request: _Request, reason: str | None) -> None:
        with self._mutex:
            self._answered = request.number
            first_cancel = reason is not None and self._cancel is None
            if first_cancel:
                self._cancel = reason
        os.eventfd_write(self._answers, 1)
        if first_cancel:
            self._signal()

    def _signal(self) -> None:
        os.eventfd_write(self._wake, 1)
