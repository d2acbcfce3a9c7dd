"""Is a session's recorded owner still there, and how to reach it: the owner side of liveness.

A pid alone names nothing: the owner is the process with the recorded pid, start time and boot
id, and it is alive for settled only while it also renews its lease. This module is the only
place outside the owner that reads /proc for an owner, holds a pidfd on one or signals it, so
that the Runtime, the close join and recovery ask questions and never touch processes.

`LocalOwners` answers for owners on this host. An owner that runs elsewhere (inside a remote
sandbox) has no pid here; its `Liveness` is a new module that answers from the lease alone.
Given the home, an owner on this host whose lease lapsed is still alive while its process is
and its local beat (local_beat.py: when its loop last asked for a renewal) is within its lease:
the store was out, not the owner.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import time

from settled.boundary import procfs
from settled.owner import receipt_wake
from settled.owner.local_beat import beat_fresh
from settled.records import OwnerFacts, OwnerInfo

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

HELD_LIMIT = 4096  # pidfds one process keeps for owners seen alive; past it, /proc each time
HELD_SHARE = 4  # and never more than this share of the process's descriptors (RLIMIT_NOFILE)


def _held_limit() -> int:
    """A quarter of the descriptors this process may open, at most HELD_LIMIT: a server near
    its limit must not lose its sockets to pidfds, which only save reads of /proc."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return HELD_LIMIT if soft == resource.RLIM_INFINITY else min(HELD_LIMIT, soft // HELD_SHARE)


class _HeldOwners:
    """Pidfds of owners seen alive on this boot, kept for the next look: one `poll` then says
    which of them exited since (a pidfd is readable once its process has exited, zombies
    included), where a look at /proc reads one file per owner. Recovery looks over every live
    session of a task at every new admission; with 200 live sessions those reads were most of
    the look's time.

    A pidfd names one process for its whole life, never the pid's next user: it is kept only
    if, after `pidfd_open`, /proc shows the recorded start time and a state other than zombie.
    It is closed once readable. Shared by the process's threads (one lock: a descriptor is
    never closed while another thread polls it); a forked child drops its copies, so that no
    command forked without exec can hold (and signal) an owner's pidfd."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._fds: dict[tuple[int, int], int] = {}
        self._limit: int | None = None  # read at the first look, not at import

    def alive(self, owners: Sequence[OwnerInfo]) -> list[bool]:
        """For each owner (of this boot), whether its process is alive now: not exited and
        not a zombie. An owner that exits during the call may read either way, as with /proc;
        so may one whose main thread has exited while its other threads have not yet (/proc
        already reads it a zombie, its pidfd is readable once they are gone): a dying owner is
        found at the next look, and a live one is never read dead."""
        with self._lock:
            if self._limit is None:
                self._limit = _held_limit()
            self._drop_exited()
            return [self._alive(owner, self._limit) for owner in owners]

    def _drop_exited(self) -> None:
        import select

        if not self._fds:
            return
        poller = select.poll()
        named = {fd: key for key, fd in self._fds.items()}
        for fd in named:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(0):
            del self._fds[named[fd]]
            os.close(fd)

    def _alive(self, owner: OwnerInfo, limit: int) -> bool:
        key = (owner.pid, owner.start_time)
        if key in self._fds:
            return True  # held, and not readable at this call's poll
        try:
            fd = os.pidfd_open(owner.pid)
        except OSError:
            fd = None  # gone (ESRCH), or no pidfds here: /proc alone decides
        seen = procfs.start_and_state(owner.pid)
        alive = seen is not None and seen[0] == owner.start_time and seen[1] != "Z"
        if fd is not None:
            if alive and len(self._fds) < limit:
                self._fds[key] = fd
            else:
                os.close(fd)
        return alive

    def after_fork(self) -> None:
        """In a forked child: its copies are closed and forgotten (the lock may have been
        held by another thread of the parent at the fork)."""
        self._lock = _thread.allocate_lock()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}


HELD = _HeldOwners()
os.register_at_fork(after_in_child=HELD.after_fork)


class LocalOwners:
    """Owners on this host, checked by pid + start time + boot id, and by their lease (or,
    given the `home` they run for, their local beat)."""

    def __init__(self, home: str | None = None) -> None:
        self.home = home

    def facts(self, owner: OwnerInfo, now: float | None = None) -> OwnerFacts:
        now = time.time() if now is None else now
        if owner.boot_id != procfs.boot_id():
            return self._from_look(owner, None, now)
        seen = procfs.start_and_state(owner.pid)
        alive = seen is not None and seen[0] == owner.start_time and seen[1] != "Z"
        return self._from_look(owner, alive, now)

    def facts_many(self, owners: Sequence[OwnerInfo], now: float | None = None) -> list[OwnerFacts]:
        """`facts` of many owners at once, each as `facts` would answer, from one poll over
        the pidfds of owners already seen alive (`_HeldOwners`) and /proc only for the others.
        For recovery's look over every live session; a single status read asks `facts`."""
        now = time.time() if now is None else now
        boot = procfs.boot_id()
        here = [owner for owner in owners if owner.boot_id == boot]
        alive = dict(zip(map(id, here), HELD.alive(here), strict=True))
        return [self._from_look(owner, alive.get(id(owner)), now) for owner in owners]

    def _from_look(self, owner: OwnerInfo, alive: bool | None, now: float) -> OwnerFacts:
        """`facts`'s answer from a look already made (`alive` None: another boot's owner)."""
        lease_fresh = owner.lease_until > now
        if alive is None:
            return OwnerFacts(False, f"owner recorded on boot {owner.boot_id}", lease_fresh)
        if not alive:
            return OwnerFacts(
                False, f"owner pid {owner.pid} is gone (or is another process now)", lease_fresh
            )
        if not lease_fresh and self.home is not None and beat_fresh(self.home, owner, now):
            return OwnerFacts(True, None, False, process_alive=True)  # the store was out
        if not lease_fresh:
            return OwnerFacts(
                False,
                f"owner pid {owner.pid} has not renewed its lease for "
                f"{now - owner.lease_until:.1f} s (stopped, hung or starved)",
                False,
                process_alive=True,
            )
        return OwnerFacts(True, None, True, process_alive=True)

    def exit_handle(self, owner: OwnerInfo) -> int | None:
        """A handle that becomes readable when the owner has written its receipt (an owner
        this process launched: receipt_wake.py) or exits (a pidfd), or None (gone, or pid
        reused). The caller closes it."""
        try:
            fd = os.pidfd_open(owner.pid)
        except OSError:
            return None
        if procfs.start_time(owner.pid) != owner.start_time:
            os.close(fd)  # the pid was reused: this is not the owner
            return None
        early = receipt_wake.handle(owner.pid, owner.start_time)
        if early is not None:
            os.close(fd)
            return early
        return fd

    def await_exit(self, handle: int | None, seconds: float, also: int | None = None) -> bool:
        """Sleep up to `seconds`, waking at once if the owner behind `handle` exits or `also`
        (a follower's log watch) is readable; whether the owner has exited."""
        import select  # a waiter's, not every status reader's

        poller = select.poll()
        if handle is not None:
            poller.register(handle, select.POLLIN)
        if also is not None:
            poller.register(also, select.POLLIN)
        ready = poller.poll(max(0.0, seconds) * 1000.0)
        return handle is not None and any(fd == handle for fd, _ in ready)

    def close_handle(self, handle: int) -> None:
        os.close(handle)

    def ask_to_cancel(self, owner: OwnerInfo) -> None:
        """The owner reads the cancel request from the store when SIGUSR1 wakes it."""
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.kill(owner.pid, signal.SIGUSR1)


