"""The records every layer shares: what a task and a session are, as the store returns them.

Neutral ground: the store builds them, the pure decisions (`close/decide.py`, `status.py`) read
them, the faces render them, and none of those imports another to get the types. Frozen, so a
record is a fact as of one read, never a handle that changes under its reader.

Plain slotted classes, not dataclasses: every `settled status` imports this module, and
`dataclasses` brings `inspect` (and with it ast, dis, tokenize), which alone cost more than the
interpreter's own start (issue 15; tests/test_startup.py holds the line).
"""

from __future__ import annotations

from settled.states import is_live

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Self


class Frozen:
    """Equality, hashing and repr over `__slots__`, assignment refused after `__init__`."""

    __slots__: tuple[str, ...] = ()

    def _fill(self, values: dict[str, Any]) -> None:
        """Called by each `__init__` with its `locals()`: one place sets the fields."""
        for name in self.__slots__:
            object.__setattr__(self, name, values[name])

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot assign {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Frozen)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._values()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (what dataclasses.replace did)."""
        values = {name: getattr(self, name) for name in self.__slots__}
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)[0]!r}")
        values.update(changes)
        return type(self)(**values)


class OwnerInfo(Frozen):
    """Who owns a session: a pid is only the owner with the same start time on the same boot."""

    __slots__ = ("boot_id", "host", "lease_until", "pid", "start_time")
    pid: int
    start_time: int
    boot_id: str
    lease_until: float
    host: str | None  # the host it runs on; another host knows it by its lease only

    def __init__(
        self,
        pid: int,
        start_time: int,
        boot_id: str,
        lease_until: float,
        host: str | None = None,
    ) -> None:
        self._fill(locals())

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "pid": self.pid,
            "start_time": self.start_time,
            "boot_id": self.boot_id,
            "lease_until": self.lease_until,
        }


class OwnerFacts(Frozen):
    """What was observed of the recorded owner at the moment it asked."""

    __slots__ = ("alive", "lease_fresh", "process_alive", "why")
    alive: bool
    why: str | None
    lease_fresh: bool
    process_alive: bool  # the pid still runs with its start time (lease aside)

    def __init__(
        self, alive: bool, why: str | None, lease_fresh: bool, process_alive: bool = False
    ) -> None:
        self._fill(locals())


class LiveSession(Frozen):
    """A live session as recovery's look needs it (`Store.live_owners`): who owns it, from when,
    at which generation; not its spec, receipt or isolation, whose decoding was most of the
    look's cost when every new admission read every live session of its task in full."""

    __slots__ = ("created_at", "generation", "owner", "session", "state", "task")
    session: str
    task: str
    state: str
    generation: int
    owner: OwnerInfo | None
    created_at: float

    def __init__(
        self,
        session: str,
        task: str,
        state: str,
        generation: int,
        owner: OwnerInfo | None,
        created_at: float,
    ) -> None:
        self._fill(locals())

    @property
    def live(self) -> bool:
        return is_live(self.state)


class HostRecord(Frozen):
    """A home that runs owners: its id is the home's id, its name what the machine calls itself."""

    __slots__ = ("home", "host", "name", "registered_at", "vanished_at", "vanished_why")
    host: str
    name: str
    home: str
    registered_at: float
    vanished_at: float | None
    vanished_why: str | None

    def __init__(
        self,
        host: str,
        name: str,
        home: str,
        registered_at: float,
        vanished_at: float | None = None,
        vanished_why: str | None = None,
    ) -> None:
        self._fill(locals())

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class TaskRecord(Frozen):
    __slots__ = (
        "created_at",
        "defaults",
        "frozen",
        "generation",
        "host",
        "ignore_rules",
        "key",
        "sandbox",
        "shared_workspace",
        "state",
        "task",
        "user",
        "workspace",
        "workspace_identity",
    )
    task: str
    key: str
    workspace: str
    state: str
    generation: int
    created_at: float
    user: tuple[int, int] | None  # the task's default uid/gid for its commands
    # Asked for a workspace that overlaps another open task's (`--shared-workspace`): both
    # tasks' close receipts then name each other.
    shared_workspace: bool
    host: str | None  # the host whose owners run its sessions (None: before hosts)
    frozen: str | None  # why admission stopped for good (its host vanished)
    # What the task's sandbox provider made at `task new` (`provider`, its id, the `enter`
    # prefix of a command sandbox); None for a task made before sandboxes were recorded.
    sandbox: dict[str, Any] | None
    # The ignore rules bound at `task new` (workspace.ignore: patterns and their digest), read
    # once so a command cannot widen them; None for a task made before ignore rules.
    ignore_rules: dict[str, Any] | None
    # What each command of the task gets unless its exec says otherwise (`task new`): grants
    # (`writable`, `readable`: added to an exec's own) and limits (`memory`, `pids`, `cpus`:
    # an exec's own replaces them). None for a task made before task defaults.
    defaults: dict[str, Any] | None
    # The workspace root's identity recorded at `task new` (workspace/rootid.py): its `dev` and
    # `ino` and the `ancestors` that hold it, as [dev, ino] pairs. Every scan checks the root
    # is that directory; overlap is decided by it. None for a task made before identities.
    workspace_identity: dict[str, Any] | None

    def __init__(
        self,
        task: str,
        key: str,
        workspace: str,
        state: str,
        generation: int,
        created_at: float,
        user: tuple[int, int] | None = None,
        shared_workspace: bool = False,
        host: str | None = None,
        frozen: str | None = None,
        sandbox: dict[str, Any] | None = None,
        ignore_rules: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None,
        workspace_identity: dict[str, Any] | None = None,
    ) -> None:
        self._fill(locals())

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
            "defaults": self.defaults,
            "workspace_identity": self.workspace_identity,
        }


class SessionRecord(Frozen):
    __slots__ = (
        "boundary",
        "boundary_ref",
        "cancel_requested",
        "command_pid",
        "command_start_time",
        "created_at",
        "digest",
        "generation",
        "isolation",
        "key",
        "owner",
        "receipt",
        "session",
        "settled_at",
        "spec",
        "started_at",
        "state",
        "stderr_durable",
        "stdout_durable",
        "task",
        "unknown_why",
    )
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
    unknown_why: str | None
    isolation: dict[str, Any] | None  # the plan the command ran under, as recorded

    def __init__(
        self,
        session: str,
        task: str,
        key: str,
        digest: str,
        spec: dict[str, Any],
        state: str,
        generation: int,
        owner: OwnerInfo | None,
        boundary: str | None,
        boundary_ref: str | None,
        command_pid: int | None,
        command_start_time: int | None,
        stdout_durable: int,
        stderr_durable: int,
        cancel_requested: str | None,
        created_at: float,
        started_at: float | None,
        settled_at: float | None,
        receipt: dict[str, Any] | None,
        unknown_why: str | None = None,
        isolation: dict[str, Any] | None = None,
    ) -> None:
        self._fill(locals())

    @property
    def live(self) -> bool:
        """Its owner still acts for it (admitted, running, settling). Not live is settled or
        unknown: no owner will write for it again, which is not proof that nothing runs."""
        return is_live(self.state)
