"""Where the stat cache lives: its nodes by ref, in one SQLite file beside the object store.

Owns ``NodeCache``: ``read(ref)`` and ``put_many`` over a table of ``(ref, bytes)``, in
``<home>/index.db``, and the window of each scan that listed nodes (``record_window``,
``window``: when it started and ended, by the cutoff its nodes carry; ``cachetrust`` judges a
node by it, and a window that is lost only costs a re-read). Why not the object store: a
node is a cache whose every load is checked
against its ref (``index.parse_node``), so it needs neither a file of its own nor an fsync. On
this machine's disk a file create cost 0.03-0.8 ms depending on load, and nodes were a third of
the files a checkpoint created (101 of 305 after changing 100 files in 100 directories); here a
checkpoint's nodes are one transaction. WAL with ``synchronous=NORMAL``: a crash may lose the
last nodes written, never corrupt older ones, and a lost node makes the next scan run without
the cache (``IndexMismatch``), which costs time, not correctness.

The file is the owner's alone (0600, like everything in the settled home; SQLite gives its
``-wal`` and ``-shm`` files the database file's mode), and so is the verified-object record that
shares it (``verified``).

Must never: hold anything a checkpoint's correctness depends on (blobs, trees and manifests
live in the object store); be read without the caller checking the bytes against the ref.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable

from settled.errors import HomeUnusable
from settled.home import private_file, storage_error
from settled.localdb import BUSY_TIMEOUT_S, disk_error, enable_wal
from settled.objects import ObjectMissing


class NodeCache:
    """Stat-cache nodes (and index roots) by ref; safe to share between threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(
                private_file(path),
                timeout=BUSY_TIMEOUT_S,
                isolation_level=None,
                check_same_thread=False,
            )
            enable_wal(self._db, path)
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS nodes (ref TEXT PRIMARY KEY, data BLOB NOT NULL) "
                "WITHOUT ROWID"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS scan_windows (trusted_before_ns INTEGER PRIMARY KEY, "
                "started_ns INTEGER NOT NULL, ended_ns INTEGER NOT NULL)"
            )
        except (sqlite3.Error, OSError) as error:
            typed = (
                disk_error(error, path, "opening the stat cache")
                if isinstance(error, sqlite3.Error)
                else storage_error(error, os.path.dirname(path), "opening the stat cache")
            )
            if typed is not None:
                raise typed from error
            raise HomeUnusable(f"cannot open the stat cache at {path}: {error}") from error

    def read(self, ref: str) -> bytes:
        with self._lock:
            row = self._db.execute("SELECT data FROM nodes WHERE ref=?", (ref,)).fetchone()
        if row is None:
            raise ObjectMissing(ref)
        data = row[0]  # TEXT only if someone else wrote the row: the ref check will judge it
        return data.encode("utf-8") if isinstance(data, str) else bytes(data)

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Store every ``(ref, bytes)`` in one transaction; a ref already present is kept."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT OR IGNORE INTO nodes VALUES (?, ?)", items)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def record_window(self, trusted_before_ns: int, started_ns: int, ended_ns: int) -> None:
        """When the scan whose nodes carry ``trusted_before_ns`` ran (``cachetrust``)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO scan_windows VALUES (?, ?, ?)",
                (trusted_before_ns, started_ns, ended_ns),
            )

    def window(self, trusted_before_ns: int) -> tuple[int, int] | None:
        """The ``(started_ns, ended_ns)`` of the scan that listed nodes with that cutoff."""
        with self._lock:
            row = self._db.execute(
                "SELECT started_ns, ended_ns FROM scan_windows WHERE trusted_before_ns=?",
                (trusted_before_ns,),
            ).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def close(self) -> None:
        with self._lock:
            self._db.close()
