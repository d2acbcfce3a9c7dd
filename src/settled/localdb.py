"""The connection settings every embedded SQLite database of settled uses.

Owns ``BUSY_TIMEOUT_S``, ``enable_wal`` and ``disk_error``: the authority store
(``store.sqlite``), the stat cache's nodes (``workspace.nodecache``) and the verified-object
record (``workspace.verified``) are each a local SQLite file in WAL mode whose writers queue on
one busy timeout. They live here, not in the authority store's module, so that the workspace
never imports the store's implementation to open a database of its own.

Must never: know a schema, open a database itself, or decide a synchronous level (each caller
picks its own: ``FULL`` for receipts, ``NORMAL`` for caches).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time

from settled.errors import HomeUnusable, StorageFailed
from settled.home import storage_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

BUSY_TIMEOUT_S: Final = 60.0
SQLITE_IOERR, SQLITE_FULL = 10, 13  # primary result codes (the low byte of an extended one)


def disk_error(
    exc: sqlite3.Error, path: str, what: str = "writing to the store"
) -> StorageFailed | None:
    """The typed error for SQLite's "disk is full" and I/O errors, None for any other: a full
    or failing disk is the disk's failure (retry when there is space), never a bad home."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code == SQLITE_FULL:
        number = errno.ENOSPC
    elif code == SQLITE_IOERR:
        number = errno.EIO
    else:
        return None
    error = OSError(number, f"{os.strerror(number)} ({exc})", path)
    return storage_error(error, os.path.dirname(path), what)


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
