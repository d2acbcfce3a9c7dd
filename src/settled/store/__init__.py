"""The authority store: the one place state lives, and the only code that decides it.

Owns task and session records and every state change, each a compare-and-set on (state,
generation) through the transition table in `settled.states`. SQLite is the embedded default;
PostgreSQL will satisfy the same `Store` protocol and run the same contract tests.
Never touches processes, logs or the workspace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class OwnerInfo:
    """Who owns a session: a pid is only the owner with the same start time on the same boot."""

    pid: int
    start_time: int
    boot_id: str
    lease_until: float

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            "boot_id": self.boot_id,
            "lease_until": self.lease_until,
        }


@dataclass(frozen=True)
class TaskRecord:
    task: str
    key: str
    workspace: str
    state: str
    generation: int
    created_at: float
    user: tuple[int, int] | None = None  # the task's default uid/gid for its commands

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "key": self.key,
            "workspace": self.workspace,
            "state": self.state,
            "generation": self.generation,
            "created_at": self.created_at,
            "user": list(self.user) if self.user is not None else None,
        }


@dataclass(frozen=True)
class SessionRecord:
    session: str
    task: str
    key: str
    digest: str
    spec: dict[str, Any]
    state: str
    generation: int
    owner: OwnerInfo | None
    boundary: str | None
    boundary_ref: str | None
    command_pid: int | None
    command_start_time: int | None
    stdout_durable: int
    stderr_durable: int
    cancel_requested: str | None
    created_at: float
    started_at: float | None
    settled_at: float | None
    receipt: dict[str, Any] | None
    unknown_why: str | None = None
    isolation: dict[str, Any] | None = None  # the plan the command ran under, as recorded


class Store(Protocol):
    """Every method is atomic; every state change is conditional and raises StaleWrite if lost."""

    def create_task(
        self, key: str, workspace: str, user: tuple[int, int] | None = None
    ) -> tuple[TaskRecord, bool]: ...

    def workspaces(self) -> list[str]:
        """Every task's workspace (a session hides the others')."""
        ...

    def add_hidden_paths(self, paths: list[str]) -> None:
        """Paths no session may see from now on (a server's tokens file)."""
        ...

    def hidden_paths(self) -> list[str]: ...

    def get_task(self, task: str) -> TaskRecord: ...

    def admit(
        self, task: str, key: str, digest: str, spec: dict[str, Any]
    ) -> tuple[SessionRecord, bool]:
        """Returns (session, reused). Raises UnknownTask, KeyConflict, AdmissionSealed."""
        ...

    def get_session(self, session: str) -> SessionRecord: ...

    def find_session(self, task: str, key: str) -> SessionRecord | None: ...

    def list_sessions(self, task: str) -> list[SessionRecord]: ...

    def claim(self, session: str, generation: int, owner: OwnerInfo) -> SessionRecord: ...

    def record_launch(
        self,
        session: str,
        generation: int,
        boundary: str,
        boundary_ref: str | None,
        command_pid: int | None,
        command_start_time: int | None,
        isolation: dict[str, Any] | None = None,
    ) -> None: ...

    def heartbeat(
        self, session: str, generation: int, lease_until: float, stdout: int, stderr: int
    ) -> str | None:
        """Renew the lease and publish durable cursors; returns a pending cancel reason."""
        ...

    def settle_begin(self, session: str, generation: int) -> None: ...

    def write_receipt(
        self, session: str, generation: int, receipt: dict[str, Any], event: str = "receipt"
    ) -> SessionRecord: ...

    def request_cancel(self, session: str, reason: str) -> SessionRecord: ...

    def mark_unknown(self, session: str, generation: int, why: str) -> SessionRecord: ...

    def take_over(self, session: str, generation: int) -> int: ...

    def note_unknown(self, session: str, why: str) -> None: ...

    def unknown_sessions(self, task: str | None = None) -> list[SessionRecord]: ...

    def live_sessions(self, task: str | None = None) -> list[SessionRecord]: ...

    def task_event(self, task: str, event: str) -> TaskRecord:
        """A task transition (seal, close_begin, complete) through states.TASK_TRANSITIONS."""
        ...

    def record_close_step(self, task: str, step: str, fact: dict[str, Any]) -> dict[str, Any]: ...

    def close_steps(self, task: str) -> dict[str, dict[str, Any]]: ...

    def record_checkpoint(
        self, task: str, generation: int, receipt: dict[str, Any], index_ref: str | None
    ) -> None: ...

    def latest_checkpoint(self, task: str) -> tuple[dict[str, Any], str | None] | None: ...

    def find_checkpoint(self, manifest: str) -> dict[str, Any] | None: ...

    def fence(self, task: str, generation: int) -> int: ...

    def close(self) -> None: ...


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)
