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
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

from settled.errors import HomeUnusable, StorageFailed
from settled.home import (
    check_store_present,
    home_id_path,
    private_file,
    read_home_id,
    write_home_id_once,
)
from settled.identity import new_id
from settled.localdb import BUSY_TIMEOUT_S, disk_error, enable_wal
from settled.store import gate, schema
from settled.store.dialect import SQLITE
from settled.store.schema import SCHEMA_VERSION, refuse_newer
from settled.store.sql import SQLStore

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")


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


class SQLiteStore(SQLStore):
    """One connection per instance; one instance per process (owners open their own). Every
    statement and method body is `SQLStore`'s; this class brings the connection, the write
    transaction (`_transact`), the migration under the write lock and the home's identity."""

    dialect = SQLITE

    def __init__(self, path: str, home: str | None = None) -> None:
        super().__init__()
        self.path = path
        self.home = home or os.path.dirname(path)
        self._turn_key = os.path.realpath(path)  # one turn for every name of the file
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

    def _fetch(self, statement: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return self._db.execute(statement, args).fetchall()

    def _transact(self, work: Callable[[sqlite3.Connection], T], *, durable: bool = True) -> T:
        """`durable=False`: synchronous=NORMAL for this one transaction (no WAL fsync); set
        before the turn is taken, as FULL is again after it is given back."""
        if not durable:
            self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            with self._write() as db:
                return work(db)
        finally:
            if not durable:
                self._db.execute("PRAGMA synchronous=FULL")

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

    def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
        """A bounded sleep: SQLite sends no notifications, and a waiter on this host is woken
        by its owner's exit handle instead."""
        del topics
        time.sleep(max(0.0, seconds))


def open_sqlite(home: str, path: str | None = None) -> SQLiteStore:
    """The home's SQLite store, at `path` when the home was bound to one elsewhere."""
    return SQLiteStore(path or os.path.join(home, "settled.db"), home)
