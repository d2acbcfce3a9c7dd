"""The connection settings every embedded SQLite database of settled uses.

Owns ``BUSY_TIMEOUT_S`` and ``enable_wal``: the authority store (``store.sqlite``), the stat
cache's nodes (``workspace.nodecache``) and the verified-object record (``workspace.verified``)
are each a local SQLite file in WAL mode whose writers queue on one busy timeout. They live here,
not in the authority store's module, so that the workspace never imports the store's
implementation to open a database of its own.

Must never: know a schema, open a database itself, or decide a synchronous level (each caller
picks its own: ``FULL`` for receipts, ``NORMAL`` for caches).
"""

from __future__ import annotations

import sqlite3
import time
from typing import Final

from settled.errors import HomeUnusable

BUSY_TIMEOUT_S: Final = 60.0


def enable_wal(db: sqlite3.Connection, path: str) -> None:
    """Switching to WAL takes an exclusive lock and answers SQLITE_BUSY without consulting
    the busy timeout, so concurrent first opens of a fresh database retry here."""
    give_up = time.monotonic() + BUSY_TIMEOUT_S
    pause = 0.001
    while True:
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > give_up:
                raise
        else:
            if mode == "wal":
                return
            raise HomeUnusable(f"the database at {path} cannot use WAL (mode {mode!r})")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
