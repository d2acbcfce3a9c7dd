"""The records every layer shares: what a task and a session are, as the store returns them.

Neutral ground: the store builds them, the pure decisions (`close/decide.py`, `status.py`) read
them, the faces render them, and none of those imports another to get the types. Frozen, so a
record is a fact as of one read, never a handle that changes under its reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from settled.states import is_live


@dataclass(frozen=True)
class OwnerInfo:
    """Who owns a session: a pid is only the owner with the same start time on the same boot."""

    pid: int
    start_time: int
    boot_id: str
    lease_until: float
    host: str | None = None  # the host it runs on; another host knows it by its lease only

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "pid": self.pid,
            "start_time": self.start_time,
            "boot_id": self.boot_id,
            "lease_until": self.lease_until,
        }


@dataclass(frozen=True)
class OwnerFacts:
    """What was observed of the recorded owner at the moment it asked."""

    alive: bool
    why: str | None
    lease_fresh: bool
    process_alive: bool = False  # the pid still runs with its start time (lease aside)


@dataclass(frozen=True)
class HostRecord:
    """A home that runs owners: its id is the home's id, its name what the machine calls itself."""

    host: str
    name: str
    home: str
    registered_at: float
    vanished_at: float | None = None
    vanished_why: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TaskRecord:
    task: str
    key: str
    workspace: str
    state: str
    generation: int
    created_at: float
    user: tuple[int, int] | None = None  # the task's default uid/gid for its commands
    # Asked for a workspace that overlaps another open task's (`--shared-workspace`): both
    # tasks' close receipts then name each other.
    shared_workspace: bool = False
    host: str | None = None  # the host whose owners run its sessions (None: before hosts)
    frozen: str | None = None  # why admission stopped for good (its host vanished)
    # What the task's sandbox provider made at `task new` (`provider`, its id, the `enter`
    # prefix of a command sandbox); None for a task made before sandboxes were recorded.
    sandbox: dict[str, Any] | None = None
    # The ignore rules bound at `task new` (workspace.ignore: patterns and their digest), read
    # once so a command cannot widen them; None for a task made before ignore rules.
    ignore_rules: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "frozen": self.frozen,
            "task": self.task,
            "key": self.key,
            "workspace": self.workspace,
            "state": self.state,
            "generation": self.generation,
            "created_at": self.created_at,
            "user": list(self.user) if self.user is not None else None,
            "shared_workspace": self.shared_workspace,
            "sandbox": self.sandbox,
            "ignore_rules": self.ignore_rules,
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

    @property
    def live(self) -> bool:
        """Its owner still acts for it (admitted, running, settling). Not live is settled or
        unknown: no owner will write for it again, which is not proof that nothing runs."""
        return is_live(self.state)
