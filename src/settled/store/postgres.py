"""PostgreSQL implementation of the authority store: one database (or schema) shared by many hosts.

Every statement and method body is `store/sql.py`'s, in PostgreSQL's dialect (`store/dialect.py`);
this module brings the connections, the transactions, the locks and the notifications.
Connections are autocommit and every write is one explicit transaction at READ COMMITTED, so
each statement sees what committed before it began; what SQLite gets from its one write lock
comes here from row locks taken before the reads that decide (the statements carry them):
- a session's state change reads its row `FOR UPDATE`, then updates it `WHERE state=... AND
  generation=...` and checks the row count: a lost compare-and-set is StaleWrite, never a silent
  no-op;
- admission holds its task row `FOR SHARE`, so a seal, a fence or a session becoming unknown
  (each of which locks the task row for update) waits for admissions in flight, and an
  admission never lands in a task that was sealed or frozen under it; `ON CONFLICT (task, key)`
  turns the 16-way race of one key into one insert and fifteen reuses;
- `create_task` (and `discard_task`) hold a transaction-scoped advisory lock of its schema, so
  two concurrent creations cannot both pass the workspace overlap check;
- migrations run under another advisory lock, so two processes opening a fresh store at once
  migrate it once.
A deadlock or serialization failure the server reports is retried a few times (the transaction
was rolled back whole). Every state change, heartbeat and receipt sends `NOTIFY` on the
schema's channel with "task session" as its payload, delivered at commit; `await_change` waits on
a connection of its own that LISTENs.

Connection failures, a wrong password or a missing database are one StoreUnreachable naming
host:port/database and the server's reason, with the password scrubbed. A connection that
failed is never used again (the pool discards a broken one; the single connection of a process
without threads is dropped at its first failure, a lost LISTEN connection at the next wait), so
a caller that retries after a server restart connects afresh (owner/store_retry.py); a
statement that finds its pooled connection lost before anything could commit runs again on the
next one, so a server restart costs no caller an error for each idle pooled connection. There is
no home check: a PostgreSQL store is shared by many homes. Never touches processes, logs or
the workspace.
"""

from __future__ import annotations

import contextlib
import hashlib
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

from settled.backends import search_path_schema
from settled.errors import StoreUnreachable
from settled.store import schema
from settled.store.dialect import POSTGRESQL
from settled.store.schema import SCHEMA_VERSION, refuse_newer
from settled.store.sql import SQLStore

T = TypeVar("T")
Cursor = psycopg.Cursor[tuple[Any, ...]]

CONNECT_TIMEOUT_S: Final = 10
POOL_MIN, POOL_MAX = 1, 4
RETRIES: Final = 8  # a deadlock or serialization failure: the whole transaction again

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
    """The schema named by `options=-csearch_path=NAME` (its first entry), if any, as the
    server reads it (`backends.search_path_schema`: unquoted folded to lower case, quoted
    verbatim), so the schema created is the one the connection's search_path uses."""
    return search_path_schema(str(params.get("options") or ""))


