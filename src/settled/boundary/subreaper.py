"""Subreaper boundary: the owner is a child subreaper, so orphans (setsid, double fork) come home.

Evidence: every descendant killed and reaped, `waitid` answering ECHILD and no live process whose
parent chain reaches the owner. Never reaps with a blanket wait that could take the main child's
status: it peeks with WNOWAIT and reaps by pid, stashing the main status when it sees it.
"""

from __future__ import annotations

import os

from settled.boundary import procfs, unavailable
from settled.boundary.base import Boundary, Evidence

TYPE_CHECKING = False  # on the owner's launch path: no typing, signal or contextlib imports
if TYPE_CHECKING:
    from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36
SIGKILL = 9  # signal.SIGKILL, the same on every Linux architecture


def become_subreaper() -> None:
    from settled.boundary import linux  # late: ctypes only where a subreaper is used

    try:
        linux.prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError as exc:
        raise unavailable(f"subreaper: {exc.strerror}") from None


def reap_orphans(
    main_pid: int | None, collect_main: Callable[[], object], reaped: list[int] | None = None
) -> bool:
    """Reap every exited child by pid (appended to `reaped`), keeping the main child's status
    for `collect_main` (a blanket wait would steal it); True once waitid answers ECHILD."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        if info is None:
            return False
        if info.si_pid == main_pid:
            collect_main()
            if main_pid is not None and procfs.state_of(main_pid) == "Z":
                return False  # collect_main could not take it yet: it stays for the owner
        else:
            os.waitpid(info.si_pid, 0)
            if reaped is not None:
                reaped.append(info.si_pid)


class EscapeWitness:
    """The owner as a child subreaper behind a cgroup that a process could leave (no cgroup
    namespace, or a command that kept CAP_SYS_ADMIN): a process that moved itself to another
    cgroup is still the owner's descendant, so it is found, named, killed and reaped, and the
    receipt proves death only once no descendant is left."""

    def __init__(self) -> None:
        self.escaped: list[dict[str, object]] = []

    def setup(self) -> None:
        become_subreaper()

    def sweep(self, main_pid: int | None, collect_main: Callable[[], object]) -> bool:
        """Kill every live descendant; True when none is left alive."""
        reap_orphans(main_pid, collect_main)
        live = procfs.live_descendants(os.getpid())
        for pid in live:
            if not any(e["pid"] == pid for e in self.escaped):
                self.escaped.append(
                    {**procfs.describe(pid), "cgroup": procfs.cgroup_of(pid), "stopped_by": "KILL"}
                )
            try:  # noqa: SIM105 - contextlib stays off the owner's launch path
                os.kill(pid, SIGKILL)
            except ProcessLookupError:
                pass
        return not live


class SubreaperBoundary(Boundary):
    kind = "subreaper"

    def __init__(self, task: str, session: str) -> None:
        super().__init__(task, session)
        self.reaped: list[int] = []
        self._echild = False

    @property
    def ref(self) -> str:
        return f"subreaper:{os.getpid()}"

    def ref_before_start(self, owner_pid: int) -> str:
        return f"subreaper:{owner_pid}"

    def setup(self) -> None:
        become_subreaper()

    def members(self) -> list[int]:
        return procfs.live_descendants(os.getpid())

    def kill_all(self) -> None:
        self.signal_all(SIGKILL)

    def _reap_available(self) -> None:
        """Reap every exited child by pid; the main child's status is kept, not lost."""
        if reap_orphans(self.main_pid, self.collect_main, self.reaped):
            self._echild = True

    def collect_main(self) -> int | None:
        if self._main_status is None and self.main_pid is not None:
            try:
                pid, status = os.waitpid(self.main_pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == self.main_pid:
                self._main_status = status
        return self._main_status

    def is_empty(self) -> bool:
        self._reap_available()
        return self._echild and not procfs.descendants(os.getpid())

    def evidence(self) -> Evidence:
        proven = self.is_empty()
        text = (
            f"subreaper {os.getpid()} reaped {len(self.reaped)} orphan(s); waitid ECHILD; "
            "no descendant in /proc"
            if proven
            else None
        )
        observed: dict[str, object] = {
            "subreaper": os.getpid(),
            "reaped_orphans": self.reaped[:100],
            "waitid": "ECHILD" if self._echild else "children remain",
            "live_descendants": len(procfs.descendants(os.getpid())),
        }
        return Evidence(self.kind, proven, text, observed)
