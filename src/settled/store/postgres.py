"""PostgreSQL implementation of the authority store: one database (or schema) shared by many hosts.

The same records, transitions and seals as `store/sqlite.py`, translated. Connections are
autocommit and every write is one explicit transaction at READ COMMITTED, so each statement
sees what committed before it began; what SQLite gets from its one write lock comes here from
row locks taken before the reads that decide:
- a session's state change reads its row `FOR UPDATE`, then updates it `WHERE state=... AND
  generation=...` and checks the row count: a lost compare-and-set is StaleWrite, never a silent
  no-op;
- admission holds its task row `FOR SHARE`, so a seal, a fence or a session becoming unknown
  (each of which locks the task row for update) waits for admissions in flight, and an
  admission never lands in a task that was sealed or frozen under it; `ON CONFLICT (task, key)`
  turns the 16-way race of one key into one insert and fifteen reuses;
- `create_task` holds a transaction-scoped advisory lock of its schema, so two concurrent
  creations cannot both pass the workspace overlap check;
- migrations run under another advisory lock, so two processes opening a fresh store at once
  migrate it once.
A deadlock or serialization failure the server reports is retried a few times (the transaction
was rolled back whole). Every state change, heartbeat and receipt sends `NOTIFY` on the
schema's channel with "task session" as its payload, delivered at commit; `await_change` waits on
a connection of its own that LISTENs.

Connection failures, a wrong password or a missing database are one StoreUnreachable naming
host:port/database and the server's reason, with the password scrubbed. There is no home check:
a PostgreSQL store is shared by many homes. Never touches processes, logs or the workspace.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool

from settled.canonical import canonical_bytes
from settled.errors import (
    StaleWrite,
    StoreUnreachable,
    UnknownHost,
    UnknownSession,
    UnknownTask,
)
from settled.identity import new_id
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
from settled.store import loads, schema
from settled.store.admission import (
    admission_verdict,
    creation_verdict,
    enforce,
    key_verdict,
    overlapping,
)
from settled.store.dialect import POSTGRESQL
from settled.store.rows import (
    HOST_COLUMNS,
    LIVE_COLUMNS,
    RECEIPT_EVENTS,
    SESSION_COLUMNS,
    HiddenSet,
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

T = TypeVar("T")
Cursor = psycopg.Cursor[tuple[Any, ...]]

CONNECT_TIMEOUT_S: Final = 10
POOL_MIN, POOL_MAX = 1, 4
RETRIES: Final = 8  # a deadlock or serialization failure: the whole transaction again

TASK_COLUMNS: Final = (
    'task, key, workspace, state, generation, created_at, "user", shared_workspace, host, frozen, '
    "sandbox, ignore_rules, defaults, workspace_identity"
)
SELECT_SESSION: Final = f"SELECT {SESSION_COLUMNS} FROM sessions"

# The pool's background retries would print warnings on stderr (logging's last resort); the
# failure reaches the caller as StoreUnreachable instead. An application's own handlers still
# see them.
logging.getLogger("psycopg.pool").addHandler(logging.NullHandler())


# --- the URL and its failures ---------------------------------------------------------------


def _where(params: dict[str, Any]) -> str:
    """host:port/database of a connection, as an error names it (no user, no password)."""
    host = params.get("host") or params.get("hostaddr") or "localhost"
    return f"{host}:{params.get('port') or 5432}/{params.get('dbname') or params.get('user')}"


def _secrets(url: str, params: dict[str, Any]) -> list[str]:
    """Every spelling of the password a message could echo."""
    found = {str(params.get("password") or "")}
    with contextlib.suppress(ValueError):
        raw = urllib.parse.urlsplit(url).password or ""
        found |= {raw, urllib.parse.unquote(raw)}
    return sorted((s for s in found if s), key=len, reverse=True)


def _one_line(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return "; ".join(line.strip() for line in text.splitlines() if line.strip()) or "no reason"


def _parse(url: str) -> dict[str, Any]:
    """The connection parameters of a postgresql:// URL; StoreUnreachable if it is not one."""
    scheme = url.partition("://")[0]
    if scheme not in ("postgresql", "postgres"):
        raise StoreUnreachable(
            "(not a PostgreSQL URL)", f"expected postgresql://user:password@host:port/database, "
            f"got a URL of scheme {scheme!r}"
        )  # fmt: skip
    try:
        return dict(conninfo_to_dict(url))
    except psycopg.Error as exc:
        raise StoreUnreachable(
            "(a malformed URL)", _one_line(str(exc), _secrets(url, {}))
        ) from None


