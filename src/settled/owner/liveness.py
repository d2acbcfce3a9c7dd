"""Is a session's recorded owner still there, and how to reach it: the owner side of liveness.

A pid alone names nothing: the owner is the process with the recorded pid, start time and boot
id, and it is alive for settled only while it also renews its lease. This module is the only
place outside the owner that reads /proc for an owner, holds a pidfd on one or signals it, so
that the Runtime, the close join and recovery ask questions and never touch processes.

`LocalOwners` answers for owners on this host. An owner that runs elsewhere (inside a remote
sandbox) has no pid here; its `Liveness` is a new module that answers from the lease alone.
"""

from __future__ import annotations

import contextlib
import os
import time

from settled.boundary import procfs
from settled.records import OwnerFacts, OwnerInfo


class LocalOwners:
    """Owners on this host, checked by pid + start time + boot id, and by their lease."""

    def facts(self, owner: OwnerInfo, now: float | None = None) -> OwnerFacts:
        now = time.time() if now is None else now
        lease_fresh = owner.lease_until > now
        if owner.boot_id != procfs.boot_id():
            return OwnerFacts(False, f"owner recorded on boot {owner.boot_id}", lease_fresh)
        seen = procfs.start_and_state(owner.pid)
        if seen is None or seen[0] != owner.start_time or seen[1] == "Z":
            return OwnerFacts(
                False, f"owner pid {owner.pid} is gone (or is another process now)", lease_fresh
            )
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
        """A pidfd that becomes readable when the owner exits, or None (gone, or pid reused).
        The caller closes it."""
        try:
            fd = os.pidfd_open(owner.pid)
        except OSError:
            return None
        if procfs.start_time(owner.pid) != owner.start_time:
            os.close(fd)  # the pid was reused: this is not the owner
            return None
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

    def __init__(self, host: str) -> None:
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

    def exit_handle(self, owner: OwnerInfo) -> int | None:
        return None if self._elsewhere(owner) else super().exit_handle(owner)

    def ask_to_cancel(self, owner: OwnerInfo) -> None:
        if not self._elsewhere(owner):
            super().ask_to_cancel(owner)
