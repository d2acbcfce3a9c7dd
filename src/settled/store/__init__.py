"""The authority store: the one place state lives, and the only code that decides it.

Owns task and session records and every state change, each a compare-and-set on (state,
generation) through the transition table in `settled.states`. `Store` is the seam: the Runtime,
the owner, the close join, recovery and the workspace service depend on it and on nothing else of
this package (but the Runtime's pre-check, which asks `admission.key_verdict` as the stores
do); `open_store` is the one place an implementation is chosen. SQLite
(`store/sqlite.py`) is the embedded default; PostgreSQL (`store/postgres.py`) is shared by many
hosts; both are `store/sql.py`'s statements and method bodies over a dialect, and pass the same
contract tests (`tests/test_store.py` runs against the protocol).
Never touches processes, logs or the workspace.
"""

from __future__ import annotations

import json

from settled.records import HostRecord, LiveSession, OwnerInfo, SessionRecord, TaskRecord

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol
else:
    Protocol = object  # a protocol is the type checker's; at run time a plain base


class Store(Protocol):
    """Every method is atomic; every state change is conditional and raises StaleWrite if lost."""

    def create_task(
        self,
        key: str,
        workspace: str,
        user: tuple[int, int] | None = None,
        *,
        shared_workspace: bool = False,
        host: str | None = None,
        ignore_rules: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None,
        workspace_identity: dict[str, Any] | None = None,
    ) -> tuple[TaskRecord, bool]:
        """Returns (task, created); the task of an existing key as it is. Raises
        WorkspaceOverlap when `workspace` is, holds or lies in the workspace of a task not yet
        complete on the same `host` (by path, and by `workspace_identity` where both tasks
        recorded one: admission.workspaces_overlap), unless `shared_workspace`: then each of those
        tasks shares with this one. `host` binds the task to the host whose owners run it."""
        ...

    def register_host(self, host: str, name: str, home: str) -> HostRecord:
        """Record a home as a host (once; a later call returns the record as it is)."""
        ...

    def get_host(self, host: str) -> HostRecord | None: ...

    def hosts(self) -> list[HostRecord]:
        """Every recorded host, oldest first."""
        ...

    def vanish_host(self, host: str, why: str) -> list[str]:
        """Declare the host gone for good: every task of it not complete is frozen (admits
        nothing more, TaskFrozen). Returns the host's frozen tasks. UnknownHost if unrecorded."""
        ...

    def record_sandbox(self, task: str, facts: dict[str, Any]) -> TaskRecord:
        """Record what the task's sandbox provider made (once: StaleWrite if recorded)."""
        ...

    def workspace_shares(self, task: str) -> list[str]:
        """The tasks whose workspace this task shared (either one asked), in creation order."""
        ...

    def discard_task(self, task: str) -> bool:
        """Undo a creation that failed after `create_task`: delete the task if it is still
        as created (open, generation 1, no session, close step or checkpoint). Returns
        whether it was deleted; one that was used since is kept."""
        ...

    def workspaces(self) -> list[str]:
        """Every task's workspace (a session hides the others')."""
        ...

    def add_hidden_paths(self, paths: list[str]) -> None:
        """Paths no session may see from now on (a server's tokens file)."""
        ...

    def hidden_paths(self) -> list[str]: ...

    def get_task(self, task: str) -> TaskRecord: ...

    def list_tasks(self, limit: int = 1000) -> list[TaskRecord]:
        """The newest `limit` tasks of this store, newest first (`settled ls`); writes nothing."""
        ...

    def find_task(self, key: str) -> TaskRecord | None:
        """The task this key names, if any (a retried `task new`); writes nothing."""
        ...

    def admit(
        self, task: str, key: str, digest: str, spec: dict[str, Any]
    ) -> tuple[SessionRecord, bool]:
        """Returns (session, reused). Raises UnknownTask, KeyConflict, AdmissionSealed."""
        ...

    def get_session(self, session: str) -> SessionRecord: ...

    def find_session(self, task: str, key: str) -> SessionRecord | None: ...

    def list_sessions(self, task: str) -> list[SessionRecord]: ...

    def claim(
        self,
        session: str,
        generation: int,
        owner: OwnerInfo,
        *,
        boundary: str | None = None,
        boundary_ref: str | None = None,
        isolation: dict[str, Any] | None = None,
    ) -> SessionRecord:
        """admitted -> running with `owner`. With `boundary`, the boundary (and the isolation
        its command gets) is recorded in the same write: one durable commit before the
        command runs, where a claim and then `record_launch` were two."""
        ...

    def record_launch(
        self,
        session: str,
        generation: int,
        boundary: str,
        boundary_ref: str | None,
        command_pid: int | None,
        command_start_time: int | None,
        isolation: dict[str, Any] | None = None,
        *,
        durable: bool = True,
    ) -> None:
        """`durable=False` may skip the flush to disk (never the commit): for facts that
        mean nothing after a power cut, such as the command's pid."""
        ...

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

    def record_seal(self, session: str, stream: str, fact: dict[str, Any]) -> dict[str, Any]:
        """Record the sealed copy of a settled session's stream (`log/seal.py`'s fact with the
        stream's `length` and `digest`), once: a second recording returns the first. Refused
        (StaleWrite) unless the session is settled and `length` and `digest` are its receipt's
        (`receipts.seal_refusal`)."""
        ...

    def log_seals(self, task: str, session: str | None = None) -> dict[str, dict[str, Any]]:
        """The recorded seals of the task's sessions (or of `session`), by session, then stream."""
        ...

    def mark_unknown(self, session: str, generation: int, why: str) -> SessionRecord: ...

    def take_over(self, session: str, generation: int) -> int: ...

    def note_unknown(self, session: str, why: str) -> None: ...

    def unknown_sessions(self, task: str | None = None) -> list[SessionRecord]: ...

    def live_sessions(self, task: str | None = None) -> list[SessionRecord]: ...

    def live_owners(self, task: str | None = None) -> list[LiveSession]:
        """The sessions `live_sessions` returns, in its order, with only their owner, state,
        generation and admission time (recovery's look at every new admission)."""
        ...

    def task_event(self, task: str, event: str) -> TaskRecord:
        """A task transition (seal, close_begin, complete) through states.TASK_TRANSITIONS."""
        ...

    def record_close_step(
        self,
        task: str,
        step: str,
        fact: dict[str, Any],
        *,
        event: str | None = None,
        fence: int | None = None,
        durable: bool = True,
    ) -> dict[str, Any]:
        """Record a step's fact once; a second recording returns the first and changes nothing.
        ``event`` (a task transition) and ``fence`` (advance the generation past this one) are
        made in the same transaction as the fact, so a close crashed anywhere finds both or
        neither (one commit, one fsync, where there were two); ``StaleWrite`` if either is
        refused, and then nothing is recorded.

        ``durable=False``: committed (visible to every reader at once) without waiting for the
        disk. A power cut can lose it and any later such commit, never an earlier one (the
        write-ahead log is replayed as a prefix), and the next durable commit of the store makes
        it durable too. Losing the tail of a close's steps leaves the facts a crash after the
        last kept step leaves, which the close resumes from (decide.py); the close records its
        last step durably before it returns its receipt."""
        ...

    def close_steps(self, task: str) -> dict[str, dict[str, Any]]: ...

    def record_checkpoint(
        self, task: str, generation: int, receipt: dict[str, Any], index_ref: str | None
    ) -> None: ...

    def latest_checkpoint(self, task: str) -> tuple[dict[str, Any], str | None] | None: ...

    def fence(self, task: str, generation: int) -> int: ...

    def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
        """Block until a change of one of `topics` (session or task ids; "*": any) may have
        happened, or `seconds` pass. Spurious wakeups are allowed: the caller reads again
        either way. A store with notifications (PostgreSQL) wakes on them; one without sleeps."""
        ...

    def close(self) -> None: ...


