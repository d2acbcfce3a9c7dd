"""SQLite implementation of the authority store (the embedded default).

WAL journal, `synchronous=FULL` (a receipt that was acknowledged survives power loss), and every
write in `BEGIN IMMEDIATE`: a writer takes the write lock before it reads, so concurrent owners
queue on the busy timeout instead of failing with `database is locked` on a stale snapshot.
Writers queue in two places before it, both only to be woken when it is their turn, never to
decide: the threads of one process on an in-process lock per database (`_Turns`), then the
processes of the home on its write gate (`store/gate.py`, a flock the kernel hands over at
release). SQLite's busy handler only sleeps and tries again (1 ms growing to 100 ms a try): with
48 threads of a caller and 200 owners each sleeping there, the write lock sat idle while its
waiters slept. Each wait is bounded (by the busy timeout, together), after which the writer goes
to SQLite's lock as before; a process cannot hold another's turn, the kernel drops the gate of a
holder that dies, and SQLite's lock still guards every transaction.
Never touches processes, logs or the workspace.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

from settled.canonical import canonical_bytes
from settled.errors import (
    HomeUnusable,
    StaleWrite,
    StorageFailed,
    UnknownHost,
    UnknownSession,
    UnknownTask,
)
from settled.home import (
    check_store_present,
    home_id_path,
    private_file,
    read_home_id,
    write_home_id_once,
)
from settled.identity import new_id
from settled.localdb import BUSY_TIMEOUT_S, disk_error, enable_wal
from settled.receipts import checked
from settled.records import HostRecord, LiveSession, OwnerInfo, SessionRecord, TaskRecord
from settled.states import (
    ADMITTED,
    TASK_COMPLETE,
    TASK_OPEN,
    IllegalTransition,
    next_session_state,
    next_task_state,
    states_accepting,
)
from settled.store import gate, loads, schema
from settled.store.admission import (
    REUSE,
    admission_verdict,
    creation_verdict,
    enforce,
    key_verdict,
    overlapping,
)
from settled.store.dialect import SQLITE
from settled.store.rows import (
    HOST_COLUMNS,
    LIVE_COLUMNS,
    RECEIPT_EVENTS,
    SESSION_COLUMNS,
    HiddenSets,
    checked_fact,
    fact_digest,
    host_from_row,
    live_from_row,
    session_from_row,
    stored_isolation,
    stored_receipt,
    task_from_row,
)
from settled.store.schema import SCHEMA_VERSION, refuse_newer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.store.rows import HiddenSet

TASK_COLUMNS = (
    "task, key, workspace, state, generation, created_at, user, shared_workspace, host, frozen, "
    "sandbox, ignore_rules, defaults, workspace_identity"
)


def _launch_sets(
    boundary: str | None, boundary_ref: str | None, isolation: dict[str, Any] | None
) -> tuple[dict[str, Any], HiddenSet | None]:
    """The boundary's columns a claim records with the owner (none when it names no boundary),
    and the hidden set its isolation names, to store in the same transaction."""
    if boundary is None:
        return {}, None
    sets: dict[str, Any] = {"boundary": boundary, "boundary_ref": boundary_ref}
    if isolation is None:
        return sets, None
    sets["isolation"], hidden_set = stored_isolation(isolation)
    return sets, hidden_set


def _store_hidden(db: sqlite3.Connection, hidden_set: HiddenSet | None) -> None:
    """Once per distinct list: every later session that hides the same directories names it."""
    if hidden_set is not None:
        db.execute("INSERT OR IGNORE INTO hidden_sets(digest, dirs) VALUES(?, ?)", hidden_set)


class _Turns:
    """One lock per database file for the writers of this process (the module's docstring).
    A forked child starts with none held: the thread that held one in the parent is not in it."""

    def __init__(self) -> None:
        self.after_fork()

    def of(self, path: str) -> _thread.LockType:
        with self._lock:
            turn = self._turns.get(path)
            if turn is None:
                turn = self._turns[path] = _thread.allocate_lock()
            return turn

    def after_fork(self) -> None:
        self._lock = _thread.allocate_lock()
        self._turns: dict[str, _thread.LockType] = {}


_TURNS = _Turns()
os.register_at_fork(after_in_child=_TURNS.after_fork)


class SQLiteStore:
    """One connection per instance; one instance per process (owners open their own)."""

    def __init__(self, path: str, home: str | None = None) -> None:
        self.path = path
        self.home = home or os.path.dirname(path)
        self._turn_key = os.path.realpath(path)  # one turn for every name of the file
        self._hidden_sets = HiddenSets(self._hidden_set)
        check_store_present(self.home)  # never a fresh store beside another one's logs
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        gate.make(path)
        try:
            self._db = sqlite3.connect(
                private_file(path), timeout=BUSY_TIMEOUT_S, isolation_level=None
            )
            self._enable_wal()
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            if os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.home):
                self._check_identity()  # a store outside the home is shared by many homes
        except (sqlite3.Error, HomeUnusable, StorageFailed) as exc:
            with contextlib.suppress(AttributeError, sqlite3.Error):
                self._db.close()
            if isinstance(exc, HomeUnusable | StorageFailed):
                raise
            typed = disk_error(exc, path, "opening the store")  # a full disk is not a bad home
            if typed is not None:
                raise typed from exc
            raise HomeUnusable(f"cannot open the store at {path}: {exc}") from exc

    def close(self) -> None:
        self._db.close()

    def _hidden_set(self, digest: str) -> str | None:
        row = self._db.execute("SELECT dirs FROM hidden_sets WHERE digest=?", (digest,)).fetchone()
        return None if row is None else str(row[0])

    def _enable_wal(self) -> None:
        enable_wal(self._db, self.path)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction. A full or failing disk ("database or disk is full", an I/O
        error) is the typed SpaceExhausted / StorageFailed naming the store, never a bare
        sqlite3 error; the transaction is rolled back if SQLite did not already. Begun in
        this process's turn for the database (`_Turns`) and behind the home's write gate
        (`store/gate.py`). The busy timeout bounds the whole wait, as it did SQLite's alone:
        a writer without the gate waits on SQLite's lock only for what is left of it."""
        give_up = time.monotonic() + BUSY_TIMEOUT_S
        turn = _TURNS.of(self._turn_key)
        held = turn.acquire(True, BUSY_TIMEOUT_S)
        try:
            left = max(0.0, give_up - time.monotonic())
            with (
                gate.held(self.path, left) as gated,
                self._busy_until(None if gated else give_up),
                self._transaction() as db,
            ):
                yield db
        finally:
            if held:
                turn.release()

    @contextmanager
    def _busy_until(self, give_up: float | None) -> Iterator[None]:
        """SQLite's busy timeout cut to what is left before `give_up` (None: left as it is)."""
        if give_up is None:
            yield
            return
        left_ms = int(max(0.0, give_up - time.monotonic()) * 1000)
        self._db.execute(f"PRAGMA busy_timeout={left_ms}")
        try:
            yield
        finally:
            self._db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
        except sqlite3.DatabaseError as exc:
            typed = disk_error(exc, self.path)
            if typed is None:
                raise
            raise typed from exc

    def _migrate(self) -> None:
        if self._schema_version() == SCHEMA_VERSION:
            return  # every open after the first: a read, no write transaction to queue for
        with self._write() as db:
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            version = int(row[0]) if row else 0
            refuse_newer(version, self.path, "--home")
            schema.apply(SQLITE, db.execute, version)

    def _schema_version(self) -> int | None:
        try:
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.OperationalError:  # no meta table: a store never migrated
            return None
        return int(row[0]) if row else None

    def _check_identity(self) -> None:
        """The store and home.id name one home. The first open records the id in both (the
        store first, so a home.id never exists without its store); a lost home.id is written
        again from the store, a store an older settled made takes home.id's; a store whose id
        is another home's is refused naming both."""
        file_id = read_home_id(self.home)
        row = self._db.execute("SELECT value FROM meta WHERE key='home_id'").fetchone()
        if row is not None and row[0] == file_id:
            return  # both name this home: nothing to write (an owner opens two stores)
        with self._write() as db:
            row = db.execute("SELECT value FROM meta WHERE key='home_id'").fetchone()
            store_id = row[0] if row else None
            if store_id is None:
                store_id = file_id or new_id("h")
                db.execute("INSERT INTO meta(key, value) VALUES('home_id', ?)", (store_id,))
            if file_id is None:
                file_id = write_home_id_once(self.home, store_id)
            if file_id != store_id:
                raise HomeUnusable(
                    f"the store {self.path} belongs to home {store_id}, but this home is "
                    f"{file_id} ({home_id_path(self.home)}): it was copied from another home; "
                    "put back this home's own store, or move the home away"
                )

    # -- tasks ---------------------------------------------------------------------------

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
        with self._write() as db:  # the overlap is decided in the transaction that records
            row = db.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE key=?", (key,)).fetchone()
            if row:
                return task_from_row(row), False
            others = overlapping(
                workspace,
                workspace_identity,
                (  # one host's: not another's paths
                    (task, path, loads(identity))
                    for task, path, identity in db.execute(
                        "SELECT task, workspace, workspace_identity FROM tasks WHERE state != ? "
                        "AND (host IS NULL OR ? IS NULL OR host = ?) ORDER BY created_at",
                        (TASK_COMPLETE, host, host),
                    )
                ),
            )
            enforce(creation_verdict(workspace, others, shared_workspace))
            record = TaskRecord(
                new_id("t"), key, workspace, TASK_OPEN, 1, time.time(), user, shared_workspace,
                host=host, ignore_rules=ignore_rules, defaults=defaults,
                workspace_identity=workspace_identity,
            )  # fmt: skip
            db.execute(
                f"INSERT INTO tasks ({TASK_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, ?, ?)",
                (
                    record.task,
                    key,
                    workspace,
                    record.state,
                    1,
                    record.created_at,
                    json.dumps(list(user)) if user is not None else None,
                    int(shared_workspace),
                    host,
                    json.dumps(ignore_rules) if ignore_rules is not None else None,
                    json.dumps(defaults) if defaults is not None else None,
                    json.dumps(workspace_identity) if workspace_identity is not None else None,
                ),
            )
            for other, _path in others:  # each names the other in its close receipt
                db.executemany(
                    "INSERT OR IGNORE INTO workspace_shares VALUES (?, ?, ?)",
                    [
                        (record.task, other, record.created_at),
                        (other, record.task, record.created_at),
                    ],
                )
            return record, True

    def discard_task(self, task: str) -> bool:
        with self._write() as db:
            deleted = db.execute(
                "DELETE FROM tasks WHERE task=? AND state=? AND generation=1"
                " AND NOT EXISTS (SELECT 1 FROM sessions WHERE sessions.task=tasks.task)"
                " AND NOT EXISTS (SELECT 1 FROM close_steps WHERE close_steps.task=tasks.task)"
                " AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE checkpoints.task=tasks.task)",
                (task, TASK_OPEN),
            )
            if deleted.rowcount != 1:
                return False
            db.execute("DELETE FROM workspace_shares WHERE task=? OR other=?", (task, task))
            return True

    def record_sandbox(self, task: str, facts: dict[str, Any]) -> TaskRecord:
        with self._write() as db:
            done = db.execute(
                "UPDATE tasks SET sandbox=? WHERE task=? AND sandbox IS NULL",
                (json.dumps(facts, sort_keys=True), task),
            )
            row = db.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE task=?", (task,)).fetchone()
            if row is None:
                raise UnknownTask(task)
            if done.rowcount != 1:
                raise StaleWrite(f"task {task} has its sandbox recorded already")
            return task_from_row(row)

    def workspace_shares(self, task: str) -> list[str]:
        rows = self._db.execute(
            "SELECT other FROM workspace_shares WHERE task=? ORDER BY created_at, other", (task,)
        ).fetchall()
        return [r[0] for r in rows]

    def get_task(self, task: str) -> TaskRecord:
        row = self._db.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE task=?", (task,)).fetchone()
        if row is None:
            raise UnknownTask(task)
        return task_from_row(row)

    def list_tasks(self, limit: int = 1000) -> list[TaskRecord]:
        rows = self._db.execute(
            f"SELECT {TASK_COLUMNS} FROM tasks ORDER BY created_at DESC, task LIMIT ?", (limit,)
        ).fetchall()
        return [task_from_row(r) for r in rows]

    def find_task(self, key: str) -> TaskRecord | None:
        row = self._db.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE key=?", (key,)).fetchone()
        return None if row is None else task_from_row(row)

    def workspaces(self) -> list[str]:
        rows = self._db.execute("SELECT DISTINCT workspace FROM tasks").fetchall()
        return [r[0] for r in rows]

    def add_hidden_paths(self, paths: list[str]) -> None:
        with self._write() as db:
            row = db.execute("SELECT value FROM meta WHERE key='hidden_paths'").fetchone()
            known = set(json.loads(row[0])) if row else set()
            if known >= set(paths):
                return
            db.execute(
                "INSERT INTO meta(key, value) VALUES('hidden_paths', ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (json.dumps(sorted(known | set(paths))),),
            )

    def hidden_paths(self) -> list[str]:
        row = self._db.execute("SELECT value FROM meta WHERE key='hidden_paths'").fetchone()
        return list(json.loads(row[0])) if row else []

    # -- hosts ---------------------------------------------------------------------------

    def register_host(self, host: str, name: str, home: str) -> HostRecord:
        found = self.get_host(host)
        if found is not None:  # an open writes nothing once registered (a full disk)
            return found
        with self._write() as db:
            db.execute(
                "INSERT OR IGNORE INTO hosts (host, name, home, registered_at) VALUES (?, ?, ?, ?)",
                (host, name, home, time.time()),
            )
            row = db.execute(f"SELECT {HOST_COLUMNS} FROM hosts WHERE host=?", (host,)).fetchone()
            return host_from_row(row)

    def get_host(self, host: str) -> HostRecord | None:
        row = self._db.execute(f"SELECT {HOST_COLUMNS} FROM hosts WHERE host=?", (host,)).fetchone()
        return None if row is None else host_from_row(row)

    def hosts(self) -> list[HostRecord]:
        rows = self._db.execute(
            f"SELECT {HOST_COLUMNS} FROM hosts ORDER BY registered_at, host"
        ).fetchall()
        return [host_from_row(r) for r in rows]

    def vanish_host(self, host: str, why: str) -> list[str]:
        with self._write() as db:
            if db.execute("SELECT 1 FROM hosts WHERE host=?", (host,)).fetchone() is None:
                raise UnknownHost(host)
            db.execute(
                "UPDATE hosts SET vanished_at=?, vanished_why=? "
                "WHERE host=? AND vanished_at IS NULL",
                (time.time(), why, host),
            )
            db.execute(
                "UPDATE tasks SET frozen=? WHERE host=? AND frozen IS NULL AND state != ?",
                (why, host, TASK_COMPLETE),
            )
            rows = db.execute(
                "SELECT task FROM tasks WHERE host=? AND frozen IS NOT NULL ORDER BY created_at",
                (host,),
            ).fetchall()
            return [r[0] for r in rows]

    # -- sessions ------------------------------------------------------------------------

    def admit(
        self, task: str, key: str, digest: str, spec: dict[str, Any]
    ) -> tuple[SessionRecord, bool]:
        """The spec's canonical text is made before the write lock and the new row read back
        after its commit: every other writer of the home queues on that lock while it is held."""
        text = canonical_bytes(spec).decode()
        with self._write() as db:
            trow = db.execute("SELECT state, generation, frozen FROM tasks WHERE task=?", (task,))
            found = trow.fetchone()
            if found is None:
                raise UnknownTask(task)
            existing = db.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions WHERE task=? AND key=?", (task, key)
            ).fetchone()
            record = None if existing is None else session_from_row(existing, self._hidden_sets)
            if enforce(key_verdict(record, key, digest)) == REUSE:
                assert record is not None
                return record, True
            state, generation, frozen = found
            unknown = db.execute(
                "SELECT session FROM sessions WHERE task=? AND state='unknown' LIMIT 1", (task,)
            ).fetchone()
            enforce(admission_verdict(task, state, frozen, None if unknown is None else unknown[0]))
            session = new_id("s")
            db.execute(
                "INSERT INTO sessions (session, task, key, digest, spec, state, generation, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    session,
                    task,
                    key,
                    digest,
                    text,
                    ADMITTED,
                    generation,
                    time.time(),
                ),
            )
        return self.get_session(session), False

    def get_session(self, session: str) -> SessionRecord:
        row = self._db.execute(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session=?", (session,)
        ).fetchone()
        if row is None:
            raise UnknownSession(session)
        return session_from_row(row, self._hidden_sets)

    def find_session(self, task: str, key: str) -> SessionRecord | None:
        row = self._db.execute(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE task=? AND key=?", (task, key)
        ).fetchone()
        return session_from_row(row, self._hidden_sets) if row else None

    def list_sessions(self, task: str) -> list[SessionRecord]:
        rows = self._db.execute(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE task=? ORDER BY created_at, session",
            (task,),
        ).fetchall()
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def _transition(
        self,
        db: sqlite3.Connection,
        session: str,
        generation: int,
        event: str,
        sets: dict[str, Any],
    ) -> None:
        """The compare-and-set every state change goes through."""
        expected = states_accepting(event)
        row = db.execute(
            "SELECT state, generation FROM sessions WHERE session=?", (session,)
        ).fetchone()
        if row is None:
            raise UnknownSession(session)
        state, current_generation = row
        if state not in expected or current_generation != generation:
            raise StaleWrite(
                f"session {session}: {event} expects state in {list(expected)} at generation "
                f"{generation}, found {state!r} at generation {current_generation}"
            )
        new_state = next_session_state(state, event)
        assignments = "".join(f", {column}=?" for column in sets)
        db.execute(
            f"UPDATE sessions SET state=?{assignments} "
            "WHERE session=? AND state=? AND generation=?",
            (new_state, *sets.values(), session, state, generation),
        )

    def _update_live(
        self, db: sqlite3.Connection, session: str, generation: int, sets: dict[str, Any]
    ) -> None:
        """A field update that changes no state but still must hold the generation."""
        assignments = ", ".join(f"{column}=?" for column in sets)
        cursor = db.execute(
            f"UPDATE sessions SET {assignments} WHERE session=? AND generation=? "
            "AND state IN ('running', 'settling')",
            (*sets.values(), session, generation),
        )
        if cursor.rowcount != 1:
            raise StaleWrite(f"session {session} is not live at generation {generation}")

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
        sets: dict[str, Any] = {"owner": json.dumps(owner.to_json()), "started_at": time.time()}
        launch, hidden_set = _launch_sets(boundary, boundary_ref, isolation)
        sets |= launch
        with self._write() as db:
            _store_hidden(db, hidden_set)
            self._transition(db, session, generation, "claim", sets)
        return self.get_session(session)

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
        """`durable=False`: not fsynced (synchronous=NORMAL for this one transaction), for
        facts of this boot only (a pid), which no power cut can make wrong: every process of
        the boot dies with it. Other processes see the write at once either way."""
        sets: dict[str, Any] = {
            "boundary": boundary,
            "boundary_ref": boundary_ref,
            "command_pid": command_pid,
            "command_start_time": command_start_time,
        }
        hidden_set = None
        if isolation is not None:
            sets["isolation"], hidden_set = stored_isolation(isolation)
        if not durable:
            self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            with self._write() as db:
                _store_hidden(db, hidden_set)
                self._update_live(db, session, generation, sets)
        finally:
            if not durable:
                self._db.execute("PRAGMA synchronous=FULL")

    def heartbeat(
        self, session: str, generation: int, lease_until: float, stdout: int, stderr: int
    ) -> str | None:
        """Not fsynced (synchronous=NORMAL for this one transaction): a renewal lost to a power
        cut is harmless, since the next boot has another boot id, and 200 owners renewing every
        few seconds must not queue behind 200 fsyncs a second on the write lock."""
        self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            return self._heartbeat(session, generation, lease_until, stdout, stderr)
        finally:
            self._db.execute("PRAGMA synchronous=FULL")

    def _heartbeat(
        self, session: str, generation: int, lease_until: float, stdout: int, stderr: int
    ) -> str | None:
        with self._write() as db:
            row = db.execute(
                "SELECT owner, cancel_requested FROM sessions WHERE session=?", (session,)
            ).fetchone()
            if row is None:
                raise UnknownSession(session)
            owner = json.loads(row[0]) if row[0] else {}
            owner["lease_until"] = lease_until
            self._update_live(
                db,
                session,
                generation,
                {"owner": json.dumps(owner)},
            )
            db.execute(  # a durable cursor never moves backwards
                "UPDATE sessions SET stdout_durable=MAX(stdout_durable, ?), "
                "stderr_durable=MAX(stderr_durable, ?) WHERE session=?",
                (stdout, stderr, session),
            )
            return row[1]  # type: ignore[no-any-return]

    def settle_begin(self, session: str, generation: int) -> None:
        with self._write() as db:
            self._transition(db, session, generation, "settle_begin", {})

    def write_receipt(
        self, session: str, generation: int, receipt: dict[str, Any], event: str = "receipt"
    ) -> SessionRecord:
        if event not in RECEIPT_EVENTS:
            raise StaleWrite(f"a receipt settles a session only by {RECEIPT_EVENTS}, not {event!r}")
        checked(receipt, f"the receipt offered for session {session}")  # refused unsealed
        output = receipt.get("output", {})
        text, hidden_set = stored_receipt(receipt)  # before the write lock: others queue on it
        with self._write() as db:
            _store_hidden(db, hidden_set)
            self._transition(
                db,
                session,
                generation,
                event,
                {
                    "receipt": text,
                    "settled_at": time.time(),
                    **{
                        f"{stream}_durable": output[stream]["cursor"]
                        for stream in ("stdout", "stderr")
                        if stream in output
                    },
                },
            )
        return self.get_session(session)

    def mark_unknown(self, session: str, generation: int, why: str) -> SessionRecord:
        """The owner is gone without a receipt: unknown, never failed (rule 4)."""
        with self._write() as db:
            self._transition(db, session, generation, "lose", {"unknown_why": why})
        return self.get_session(session)

    def take_over(self, session: str, generation: int) -> int:
        """Fence an unknown session's old owner: recovery writes at the next generation, and
        every later write of the old owner (heartbeat, receipt) is refused."""
        with self._write() as db:
            cursor = db.execute(
                "UPDATE sessions SET generation=generation+1 "
                "WHERE session=? AND generation=? AND state='unknown'",
                (session, generation),
            )
            if cursor.rowcount != 1:
                raise StaleWrite(
                    f"session {session} is not unknown at generation {generation}: another "
                    "recovery took it over, or it settled"
                )
        return generation + 1

    def note_unknown(self, session: str, why: str) -> None:
        """Recovery inspected an unknown session and could not prove it dead: say why."""
        with self._write() as db:
            db.execute(
                "UPDATE sessions SET unknown_why=? WHERE session=? AND state='unknown'",
                (why, session),
            )

    def unknown_sessions(self, task: str | None = None) -> list[SessionRecord]:
        where, args = ("AND task=?", (task,)) if task else ("", ())
        rows = self._db.execute(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE state='unknown' {where} "
            "ORDER BY created_at",
            args,
        ).fetchall()
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def live_sessions(self, task: str | None = None) -> list[SessionRecord]:
        return [
            session_from_row(r, self._hidden_sets) for r in self._live_rows(SESSION_COLUMNS, task)
        ]

    def live_owners(self, task: str | None = None) -> list[LiveSession]:
        return [live_from_row(r) for r in self._live_rows(LIVE_COLUMNS, task)]

    def _live_rows(self, columns: str, task: str | None) -> list[Any]:
        """``columns`` of every live session (of ``task``, if given), oldest first."""
        where, args = ("AND task=?", (task,)) if task else ("", ())
        return self._db.execute(
            f"SELECT {columns} FROM sessions "
            f"WHERE state IN ('admitted', 'running', 'settling') {where} ORDER BY created_at",
            args,
        ).fetchall()

    def request_cancel(self, session: str, reason: str) -> SessionRecord:
        with self._write() as db:
            db.execute(
                "UPDATE sessions SET cancel_requested=? WHERE session=? "
                "AND cancel_requested IS NULL AND state IN ('admitted', 'running', 'settling')",
                (reason, session),
            )
        return self.get_session(session)

    # -- the close join and checkpoints --------------------------------------------------

    def _task_transition(self, db: sqlite3.Connection, task: str, event: str) -> str:
        row = db.execute("SELECT state FROM tasks WHERE task=?", (task,)).fetchone()
        if row is None:
            raise UnknownTask(task)
        try:
            new_state = next_task_state(row[0], event)
        except IllegalTransition as exc:
            raise StaleWrite(f"task {task}: {exc}") from None
        db.execute("UPDATE tasks SET state=? WHERE task=? AND state=?", (new_state, task, row[0]))
        return new_state

    def task_event(self, task: str, event: str) -> TaskRecord:
        with self._write() as db:
            self._task_transition(db, task, event)
        return self.get_task(task)

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
        """Record a step's fact once; a second recording returns the first (never re-runs).
        Its ``event`` and ``fence``, if any, in the same transaction (see ``Store``);
        ``durable=False``: synchronous=NORMAL for this one transaction (no WAL fsync)."""
        text = canonical_bytes(fact).decode()
        if not durable:
            self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            return self._record_close_step(task, step, text, fact, event, fence)
        finally:
            if not durable:
                self._db.execute("PRAGMA synchronous=FULL")

    def _record_close_step(
        self,
        task: str,
        step: str,
        text: str,
        fact: dict[str, Any],
        event: str | None,
        fence: int | None,
    ) -> dict[str, Any]:
        with self._write() as db:
            row = db.execute(
                "SELECT fact, digest FROM close_steps WHERE task=? AND step=?", (task, step)
            ).fetchone()
            if row is not None:
                return checked_fact(task, step, row[0], row[1])
            if event is not None:
                self._task_transition(db, task, event)
            if fence is not None:
                self._fence(db, task, fence)
            db.execute(
                "INSERT INTO close_steps (task, step, fact, recorded_at, digest) "
                "VALUES (?, ?, ?, ?, ?)",
                (task, step, text, time.time(), fact_digest(text)),
            )
        return fact

    def close_steps(self, task: str) -> dict[str, dict[str, Any]]:
        rows = self._db.execute(
            "SELECT step, fact, digest FROM close_steps WHERE task=?", (task,)
        ).fetchall()
        return {step: checked_fact(task, step, fact, digest) for step, fact, digest in rows}

    def record_checkpoint(
        self, task: str, generation: int, receipt: dict[str, Any], index_ref: str | None
    ) -> None:
        """Refused from a fenced generation: only the task's current generation may publish."""
        with self._write() as db:
            row = db.execute("SELECT generation FROM tasks WHERE task=?", (task,)).fetchone()
            if row is None:
                raise UnknownTask(task)
            if row[0] != generation:
                raise StaleWrite(
                    f"task {task}: a checkpoint from generation {generation} is refused; the "
                    f"runtime generation is {row[0]} (fenced)"
                )
            db.execute(
                "INSERT OR IGNORE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?)",
                (
                    receipt["manifest"],
                    task,
                    generation,
                    canonical_bytes(receipt).decode(),
                    index_ref,
                    time.time(),
                ),
            )

    def latest_checkpoint(self, task: str) -> tuple[dict[str, Any], str | None] | None:
        row = self._db.execute(
            "SELECT receipt, index_ref FROM checkpoints WHERE task=? "
            "ORDER BY created_at DESC, rowid DESC LIMIT 1",
            (task,),
        ).fetchone()
        if row is None:
            return None
        return checked(json.loads(row[0]), f"the checkpoint receipt of task {task}"), row[1]

    def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
        """A bounded sleep: SQLite sends no notifications, and a waiter on this host is woken
        by its owner's exit handle instead."""
        del topics
        time.sleep(max(0.0, seconds))

    def fence(self, task: str, generation: int) -> int:
        """Advance the runtime generation past `generation`; a stale fence is refused."""
        with self._write() as db:
            self._fence(db, task, generation)
        return generation + 1

    def _fence(self, db: sqlite3.Connection, task: str, generation: int) -> None:
        cursor = db.execute(
            "UPDATE tasks SET generation=generation+1 WHERE task=? AND generation=?",
            (task, generation),
        )
        if cursor.rowcount != 1:
            raise StaleWrite(f"task {task} is not at generation {generation}: already fenced")


def open_sqlite(home: str, path: str | None = None) -> SQLiteStore:
    """The home's SQLite store, at `path` when the home was bound to one elsewhere."""
    return SQLiteStore(path or os.path.join(home, "settled.db"), home)