class HostedOwners(LocalOwners):
    """Owners of this host by their pid, owners of another host by their lease alone.

    A pid recorded on host A names nothing on host B (B's pid 4242 is some other process, and
    two containers may share a boot id), so an owner of another host is alive while its lease
    is fresh and never "gone" for a reason read on this host; no handle waits on it and no signal
    reaches it (it reads a cancel request at its next heartbeat)."""

    def __init__(self, host: str, home: str | None = None) -> None:
        super().__init__(home)
        self.host = host

    def _elsewhere(self, owner: OwnerInfo) -> bool:
        return owner.host is not None and owner.host != self.host

    def facts(self, owner: OwnerInfo, now: float | None = None) -> OwnerFacts:
        if not self._elsewhere(owner):
            return super().facts(owner, now)
        now = time.time() if now is None else now
        if owner.lease_until > now:
            return OwnerFacts(True, None, True, process_alive=True)
        return OwnerFacts(
            False,
            f"owner pid {owner.pid} on host {owner.host} has not renewed its lease for "
            f"{now - owner.lease_until:.1f} s (seen from host {self.host}, which cannot look "
            "at its process)",
            False,
            process_alive=True,  # unknowable from here: assume it may still write
        )

    def facts_many(self, owners: Sequence[OwnerInfo], now: float | None = None) -> list[OwnerFacts]:
        now = time.time() if now is None else now
        local = [owner for owner in owners if not self._elsewhere(owner)]
        looked = dict(zip(map(id, local), super().facts_many(local, now), strict=True))
        return [
            facts if (facts := looked.get(id(owner))) is not None else self.facts(owner, now)
            for owner in owners
        ]

    def exit_handle(self, owner: OwnerInfo) -> int | None:
        return None if self._elsewhere(owner) else super().exit_handle(owner)

    def ask_to_cancel(self, owner: OwnerInfo) -> None:
        if not self._elsewhere(owner):
            super().ask_to_cancel(owner)
