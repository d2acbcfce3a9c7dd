"""A thread whose end can be waited for, started with `_thread` alone.

Why: an owner starts its threads (its first drain, its lease keeper, its log flusher) on its
launch path, before its command, where `threading` costs an import and a handshake with each
new thread; and each of them must be joined before the owner reports. A lock held while the
thread runs is its join. Written once here for the three.

Also the wait such a thread blocks in, `await_event`: an eventfd read that a handled signal does
not end. The owner's TERM and USR1 are sent to the process, so the kernel may hand them to any
of its threads (after a stop and a continue, to whichever runs first), and `os.eventfd_read`,
unlike `os.read`, raises InterruptedError then instead of reading again.

Standard library only. Must never start a thread the caller did not ask for, or return from
`join` before the thread's target has ended.
"""

from __future__ import annotations

import _thread
import os
from collections.abc import Callable


def await_event(fd: int) -> int:
    """Block until the eventfd `fd` is non-zero, read (and so clear) it; retried after EINTR
    (the signal's handler has run: its wake-up is the main loop's to see)."""
    while True:
        try:
            return os.eventfd_read(fd)
        except InterruptedError:
            continue


class RawThread:
    """`target` in a thread of its own once `start` is called; `join` returns once it ended
    (at once when it never started)."""

    __slots__ = ("_done", "_target", "started")

    def __init__(self, target: Callable[[], None]) -> None:
        self._target = target
        self._done = _thread.allocate_lock()  # held while the thread runs
        self.started = False

    def start(self) -> None:
        """Start the thread (once); what `_thread` raises (no task for it) is the caller's."""
        if self.started:
            return
        self._done.acquire()
        try:
            _thread.start_new_thread(self._main, ())
        except BaseException:
            self._done.release()
            raise
        self.started = True

    def join(self) -> None:
        if self.started:
            self._done.acquire()  # the thread ended
            self._done.release()

    def _main(self) -> None:
        try:
            self._target()
        finally:
            self._done.release()
