"""Ending a stream whose owner is gone: the log closes at the bytes on disk.

The stream's final cursor is the file's length when recovery looks, and its digest covers
exactly those bytes. Two ways to close it:
- in place (the default): nothing is written, so it works on a full disk. Used when no writer
  can remain: the lost owner's process is gone (its descriptors died with it).
- by copy, when the lost owner's process may still exist (stopped or starved past its lease):
  the file is replaced by a copy of those bytes (through `atomic.replacing`), so a fenced owner
  that wakes up appends to an orphaned inode, never to the log its receipt now names. The copy
  is made only when the filesystem has room for it above the home's reserve; otherwise (or when
  the copy itself runs out of space) the log is closed in place and the fact says so: a woken
  owner's appends then lie past the final cursor, which no reader serves.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import blake3

from settled.atomic import replacing
from settled.errors import HomeUnusable
from settled.home import SPACE_ERRNOS, space_of

COPY_CHUNK = 1 << 20


def close_at_disk(path: str, *, writer_may_live: bool = True) -> dict[str, Any]:
    """The stream fact of a recovered receipt: cursor and digest of the bytes stored."""
    closed = "in place"
    if writer_may_live and os.path.exists(path):
        if _room_for_copy(path):
            try:
                return _fact(*_copy(path), "copied")
            except OSError as exc:
                if exc.errno not in SPACE_ERRNOS:
                    raise
        closed = "in place: no room above the reserve for a copy"
    return _fact(*_hash_in_place(path), closed)


def _fact(size: int, digest: str, closed: str) -> dict[str, Any]:
    return {"cursor": size, "digest": digest, "drained": None, "not_stored": None, "cap": None,
            "closed": closed}  # fmt: skip


def _room_for_copy(path: str) -> bool:
    try:
        return space_of(os.path.dirname(path)).spare > os.stat(path).st_size
    except (OSError, HomeUnusable):
        return False


def _copy(path: str) -> tuple[int, str]:
    hasher = blake3.blake3()
    size = 0
    with open(path, "rb") as source, replacing(path, 0o400) as copy:
        while chunk := source.read(COPY_CHUNK):
            hasher.update(chunk)
            copy.write(chunk)
            size += len(chunk)
    return size, "blake3:" + hasher.hexdigest()


def _hash_in_place(path: str) -> tuple[int, str]:
    """Size and digest of the file as it is now; bytes appended while it is read are not
    counted (the cursor is the size at the start)."""
    hasher = blake3.blake3()
    if not os.path.exists(path):
        return 0, "blake3:" + hasher.hexdigest()
    with open(path, "rb") as source:
        with contextlib.suppress(OSError):  # read-only like a copied log; a metadata change only
            os.fchmod(source.fileno(), 0o400)
        size = os.fstat(source.fileno()).st_size
        left = size
        while left and (chunk := source.read(min(COPY_CHUNK, left))):
            hasher.update(chunk)
            left -= len(chunk)
    return size - left, "blake3:" + hasher.hexdigest()
