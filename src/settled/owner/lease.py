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
so a stuck or SIGSTOPped loop asks for nothing and its lease runs out as it always did.

What comes back, comes back to the loop: the first cancel reason, or the failure of a renewal
(StaleWrite when the session was fenced, or any other exception), makes `fileno()` (an eventfd the
loop selects on) readable, and `collect()` returns the reason or raises the failure in the loop's
thread, so it leaves the loop exactly as an inline renewal's exception did. `close()` stops the
thread and waits for it: it never outlives the supervisor.

The owner starts the keeper before it creates the boundary (a process that has unshared a PID
namespace for its children cannot start a thread), and the thread connects only at its first
request, so while the owner forks its command the thread holds nothing but a condition wait.

Must never: renew without a request from the loop, swallow a failure, or outlive `close()`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress

Renew = Callable[[float], str | None]  # renew a lease that runs from this wall time; cancel back
Connect = Callable[[], AbstractContextManager[Renew]]  # entered in the thread, so is its store

STALE_BEATS = 2  # a loop that has not asked for this many heartbeat periods may be stuck
HEARTBEATS_PER_LEASE = 5  # a starved owner has four renewals to spare


def lease_seconds() -> float:
    """The lease an owner holds (SETTLED_LEASE_S; tests shorten it), read when asked."""
    return float(os.environ.get("SETTLED_LEASE_S") or 15.0)


class _Request:
    """A plain class, not a dataclass: an owner whose thread must come before its command (no
    clone3 for a PID namespace) imports this on its launch path."""

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
        self._changed = threading.Condition()
        self._asked = 0
        self._answered = 0
        self._pending: _Request | None = None
        self._waited_for = 0  # the request `confirm` waits for: never dropped as stale
        self._stopping = False
        self._cancel: str | None = None
        self._failure: BaseException | None = None
        # made here, so the loop can watch it before the thread starts (the owner starts it
        # once its command is running, not before the loop's first look at the command)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="settled-lease")

    # -- the supervise loop's side ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

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
        with self._changed:
            self._changed.wait_for(
                lambda: self._answered >= number or self._failure is not None or self._stopping
            )
        return self.collect()

    def _ask(self, *, waiting: bool) -> int:
        with self._changed:
            self._asked += 1
            self._pending = _Request(self._asked, time.monotonic(), time.time())
            if waiting:
                self._waited_for = self._asked
            self._changed.notify_all()
            return self._asked

    def on_wake(self) -> str | None:
        """The eventfd was readable: clear it, then `collect()`."""
        with suppress(BlockingIOError):
            os.eventfd_read(self._wake)
        return self.collect()

    def collect(self) -> str | None:
        """The first cancel reason a renewal brought back; a renewal's failure is raised here."""
        with self._changed:
            if self._failure is not None:
                raise self._failure
            return self._cancel

    def stop(self) -> None:
        """No renewal is started after this (one in flight finishes); does not wait."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def close(self) -> None:
        """Stop, wait for the thread, release the eventfd. Never raises: `collect()` does."""
        self.stop()
        if self._thread.ident is not None:
            self._thread.join()
        if self._wake >= 0:
            os.close(self._wake)
            self._wake = -1

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """Connects at the first request, so that until then (the owner forks its command
        meanwhile) the thread holds nothing but a wait on its condition."""
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
            with self._changed:
                self._failure = exc
                self._changed.notify_all()
            self._signal()

    def _take(self) -> _Request | None:
        with self._changed:
            self._changed.wait_for(lambda: self._pending is not None or self._stopping)
            if self._stopping:
                return None
            request, self._pending = self._pending, None
            return request

    def _fresh(self, request: _Request) -> bool:
        with self._changed:
            waited_for = self._waited_for == request.number
        return waited_for or time.monotonic() - request.asked_at <= self._stale_after

    def _answer(self, request: _Request, reason: str | None) -> None:
        with self._changed:
            self._answered = request.number
            first_cancel = reason is not None and self._cancel is None
            if first_cancel:
                self._cancel = reason
            self._changed.notify_all()
        if first_cancel:
            self._signal()

    def _signal(self) -> None:
        os.eventfd_write(self._wake, 1)
