"""The boundary contract: where a session's processes live and where death evidence comes from.

A boundary starts the command inside itself, can signal every member, and after a kill can say
whether it is provably empty. Evidence is what the kernel showed, never an inference from a pipe
closing or an exit code. Only the session owner holds a Boundary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from settled.boundary import procfs
from settled.boundary.spawn import Launch, fork_exec


@dataclass
class Evidence:
    boundary: str
    proven: bool
    evidence: str | None
    observed: dict[str, object] = field(default_factory=dict)

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

    def __init__(self, task: str, session: str) -> None:
        self.task, self.session = task, session
        self.main_pid: int | None = None
        self._main_status: int | None = None
        self._pidfd: int | None = None

    @property
    def ref(self) -> str | None:
        """What recovery needs to find this boundary again (a cgroup path, an init identity)."""
        return None

    def setup(self) -> None:  # noqa: B027 - a hook; most boundaries need no setup
        """Create the boundary in the owner, before the command exists."""

    def prepare_child(self) -> None:  # noqa: B027 - a hook; subreaper needs none
        """Runs in the forked child before exec: join the boundary."""

    def start(self, launch: Launch) -> int:
        self.main_pid = fork_exec(launch, self.prepare_child)
        self._pidfd = os.pidfd_open(self.main_pid)
        return self.main_pid

    def exit_fd(self) -> int:
        """Readable once the main process has exited."""
        assert self._pidfd is not None
        return self._pidfd

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

    def signal_all(self, sig: signal.Signals) -> None:
        for pid in self.members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

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
