"""The SQLite store's write gate: one flock beside the database that every writing process of
the home queues on, so that the kernel hands the write lock's turn to the next waiter when it is
let go. SQLite's own busy handler only sleeps and tries again (1 ms growing to 100 ms a try):
with 200 owners writing their receipts at once, its write lock sat idle while they slept.

Decides nothing: SQLite's lock still guards every transaction, and a writer without the gate
(none could be opened, or its wait ran out) writes as before, on the busy timeout. Bounded: a
writer waits for the gate at most `limit` seconds (a stopped holder keeps it), then goes on
without it, leaving its waiting thread to take the gate and let go at once. Released by the
kernel when its holder dies (the holder's descriptor closes) and closed in a forked child.
Must never: make a write correct or incorrect, or wait without a bound.
"""

from __future__ import annotations

import _thread
import contextlib
import fcntl
import os
from collections.abc import Iterator

from settled import nothreads
from settled.home import private_file

SUFFIX = "-gate"  # beside the database, as SQLite's -wal and -shm are


class _Open:
    """The gate descriptors open in this process: a forked child closes its copies, so that
    a child forked while a thread held the gate (a zygote) does not keep it held."""

    def __init__(self) -> None:
        self.fds: set[int] = set()
        self.lock = _thread.allocate_lock()

    def add(self, fd: int) -> None:
        with self.lock:
            self.fds.add(fd)

    def close(self, fd: int) -> None:
        with self.lock:
            self.fds.discard(fd)
        os.close(fd)

    def after_fork(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds, self.lock = set(), _thread.allocate_lock()


_OPEN = _Open()
os.register_at_fork(after_in_child=_OPEN.after_fork)


class _Wait:
    """A blocking flock in a thread of its own, which the writer waits for up to its limit."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.guard = _thread.allocate_lock()
        self.got = self.abandoned = False

    def run(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # without the GIL; woken at the release
            got = True
        except OSError:
            got = False
        with self.guard:
            if self.abandoned:  # the writer went on without it: let go at once
                _OPEN.close(self.fd)
                return
            self.got = got
        self.done.release()

    def wait(self, limit: float) -> bool:
        """Whether the gate was taken in time; if not, the descriptor is the thread's."""
        if self.done.acquire(True, limit):
            return self.got
        with self.guard:
            if self.got:  # taken just as the wait ran out
                return True
            self.abandoned = True
            return False


def make(path: str) -> None:
    """Create the gate of the database at `path` (0600), where this process can."""
    with contextlib.suppress(OSError):
        private_file(path + SUFFIX)


@contextlib.contextmanager
def held(path: str, limit: float) -> Iterator[bool]:
    """Hold the write gate of the database at `path` around a write transaction; yields
    whether it is held (False: the write goes on SQLite's lock alone)."""
    try:
        fd = os.open(path + SUFFIX, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # none made (a home this process cannot write): SQLite's lock alone
        yield False
        return
    _OPEN.add(fd)
    mine = True  # whether this writer closes the descriptor (else its abandoned wait does)
    try:
        got, mine = _take(fd, limit)
        yield got
    finally:
        if mine:
            _OPEN.close(fd)  # the close lets go of the gate


def _take(fd: int, limit: float) -> tuple[bool, bool]:
    """(taken, the descriptor is still the writer's)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True, True
    except BlockingIOError:
        pass
    except OSError:
        return False, True
    if limit <= 0:  # the writer's wait ran out already (in its own process's turn)
        return False, True
    if nothreads.refused() is not None:  # an owner whose command runs starts no thread
        return _poll(fd, limit), True
    waiting = _Wait(fd)
    try:
        _thread.start_new_thread(waiting.run, ())
    except RuntimeError:  # no thread here (an owner that unshared a PID namespace)
        return False, True
    got = waiting.wait(limit)
    return got, got


def _poll(fd: int, limit: float) -> bool:
    """The gate taken without a thread (settled.nothreads): tried again every 0.5 ms, growing
    to 5 ms, up to `limit`; no kernel hand-over, but no SQLite back-off of up to 100 ms."""
    import time

    give_up = time.monotonic() + limit
    pause = 0.0005
    while time.monotonic() < give_up:
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
        except OSError:
            return False
    return False