def _lock_key(*parts: str) -> int:
    """A 64-bit advisory lock key for a purpose within one schema."""
    digest = hashlib.sha256("\0".join(("settled", *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresStore(SQLStore):
    """A small pool per instance; one instance per process (owners open their own). A process
    the kernel refuses threads (``pooled=False``) uses one connection instead: a pool's
    scheduler and workers are threads."""

    dialect = POSTGRESQL

    def __init__(self, url: str, *, pooled: bool = True) -> None:
        super().__init__()
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
            try:
                yield self._single
            except pgerrors.TransactionRollback:
                raise  # the transaction is retried on the same, healthy connection
            except (psycopg.OperationalError, psycopg.InterfaceError):
                self._drop_single()  # lost or refused: the next call connects afresh
                raise

    def _drop_single(self) -> None:
        """Forget the one connection (held under its lock), closing what is left of it."""
        single, self._single = self._single, None
        if single is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                single.close()

    @contextlib.contextmanager
    def _unreachable(self) -> Iterator[None]:
        """A refused, lost or unauthenticated connection, named in one line, never a traceback."""
        try:
            yield
        except pgerrors.TransactionRollback:
            raise
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise StoreUnreachable(self.where, _one_line(str(exc), self._secrets)) from None

    def _transact(self, work: Callable[[Cursor], T], *, durable: bool = True) -> T:
        """Run `work` in one transaction; a deadlock or serialization failure runs it again, and
        so does a connection found lost before anything could commit (`_lost_early`), on the
        next one (each idle pooled connection a server restart broke fails once, discarded).
        `durable=False`: `synchronous_commit=off` for this one transaction (committed without
        waiting for the WAL flush)."""
        lost = rolled_back = 0
        while True:
            stage = _Stage()
            try:
                with (
                    self._unreachable(),
                    self._connection() as conn,
                    conn.transaction(),
                    conn.cursor() as cur,
                ):
                    stage.connected = True
                    if not durable:
                        cur.execute("SET LOCAL synchronous_commit = off")
                    result = work(cur)
                    stage.committing = True
                return result
            except pgerrors.TransactionRollback:
                rolled_back += 1
                if rolled_back == RETRIES:
                    raise
                time.sleep(0.001 * 2 ** (rolled_back - 1))
            except StoreUnreachable:
                lost += 1
                if lost > POOL_MAX or not _lost_early(stage):
                    raise

    def _fetch(self, statement: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """A read; a connection found lost (a pooled one a server restart broke) is replaced,
        up to the pool's size: a read may be asked again."""
        for lost in range(POOL_MAX + 1):
            stage = _Stage()
            try:
                with self._unreachable(), self._connection() as conn:
                    stage.connected = True
                    return conn.execute(statement, args).fetchall()
            except StoreUnreachable:
                if lost == POOL_MAX or not _lost_early(stage):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _notify(self, cur: Cursor, task: str, session: str = "") -> None:
        """Delivered at commit, to every LISTENer of this schema's channel."""
        cur.execute("SELECT pg_notify(%s, %s)", (self._channel, f"{task} {session}"))

    def _serialize_creations(self, cur: Cursor) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (self._create_lock,))

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

    def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
        """Block until a change of one of `topics` (session or task ids; "*": any) is
        notified, or `seconds` pass. The first call only starts listening and returns at once:
        a change between the caller's last read and the LISTEN would otherwise be missed, so
        the caller reads again, now with every later change queued for it."""
        give_up = time.monotonic() + max(0.0, seconds)
        wanted = set(topics)
        with self._listen_lock, self._unreachable():
            if self._listener is None or self._listener.closed or self._listener.broken:
                self._listener = None  # a lost one: listen again, and say so by returning
                listener = self._connect()
                listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                self._listener = listener
                return
            while (left := give_up - time.monotonic()) > 0:
                for note in self._listener.notifies(timeout=left, stop_after=1):
                    if "*" in wanted or wanted & set(note.payload.split()):
                        return


class _Stage:
    """How far one attempt got: a connection in hand, then its work done and COMMIT sent."""

    __slots__ = ("committing", "connected")

    def __init__(self) -> None:
        self.connected = False
        self.committing = False


def _lost_early(stage: _Stage) -> bool:
    """Whether a failed attempt may run again on a fresh connection: it had one (a pooled
    connection idle across a server restart fails at its first use), and it failed before its
    COMMIT was sent, so nothing of it committed. A connection that could not be made is not
    tried again here (the server is down: the caller's own retry policy decides), nor a
    failure at COMMIT, whose outcome is unknown."""
    return stage.connected and not stage.committing


def open_postgres(url: str, *, pooled: bool = True) -> PostgresStore:
    """The store at a postgresql:// URL (`?options=-csearch_path%3Dname` for a schema of its
    own, created if missing). `pooled=False`: one connection, for a process the kernel refuses
    threads (an owner that unshared its PID namespace, `boundary.pidns.threads_refused`)."""
    return PostgresStore(url, pooled=pooled)
