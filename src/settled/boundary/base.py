"""The boundary contract: where a session's processes live and where death evidence comes from.

A boundary starts the command inside itself, can signal every member, and after a kill can say
whether it is provably empty. Evidence is what the kernel showed, never an inference from a pipe
closing or an exit code. Only the session owner holds a Boundary, but the launcher that claims
for it creates what lives outside the owner's process (`create`: a cgroup directory) before the
claim, so that the claim and the boundary's record are one write.

Imported on the owner's launch path, before its command runs: the standard library's os and
time only (no dataclasses, typing, signal or contextlib, ~8 ms of imports together here).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod

from settled.boundary import procfs
from settled.boundary.spawn import child_prepare, exec_in_child, fork_exec, read_spawn_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal
    from typing import ClassVar

    from settled.boundary.spawn import Launch


class Evidence:
    """What a boundary observed, and whether it proves that nothing of the session can run."""

    __slots__ = ("boundary", "evidence", "observed", "proven")

    def __init__(
        self,
        boundary: str,
        proven: bool,
        evidence: str | None,
        observed: dict[str, object] | None = None,
    ) -> None:
        self.boundary, self.proven, self.evidence = boundary, proven, evidence
        self.observed: dict[str, object] = {} if observed is None else observed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Evidence) and (
            (self.boundary, self.proven, self.evidence, self.observed)
            == (other.boundary, other.proven, other.evidence, other.observed)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return (
            f"Evidence(boundary={self.boundary!r}, proven={self.proven!r}, "
            f"evidence={self.evidence!r}, observed={self.observed!r})"
        )

    def to_json(self, source: str) -> dict[str, object]:
        return {
            "boundary": self.boundary,
            "proven": self.proven,
            "evidence": self.evidence,
            "source": source,
            "observed": self.observed,
        }


class Boundary(ABC):
    kind: ClassVar[str]
    hierarchy: str | None = None  # the cgroup v2 directory, for the kinds that have a cgroup

    def __init__(self, task: str, session: str) -> None:
        self.task, self.session = task, session
        self.main_pid: int | None = None
        self._main_status: int | None = None
        self._pidfd: int | None = None

    @property
    def ref(self) -> str | None:
        """What recovery needs to find this boundary again (a cgroup path, an init identity)."""
        return None

    def ref_before_start(self, owner_pid: int) -> str | None:
        """`ref` as recorded with the claim, before anything started, for the owner process
        `owner_pid` (the launcher that claims for an owner is another process)."""
        return self.ref

    def create(self) -> None:  # noqa: B027 - a hook; most boundaries make nothing outside
        """Make what lives outside the owner's process (a cgroup), before the claim that
        records it: run by the launcher, or by an owner that claims for itself."""

    def discard(self) -> None:  # noqa: B027 - a hook, like create
        """Undo `create` for a claim that was lost: nothing was started inside."""

    def setup(self) -> None:  # noqa: B027 - a hook; most boundaries need no setup
        """Set up the owner's own process (a subreaper, a PID namespace for its children),
        before the command exists."""

    def birth_cgroup(self) -> str | None:
        """The cgroup the command (or its namespace's init) must start in, or None."""
        return None

    def prepare_child(self, placed: bool) -> None:  # noqa: B027 - a hook; subreaper needs none
        """Runs in the child before exec. `placed`: the kernel started it inside
        `birth_cgroup()` (clone3); otherwise it joins that cgroup here, first."""

    def start(self, launch: Launch) -> int:
        if launch.placer is None:
            self.main_pid, self._pidfd = fork_exec(launch, self.prepare_child, self.birth_cgroup())
            return self.main_pid
        pid, errpipe_r, status_r = launch.placer.start()  # cloned for this boundary, waiting
        os.close(status_r)  # a PID namespace's init reports on it; this child execs
        failure = read_spawn_error(errpipe_r)
        if failure is not None:
            os.waitpid(pid, 0)
            raise failure
        self.main_pid, self._pidfd = pid, os.pidfd_open(pid)
        return self.main_pid

    def run_child(self, launch: Launch, errpipe: int, status: int, placed: bool) -> None:
        """The child's life, in the process cloned for it (never returns): its first steps
        (prepare_child), its view, privileges and exec. `status`: unused here (a PID
        namespace's init reports its command's status on it)."""
        exec_in_child(launch, errpipe, child_prepare(self.prepare_child, launch, placed))

    def placed_child(self) -> dict[str, bool]:
        """What a placer's clone of this boundary's child does (placer.py, which imports no
        boundary kind): `init`, the PID namespace's (pidns.run_init) or the command itself
        (spawn.exec_in_child); `setpgid`, its prepare_child once placed (only a process
        group's does anything then)."""
        return {"init": False, "setpgid": False}

    def exit_fd(self) -> int:
        """Readable once the main process has exited."""
        assert self._pidfd is not None
        return self._pidfd

    def empty_fd(self) -> int | None:
        """A descriptor readable once the boundary may have become empty, for the owner to
        wake on instead of its next look; None where only looking tells (the owner polls)."""
        return None

    def collect_main(self) -> int | None:
        """The main process's raw wait status once it exited; reaps only that pid."""
        if self._main_status is None and self.main_pid is not None:
            pid, status = os.waitpid(self.main_pid, os.WNOHANG)
            if pid == self.main_pid:
                self._main_status = status
        return self._main_status

    @abstractmethod
    def members(self) -> list[int]:
        """Live processes inside the boundary (the main process included while it lives)."""

    def signal_all(self, sig: signal.Signals | int) -> None:
        for pid in self.members():
            try:  # noqa: SIM105 - contextlib stays off the owner's launch path
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    @abstractmethod
    def kill_all(self) -> None:
        """SIGKILL everything inside, the way this boundary can make it final."""

    @abstractmethod
    def is_empty(self) -> bool:
        """Non-blocking: True only on the boundary's own evidence of emptiness."""

    @abstractmethod
    def evidence(self) -> Evidence:
        """Called once is_empty() held (or could not): what was observed."""

    def await_empty(self, timeout: float) -> bool:
        """Kill, and keep killing until the boundary reports empty or `timeout` passes."""
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            self.kill_all()
            if self.is_empty():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def teardown(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def describe_members(self) -> list[dict[str, object]]:
        """Every live member, named. One caught mid-exec has an empty cmdline for an instant
        and is still a member; one gone (or a zombie) while we looked is not left."""
        described = []
        for pid in self.members():
            entry = procfs.describe(pid)
            for _ in range(5):  # an exec finishes in microseconds
                if entry["cmdline"] or procfs.state_of(pid) in (None, "Z"):
                    break
                time.sleep(0.001)
                entry = procfs.describe(pid)
            if procfs.state_of(pid) not in (None, "Z"):
                described.append(entry if entry["cmdline"] else {**entry, "cmdline": "(exec)"})
        return described
