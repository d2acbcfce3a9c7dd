"""Wake a waiter in the launching process when its owner has written the receipt, not ~1 ms
later when the owner's process has exited.

Why: a waiter (`Runtime.wait`, the service's long poll, `settled run`) slept on the owner's
pidfd, which becomes readable only once the owner's address space is torn down (~1 ms for a
zygote's fork here, `bench/receipt.py`), after the receipt was committed.

How: the owner keeps its end of the readiness pipe after it reported that its command runs,
and closes it right after its receipt is committed; its death closes it too (the kernel closes
every descriptor of a process that dies, and its command never holds one: the boundary closes
them all before the exec). The launcher keeps the read end here, by the owner's pid and start
time, instead of closing it, so it reads EOF at that moment. `LocalOwners.exit_handle` hands a
waiter a duplicate of it for an owner this process launched, and the owner's pidfd otherwise;
both stay readable once they fire, so no wake-up is lost to a waiter that looks late.

The pipe is a hint, as the pidfd was: a waiter that wakes reads the receipt from the store.
Ends that fired are closed at the next launch; past `HELD_LIMIT` the oldest are let go, and
their waiters sleep on the pidfd. Must never: hand out an end for an owner that is not the one
recorded (pid and start time), or keep an end in a forked child.
"""

from __future__ import annotations

import os
import select
import threading

from settled.boundary import procfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HELD_LIMIT = 1024  # read ends kept (one per live session this process launched)

_lock = threading.Lock()
_held: dict[tuple[int, int], int] = {}  # (owner pid, owner start time) -> read end


def keep(owner_pid: int, ready_r: int) -> None:
    """Keep `ready_r` (the launcher's end of `owner_pid`'s readiness pipe, after its command
    runs) until the owner closes its end; takes ownership of the descriptor."""
    start_time = procfs.start_time(owner_pid)
    if start_time is None:  # the owner is gone already: nothing to wait for
        os.close(ready_r)
        return
    with _lock:
        _close_fired()
        while len(_held) >= HELD_LIMIT:
            os.close(_held.pop(next(iter(_held))))
        old = _held.pop((owner_pid, start_time), None)
        if old is not None:
            os.close(old)
        _held[(owner_pid, start_time)] = ready_r


def kept_after(report: dict[str, Any], ready_r: int) -> int:
    """After a launch (`report`: hand_over's): the read end kept for an owner whose command
    runs (-1 returned: it is this module's now), else `ready_r`, the caller's to close."""
    if report.get("state") != "running":
        return ready_r
    keep(int(report["owner_pid"]), ready_r)
    return -1


def handle(owner_pid: int, start_time: int | None) -> int | None:
    """A new descriptor that becomes readable once that owner wrote its receipt (or died), or
    None when this process did not launch it or lets it go. The caller closes it."""
    if start_time is None:
        return None
    with _lock:
        kept = _held.get((owner_pid, start_time))
        return None if kept is None else os.dup(kept)


def _close_fired() -> None:
    """Close the ends whose owner has closed its own (EOF, or an error line it left)."""
    if not _held:
        return
    poller = select.poll()
    owners = {fd: key for key, fd in _held.items()}
    for fd in owners:
        poller.register(fd, select.POLLIN)
    for fd, _events in poller.poll(0):
        del _held[owners[fd]]
        os.close(fd)


def _forget_in_child() -> None:
    """A forked child launched none of these owners: its copies are closed."""
    global _lock
    for fd in _held.values():
        os.close(fd)
    _held.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