def _schema_of(params: dict[str, Any]) -> str | None:
    """The schema named by `options=-csearch_path=NAME` (its first entry), if any."""
    for option in str(params.get("options") or "").split():
        for prefix in ("-csearch_path=", "--search_path="):
            if option.startswith(prefix):
                first = option[len(prefix) :].split(",")[0].strip().strip('"')
                return first or None
    return None


def _lock_key(*parts: str) -> int:
    """A 64-bit advisory lock key for a purpose within one schema."""
    digest = hashlib.sha256("\0".join(("settled", *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresStore:
    """A small pool per instance; one instance per process (owners open their own). A process
    the kernel refuses threads (``pooled=False``) uses one connection instead: a pool's
    scheduler and workers are threads."""

    def __init__(self, url: str, *, pooled: bool = True) -> None:
        self._url = url
        params = _parse(url)
        self.where = _where(params)
        self._secrets = _secrets(url, params)
        self.schema = _schema_of(params)
        namespace = self.schema or "public"
        self._channel = f"settled_{hashlib.sha256(namespace.encode()).hexdigest()[:16]}"
        self._create_lock = _lock_key(namespace, "create_task")
        self._listener: psycopg.Connection[tuple[Any, ...]] | None = None
        self._listen_lock = threading.Lock()
        self._hidden_sets = HiddenSets(self._hidden_set)
        # The pool's first connection is made in the background while this one checks the
        # schema: an open costs one connection time, not two. The direct connection is what
        # names a failure (the pool would only time out).
        self._pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]] | None = None
        self._single: psycopg.Connection[tuple[Any, ...]] | None = None  # when not pooled
        self._single_lock = threading.Lock()
        if pooled:
            self._pool = ConnectionPool(
                url,
                min_size=POOL_MIN,
                max_size=POOL_MAX,
                kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                timeout=CONNECT_TIMEOUT_S,
                open=False,
            )
            self._pool.open(wait=False)
        try:
            with self._unreachable(), self._connect() as conn:
                self._migrate(conn)
        except BaseException:
            if self._pool is not None:
                self._pool.close(timeout=0.5)
            raise

    def close(self) -> None:
        with self._listen_lock:
            if self._listener is not None:
                with contextlib.suppress(psycopg.Error):
                    self._listener.close()
                self._listener = None
        if self._pool is not None:
            self._pool.close()
        with self._single_lock:
            if self._single is not None:
                with contextlib.suppress(psycopg.Error):
                    self._single.close()
                self._single = None

    # -- connections -----------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        return psycopg.connect(self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
        """A connection for one read or transaction: the pool's, or the one connection (made
        again once broken or closed), held by one thread at a time."""
        if self._pool is not None:
            with self._pool.connection() as conn:
                yield conn
            return
        with self._single_lock:
            if self._single is None or self._single.closed or self._single.broken:
                self._single = self._connect()
            yield self._single

    @contextlib.contextmanager
    def _unreachable(self) -> Iterator[None]:
        """A refused, lost or unauthenticated connection, named in one line, never a traceback."""
        try:
            yield
        except pgerrors.TransactionRollback:
            raise
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise StoreUnreachable(self.where, _one_line(str(exc), self._secrets)) from None

    def _write(self, work: Callable[[Cursor], T]) -> T:
        """Run `work` in one transaction; a deadlock or serialization failure runs it again."""
        for attempt in range(RETRIES):
            try:
                with (
                    self._unreachable(),
                    self._connection() as conn,
                    conn.transaction(),
                    conn.cursor() as cur,
                ):
                    return work(cur)
            except pgerrors.TransactionRollback:
                if attempt == RETRIES - 1:
                    raise
                time.sleep(0.001 * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, query: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._unreachable(), self._connection() as conn:
            return conn.execute(query, args).fetchall()

    def _read_one(self, query: str, args: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        rows = self._read(query, args)
        return rows[0] if rows else None

    def _hidden_set(self, digest: str, cur: Cursor | None = None) -> str | None:
        """By `cur` inside a transaction: an unpooled store has one connection."""
        query, args = "SELECT dirs FROM hidden_sets WHERE digest=%s", (digest,)
        row = (
            cur.execute(query, args).fetchone() if cur is not None else self._read_one(query, args)
        )
        return None if row is None else str(row[0])

    def _store_hidden(self, cur: Cursor, hidden_set: HiddenSet | None) -> None:
        """Once per distinct list: every later session that hides the same directories names it."""
        if hidden_set is not None:
            cur.execute(
                "INSERT INTO hidden_sets(digest, dirs) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                hidden_set,
            )

    def _notify(self, cur: Cursor, task: str, session: str = "") -> None:
        """Delivered at commit, to every LISTENer of this schema's channel."""
        cur.execute("SELECT pg_notify(%s, %s)", (self._channel, f"{task} {session}"))

    # -- schema ----------------------------------------------------------------------------

    def _migrate(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        """Nothing is written by an open of a current store; otherwise one process at a time
        creates the schema and applies the missing steps, under an advisory lock."""
        if self._version_now(conn) == SCHEMA_VERSION:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(str(self.schema), "m"),))
            if self.schema is not None:
                conn.execute(
                    sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))
                )
            conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            version = int(row[0]) if row else 0
            self._refuse_newer(version)
            schema.apply(POSTGRESQL, conn.execute, version)

    def _version_now(self, conn: psycopg.Connection[tuple[Any, ...]]) -> int | None:
        """The recorded schema version, None where there is no store yet; a newer one refused."""
        if conn.execute("SELECT to_regclass('meta')").fetchone() == (None,):
            return None
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        version = int(row[0]) if row else 0
        self._refuse_newer(version)
        return version

    def _refuse_newer(self, version: int) -> None:
        named = f"{self.where} (schema {self.schema})" if self.schema else self.where
        refuse_newer(version, named, "store")

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
        def work(cur: Cursor) -> tuple[TaskRecord, bool]:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (self._create_lock,))
            row = cur.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE key=%s", (key,)).fetchone()
            if row:
                return task_from_row(row), False
            others = overlapping(
                workspace,
                workspace_identity,
                (  # one host's: not another's paths
                    (task, path, loads(identity))
                    for task, path, identity in cur.execute(
                        "SELECT task, workspace, workspace_identity FROM tasks WHERE state != %s "
                        "AND (host IS NULL OR %s::text IS NULL OR host = %s) ORDER BY created_at",
                        (TASK_COMPLETE, host, host),
                    ).fetchall()
                ),
            )
            enforce(creation_verdict(workspace, others, shared_workspace))
            record = TaskRecord(
                new_id("t"), key, workspace, TASK_OPEN, 1, time.time(), user, shared_workspace,
                host=host, ignore_rules=ignore_rules, defaults=defaults,
                workspace_identity=workspace_identity,
            )  # fmt: skip
            cur.execute(
                f"INSERT INTO tasks ({TASK_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, NULL, NULL, %s, %s, %s)",
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
                cur.executemany(
                    "INSERT INTO workspace_shares VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    [
                        (record.task, other, record.created_at),
                        (other, record.task, record.created_at),
                    ],
                )
            self._notify(cur, record.task)
            return record, True

        return self._write(work)

    def discard_task(self, task: str) -> bool:
        def work(cur: Cursor) -> bool:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (self._create_lock,))
            locked = cur.execute(
                "SELECT 1 FROM tasks WHERE task=%s AND state=%s AND generation=1 FOR UPDATE",
                (task, TASK_OPEN),
            ).fetchone()
            if locked is None:
                return False
            cur.execute(  # a new statement, after the lock: it sees every committed use
                "DELETE FROM tasks WHERE task=%s"
                " AND NOT EXISTS (SELECT 1 FROM sessions WHERE sessions.task=tasks.task)"
                " AND NOT EXISTS (SELECT 1 FROM close_steps WHERE close_steps.task=tasks.task)"
                " AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE checkpoints.task=tasks.task)",
                (task,),
            )
            if cur.rowcount != 1:
                return False
            cur.execute("DELETE FROM workspace_shares WHERE task=%s OR other=%s", (task, task))
            return True

        return self._write(work)

    def record_sandbox(self, task: str, facts: dict[str, Any]) -> TaskRecord:
        def work(cur: Cursor) -> TaskRecord:
            done = cur.execute(
                "UPDATE tasks SET sandbox=%s WHERE task=%s AND sandbox IS NULL",
                (json.dumps(facts, sort_keys=True), task),
            )
            updated = done.rowcount
            row = cur.execute(f"SELECT {TASK_COLUMNS} FROM tasks WHERE task=%s", (task,)).fetchone()
            if row is None:
                raise UnknownTask(task)
            if updated != 1:
                raise StaleWrite(f"task {task} has its sandbox recorded already")
            self._notify(cur, task)
            return task_from_row(row)

        return self._write(work)

    def workspace_shares(self, task: str) -> list[str]:
        rows = self._read(
            "SELECT other FROM workspace_shares WHERE task=%s ORDER BY created_at, other", (task,)
        )
        return [r[0] for r in rows]

    def get_task(self, task: str) -> TaskRecord:
        row = self._read_one(f"SELECT {TASK_COLUMNS} FROM tasks WHERE task=%s", (task,))
        if row is None:
            raise UnknownTask(task)
        return task_from_row(row)

    def list_tasks(self, limit: int = 1000) -> list[TaskRecord]:
        rows = self._read(
            f"SELECT {TASK_COLUMNS} FROM tasks ORDER BY created_at DESC, task LIMIT %s", (limit,)
        )
        return [task_from_row(r) for r in rows]

    def find_task(self, key: str) -> TaskRecord | None:
        row = self._read_one(f"SELECT {TASK_COLUMNS} FROM tasks WHERE key=%s", (key,))
        return None if row is None else task_from_row(row)

    def workspaces(self) -> list[str]:
        return [r[0] for r in self._read("SELECT DISTINCT workspace FROM tasks")]

    def add_hidden_paths(self, paths: list[str]) -> None:
        def work(cur: Cursor) -> None:
            cur.execute(
                "INSERT INTO meta(key, value) VALUES('hidden_paths', '[]') ON CONFLICT DO NOTHING"
            )
            row = cur.execute(
                "SELECT value FROM meta WHERE key='hidden_paths' FOR UPDATE"
            ).fetchone()
            known = set(json.loads(row[0])) if row else set()
            if known >= set(paths):
                return
            cur.execute(
                "UPDATE meta SET value=%s WHERE key='hidden_paths'",
                (json.dumps(sorted(known | set(paths))),),
            )

        self._write(work)

    def hidden_paths(self) -> list[str]:
        row = self._read_one("SELECT value FROM meta WHERE key='hidden_paths'")
        return list(json.loads(row[0])) if row else []

    # -- hosts -----------------------------------------------------------------------------

    def register_host(self, host: str, name: str, home: str) -> HostRecord:
        found = self.get_host(host)
        if found is not None:
            return found

        def work(cur: Cursor) -> HostRecord:
            cur.execute(
                "INSERT INTO hosts (host, name, home, registered_at) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (host) DO NOTHING",
                (host, name, home, time.time()),
            )
            row = cur.execute(f"SELECT {HOST_COLUMNS} FROM hosts WHERE host=%s", (host,))
            return host_from_row(row.fetchone() or ())

        return self._write(work)

    def get_host(self, host: str) -> HostRecord | None:
        row = self._read_one(f"SELECT {HOST_COLUMNS} FROM hosts WHERE host=%s", (host,))
        return None if row is None else host_from_row(row)

    def hosts(self) -> list[HostRecord]:
        rows = self._read(f"SELECT {HOST_COLUMNS} FROM hosts ORDER BY registered_at, host")
        return [host_from_row(r) for r in rows]

    def vanish_host(self, host: str, why: str) -> list[str]:
        def work(cur: Cursor) -> list[str]:
            if (
                cur.execute("SELECT 1 FROM hosts WHERE host=%s FOR UPDATE", (host,)).fetchone()
                is None
            ):
                raise UnknownHost(host)
            cur.execute(
                "UPDATE hosts SET vanished_at=%s, vanished_why=%s "
                "WHERE host=%s AND vanished_at IS NULL",
                (time.time(), why, host),
            )
            frozen = cur.execute(
                "UPDATE tasks SET frozen=%s WHERE host=%s AND frozen IS NULL AND state != %s "
                "RETURNING task",
                (why, host, TASK_COMPLETE),
            ).fetchall()
            for (task,) in frozen:
                self._notify(cur, task)
            rows = cur.execute(
                "SELECT task FROM tasks WHERE host=%s AND frozen IS NOT NULL ORDER BY created_at",
                (host,),
            ).fetchall()
            return [r[0] for r in rows]

        return self._write(work)

    # -- sessions --------------------------------------------------------------------------

    def admit(
        self, task: str, key: str, digest: str, spec: dict[str, Any]
    ) -> tuple[SessionRecord, bool]:
        def reuse(row: tuple[Any, ...], cur: Cursor) -> tuple[SessionRecord, bool]:
            record = session_from_row(
                row, self._hidden_sets.via(lambda digest: self._hidden_set(digest, cur))
            )
            enforce(key_verdict(record, key, digest))  # a retry, or KeyConflict
            return record, True

        def work(cur: Cursor) -> tuple[SessionRecord, bool]:
            found = cur.execute(  # held until commit: no seal, fence or freeze slips under us
                "SELECT state, generation, frozen FROM tasks WHERE task=%s FOR SHARE", (task,)
            ).fetchone()
            if found is None:
                raise UnknownTask(task)
            existing = cur.execute(
                f"{SELECT_SESSION} WHERE task=%s AND key=%s", (task, key)
            ).fetchone()
            if existing is not None:
                return reuse(existing, cur)
            state, generation, frozen = found
            unknown = cur.execute(
                "SELECT session FROM sessions WHERE task=%s AND state='unknown' LIMIT 1", (task,)
            ).fetchone()
            enforce(admission_verdict(task, state, frozen, None if unknown is None else unknown[0]))
            row = cur.execute(
                "INSERT INTO sessions (session, task, key, digest, spec, state, generation, "
                "created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                f"ON CONFLICT (task, key) DO NOTHING RETURNING {SESSION_COLUMNS}",
                (
                    new_id("s"),
                    task,
                    key,
                    digest,
                    canonical_bytes(spec).decode(),
                    ADMITTED,
                    generation,
                    time.time(),
                ),
            ).fetchone()
            if row is None:  # a concurrent admission of this key committed first: it stands
                won = cur.execute(
                    f"{SELECT_SESSION} WHERE task=%s AND key=%s", (task, key)
                ).fetchone()
                assert won is not None
                return reuse(won, cur)
            self._notify(cur, task, row[0])
            return session_from_row(row, self._hidden_sets), False

        return self._write(work)

    def get_session(self, session: str) -> SessionRecord:
        row = self._read_one(f"{SELECT_SESSION} WHERE session=%s", (session,))
        if row is None:
            raise UnknownSession(session)
        return session_from_row(row, self._hidden_sets)

    def find_session(self, task: str, key: str) -> SessionRecord | None:
        row = self._read_one(f"{SELECT_SESSION} WHERE task=%s AND key=%s", (task, key))
        return session_from_row(row, self._hidden_sets) if row else None

    def list_sessions(self, task: str) -> list[SessionRecord]:
        rows = self._read(f"{SELECT_SESSION} WHERE task=%s ORDER BY created_at, session", (task,))
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def _transition(
        self, cur: Cursor, session: str, generation: int, event: str, sets: dict[str, Any]
    ) -> None:
        """The compare-and-set every state change goes through."""
        expected = states_accepting(event)
        if event == "lose":  # freezes the task's admission: wait for admissions in flight
            cur.execute(
                "SELECT 1 FROM tasks WHERE task=(SELECT task FROM sessions WHERE session=%s) "
                "FOR NO KEY UPDATE",
                (session,),
            )
        row = cur.execute(
            "SELECT task, state, generation FROM sessions WHERE session=%s FOR UPDATE",
            (session,),
        ).fetchone()
        if row is None:
            raise UnknownSession(session)
        task, state, current_generation = row
        if state not in expected or current_generation != generation:
            raise StaleWrite(
                f"session {session}: {event} expects state in {list(expected)} at generation "
                f"{generation}, found {state!r} at generation {current_generation}"
            )
        new_state = next_session_state(state, event)
        assignments = "".join(f", {column}=%s" for column in sets)
        cur.execute(
            f"UPDATE sessions SET state=%s{assignments} "
            "WHERE session=%s AND state=%s AND generation=%s",
            (new_state, *sets.values(), session, state, generation),
        )
        if cur.rowcount != 1:  # the row is locked: this is a bug, not a race
            raise StaleWrite(f"session {session}: {event} lost its compare-and-set")
        self._notify(cur, task, session)

    def _update_live(self, cur: Cursor, session: str, generation: int, sets: dict[str, Any]) -> str:
        """A field update that changes no state but still must hold the generation; returns
        the session's task."""
        assignments = ", ".join(f"{column}=%s" for column in sets)
        row = cur.execute(
            f"UPDATE sessions SET {assignments} WHERE session=%s AND generation=%s "
            "AND state IN ('running', 'settling') RETURNING task",
            (*sets.values(), session, generation),
        ).fetchone()
        if row is None:
            raise StaleWrite(f"session {session} is not live at generation {generation}")
        return str(row[0])

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
        hidden_set = None
        if boundary is not None:
            sets |= {"boundary": boundary, "boundary_ref": boundary_ref}
            if isolation is not None:
                sets["isolation"], hidden_set = stored_isolation(isolation)

        def work(cur: Cursor) -> None:
            self._store_hidden(cur, hidden_set)
            self._transition(cur, session, generation, "claim", sets)

        self._write(work)
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
        """`durable=False`: committed without waiting for the WAL flush, for facts of this
        boot only (a pid), which no crash of the server's host can make wrong."""
        sets: dict[str, Any] = {
            "boundary": boundary,
            "boundary_ref": boundary_ref,
            "command_pid": command_pid,
            "command_start_time": command_start_time,
        }
        hidden_set = None
        if isolation is not None:
            sets["isolation"], hidden_set = stored_isolation(isolation)

        def work(cur: Cursor) -> None:
            if not durable:
                cur.execute("SET LOCAL synchronous_commit = off")
            self._store_hidden(cur, hidden_set)
            self._notify(cur, self._update_live(cur, session, generation, sets), session)

        self._write(work)

    def heartbeat(
        self, session: str, generation: int, lease_until: float, stdout: int, stderr: int
    ) -> str | None:
        """Committed without waiting for the WAL flush (`synchronous_commit=off` for this one
        transaction), as SQLite's is not fsynced: a renewal lost to a crash is harmless, and
        many owners renewing must not queue behind one flush each."""

        def work(cur: Cursor) -> str | None:
            cur.execute("SET LOCAL synchronous_commit = off")
            row = cur.execute(
                "SELECT owner, cancel_requested FROM sessions WHERE session=%s FOR UPDATE",
                (session,),
            ).fetchone()
            if row is None:
                raise UnknownSession(session)
            owner = json.loads(row[0]) if row[0] else {}
            owner["lease_until"] = lease_until
            task = self._update_live(cur, session, generation, {"owner": json.dumps(owner)})
            cur.execute(  # a durable cursor never moves backwards
                "UPDATE sessions SET stdout_durable=GREATEST(stdout_durable, %s), "
                "stderr_durable=GREATEST(stderr_durable, %s) WHERE session=%s",
                (stdout, stderr, session),
            )
            self._notify(cur, task, session)
            return row[1]  # type: ignore[no-any-return]

        return self._write(work)

    def settle_begin(self, session: str, generation: int) -> None:
        self._write(lambda cur: self._transition(cur, session, generation, "settle_begin", {}))

    def write_receipt(
        self, session: str, generation: int, receipt: dict[str, Any], event: str = "receipt"
    ) -> SessionRecord:
        if event not in RECEIPT_EVENTS:
            raise StaleWrite(f"a receipt settles a session only by {RECEIPT_EVENTS}, not {event!r}")
        checked(receipt, f"the receipt offered for session {session}")  # refused unsealed
        output = receipt.get("output", {})
        text, hidden_set = stored_receipt(receipt)
        sets = {
            "receipt": text,
            "settled_at": time.time(),
            **{
                f"{stream}_durable": output[stream]["cursor"]
                for stream in ("stdout", "stderr")
                if stream in output
            },
        }

        def work(cur: Cursor) -> None:
            self._store_hidden(cur, hidden_set)
            self._transition(cur, session, generation, event, sets)

        self._write(work)
        return self.get_session(session)

    def mark_unknown(self, session: str, generation: int, why: str) -> SessionRecord:
        """The owner is gone without a receipt: unknown, never failed (rule 4)."""
        sets = {"unknown_why": why}
        self._write(lambda cur: self._transition(cur, session, generation, "lose", sets))
        return self.get_session(session)

    def take_over(self, session: str, generation: int) -> int:
        """Fence an unknown session's old owner: recovery writes at the next generation, and
        every later write of the old owner (heartbeat, receipt) is refused."""

        def work(cur: Cursor) -> None:
            row = cur.execute(
                "UPDATE sessions SET generation=generation+1 "
                "WHERE session=%s AND generation=%s AND state='unknown' RETURNING task",
                (session, generation),
            ).fetchone()
            if row is None:
                raise StaleWrite(
                    f"session {session} is not unknown at generation {generation}: another "
                    "recovery took it over, or it settled"
                )
            self._notify(cur, row[0], session)

        self._write(work)
        return generation + 1

    def note_unknown(self, session: str, why: str) -> None:
        """Recovery inspected an unknown session and could not prove it dead: say why."""
        self._write(
            lambda cur: cur.execute(
                "UPDATE sessions SET unknown_why=%s WHERE session=%s AND state='unknown'",
                (why, session),
            )
        )

    def unknown_sessions(self, task: str | None = None) -> list[SessionRecord]:
        where, args = ("AND task=%s", (task,)) if task else ("", ())
        rows = self._read(
            f"{SELECT_SESSION} WHERE state='unknown' {where} ORDER BY created_at", args
        )
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def live_sessions(self, task: str | None = None) -> list[SessionRecord]:
        where, args = ("AND task=%s", (task,)) if task else ("", ())
        rows = self._read(
            f"{SELECT_SESSION} WHERE state IN ('admitted', 'running', 'settling') {where} "
            "ORDER BY created_at",
            args,
        )
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def live_owners(self, task: str | None = None) -> list[LiveSession]:
        where, args = ("AND task=%s", (task,)) if task else ("", ())
        rows = self._read(
            f"SELECT {LIVE_COLUMNS} FROM sessions "
            f"WHERE state IN ('admitted', 'running', 'settling') {where} ORDER BY created_at",
            args,
        )
        return [live_from_row(r) for r in rows]

    def request_cancel(self, session: str, reason: str) -> SessionRecord:
        def work(cur: Cursor) -> None:
            row = cur.execute(
                "UPDATE sessions SET cancel_requested=%s WHERE session=%s "
                "AND cancel_requested IS NULL AND state IN ('admitted', 'running', 'settling') "
                "RETURNING task",
                (reason, session),
            ).fetchone()
            if row is not None:
                self._notify(cur, row[0], session)

        self._write(work)
        return self.get_session(session)

    def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
        """Block until a change of one of `topics` (session or task ids; "*": any) is
        notified, or `seconds` pass. The first call only starts listening and returns at once:
        a change between the caller's last read and the LISTEN would otherwise be missed, so
        the caller reads again, now with every later change queued for it."""
        give_up = time.monotonic() + max(0.0, seconds)
        wanted = set(topics)
        with self._listen_lock, self._unreachable():
            if self._listener is None:
                listener = self._connect()
                listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                self._listener = listener
                return
            while (left := give_up - time.monotonic()) > 0:
                for note in self._listener.notifies(timeout=left, stop_after=1):
                    if "*" in wanted or wanted & set(note.payload.split()):
                        return

    # -- the close join and checkpoints --------------------------------------------------

    def _task_transition(self, cur: Cursor, task: str, event: str) -> str:
        row = cur.execute(
            "SELECT state FROM tasks WHERE task=%s FOR NO KEY UPDATE", (task,)
        ).fetchone()
        if row is None:
            raise UnknownTask(task)
        try:
            new_state = next_task_state(row[0], event)
        except IllegalTransition as exc:
            raise StaleWrite(f"task {task}: {exc}") from None
        cur.execute(
            "UPDATE tasks SET state=%s WHERE task=%s AND state=%s", (new_state, task, row[0])
        )
        self._notify(cur, task)
        return new_state

    def task_event(self, task: str, event: str) -> TaskRecord:
        self._write(lambda cur: self._task_transition(cur, task, event))
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
        Its ``event`` and ``fence``, if any, in the same transaction (see ``Store``): made
        after the insert, so a refused one rolls the insert back. ``durable=False``:
        ``synchronous_commit=off`` for this one transaction."""
        text = canonical_bytes(fact).decode()

        def work(cur: Cursor) -> dict[str, Any]:
            if not durable:
                cur.execute("SET LOCAL synchronous_commit = off")
            inserted = cur.execute(
                "INSERT INTO close_steps (task, step, fact, recorded_at, digest) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (task, step) DO NOTHING RETURNING 1",
                (task, step, text, time.time(), fact_digest(text)),
            ).fetchone()
            if inserted is None:
                row = cur.execute(
                    "SELECT fact, digest FROM close_steps WHERE task=%s AND step=%s",
                    (task, step),
                ).fetchone()
                assert row is not None
                return checked_fact(task, step, row[0], row[1])
            if event is not None:
                self._task_transition(cur, task, event)
            if fence is not None:
                self._fence(cur, task, fence)
            self._notify(cur, task)
            return fact

        return self._write(work)

    def close_steps(self, task: str) -> dict[str, dict[str, Any]]:
        rows = self._read("SELECT step, fact, digest FROM close_steps WHERE task=%s", (task,))
        return {step: checked_fact(task, step, fact, digest) for step, fact, digest in rows}

    def record_checkpoint(
        self, task: str, generation: int, receipt: dict[str, Any], index_ref: str | None
    ) -> None:
        """Refused from a fenced generation: only the task's current generation may publish."""

        def work(cur: Cursor) -> None:
            row = cur.execute(
                "SELECT generation FROM tasks WHERE task=%s FOR SHARE", (task,)
            ).fetchone()
            if row is None:
                raise UnknownTask(task)
            if row[0] != generation:
                raise StaleWrite(
                    f"task {task}: a checkpoint from generation {generation} is refused; the "
                    f"runtime generation is {row[0]} (fenced)"
                )
            cur.execute(
                "INSERT INTO checkpoints (manifest, task, generation, receipt, index_ref, "
                "created_at) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (
                    receipt["manifest"],
                    task,
                    generation,
                    canonical_bytes(receipt).decode(),
                    index_ref,
                    time.time(),
                ),
            )

        self._write(work)

    def latest_checkpoint(self, task: str) -> tuple[dict[str, Any], str | None] | None:
        row = self._read_one(
            "SELECT receipt, index_ref FROM checkpoints WHERE task=%s "
            "ORDER BY created_at DESC, seq DESC LIMIT 1",
            (task,),
        )
        if row is None:
            return None
        return checked(json.loads(row[0]), f"the checkpoint receipt of task {task}"), row[1]

    def fence(self, task: str, generation: int) -> int:
        """Advance the runtime generation past `generation`; a stale fence is refused."""

        def work(cur: Cursor) -> None:
            self._fence(cur, task, generation)
            self._notify(cur, task)

        self._write(work)
        return generation + 1

    def _fence(self, cur: Cursor, task: str, generation: int) -> None:
        cur.execute(
            "UPDATE tasks SET generation=generation+1 WHERE task=%s AND generation=%s",
            (task, generation),
        )
        if cur.rowcount != 1:
            raise StaleWrite(f"task {task} is not at generation {generation}: already fenced")


def open_postgres(url: str, *, pooled: bool = True) -> PostgresStore:
    """The store at a postgresql:// URL (`?options=-csearch_path%3Dname` for a schema of its
    own, created if missing). `pooled=False`: one connection, for a process the kernel refuses
    threads (an owner that unshared its PID namespace, `boundary.pidns.threads_refused`)."""
    return PostgresStore(url, pooled=pooled)
