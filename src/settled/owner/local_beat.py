"""The owner's local beat: when its supervise loop last asked for a lease renewal, kept on its
own host beside the store's lease.

Why: the lease lives in the store, so an outage of the store longer than the lease lapses it
although the owner is alive and draining. On its own host the owner's liveness is also its
process (pid, start time, boot id: liveness.py), and this beat says the loop behind it still
runs: `LocalOwners` takes "process alive and local beat within its lease" for alive, so the
lapse of a lease during an outage is never the owner's undoing. A stuck or SIGSTOPped loop asks
for nothing, so its beat goes stale exactly as its lease does.

The file is ``<home>/run/beats/<pid>-<start time>`` (one line: boot id, the wall time the loop
asked, the lease in seconds), created at the loop's first request and rewritten in place
(pwrite, no fsync: a beat names nothing after a reboot) at each; the owner removes it when it
ends. The command never sees the home, so it cannot forge one. Another host never reads it: an
owner elsewhere is judged by its lease alone (liveness.HostedOwners).

Must never: raise into the supervise loop (a beat that cannot be written is simply not
there), or be read as alive for a process other than the one named (pid, start time, boot).
"""

from __future__ import annotations

import os

from settled.boundary import procfs
from settled.where import run_dir

TYPE_CHECKING = False  # written by the owner's loop thread: standard library only
if TYPE_CHECKING:
    from settled.records import OwnerInfo

SIZE = 128  # one line, rewritten in place and padded with spaces


def beat_path(home: str, pid: int, start_time: int) -> str:
    return os.path.join(run_dir(home), "beats", f"{pid}-{start_time}")


class LocalBeat:
    """This owner's beat file, opened at the first beat."""

    def __init__(self, home: str, lease_s: float) -> None:
        self.home, self.lease_s = home, lease_s
        self.path: str | None = None
        self._fd = -1

    def __call__(self, alive_at: float) -> None:
        """Record that the loop asked at `alive_at` (wall clock). Never raises."""
        try:
            if self._fd < 0:
                self._open()
            line = f"{procfs.boot_id()} {alive_at:.6f} {self.lease_s:.6f}"
            os.pwrite(self._fd, line.encode().ljust(SIZE), 0)
        except (OSError, ValueError):
            pass

    def _open(self) -> None:
        pid = os.getpid()
        start_time = procfs.start_time(pid)
        if start_time is None:
            raise ValueError("no start time for this process")
        path = beat_path(self.home, pid, start_time)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.path = path

    def close(self) -> None:
        """The owner ends: its beat goes (a liveness reader then relies on its lease alone)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.path is not None:
            try:  # noqa: SIM105 - contextlib stays off the owner's path
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None


def beat_fresh(home: str, owner: OwnerInfo, now: float) -> bool:
    """Whether the owner's local beat (of this boot) is within its lease at `now`."""
    try:
        with open(beat_path(home, owner.pid, owner.start_time), "rb") as handle:
            fields = handle.read(SIZE).split()
        boot, alive_at, lease_s = fields[0].decode(), float(fields[1]), float(fields[2])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return False
    return boot == owner.boot_id and alive_at + lease_s > now