def open_store(home: str, *, threads: bool = True) -> Store:
    """The store the home is bound to (`settled.backends`): its embedded SQLite database
    unless it was bound to another. `threads=False`: the calling process may start none (a
    PostgreSQL store then holds one connection, not a pool of worker threads)."""
    from settled.backends import connected, extra_needed, store_connection

    url, source = store_connection(home)  # the password, if any, in memory only
    if url.startswith("postgresql://"):
        with extra_needed(url):
            from settled.store.postgres import open_postgres  # psycopg loads only for it

        store = open_postgres(url, pooled=threads)
        connected(home, source)
        return store
    from settled.store.sqlite import open_sqlite  # the implementation stays behind the seam

    return open_sqlite(home, url.removeprefix("sqlite://"))


def load_implementation(home: str | None = None) -> bool:
    """Import what `open_store` will use, opening nothing. The zygote calls it once before it
    forks, so that no warm owner pays the import (5 ms here: sqlite3 and its module), and again
    with each `home` it serves: for a home bound to PostgreSQL, psycopg and its store (~0.14 s
    of CPU here). True when that imported anything beyond SQLite's."""
    import settled.store.sqlite

    if home is None:
        return False
    from settled.backends import bound_backends, extra_needed

    url = bound_backends(home).store
    if not url.startswith("postgresql://"):
        return False
    with extra_needed(url):
        import settled.store.postgres  # noqa: F401
    return True


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)
