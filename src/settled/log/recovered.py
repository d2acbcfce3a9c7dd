"""Ending a stream whose owner is gone: the log closes at the bytes on disk.

The file is replaced by a copy of exactly those bytes (through `atomic.replacing`), so a fenced
owner that wakes up appends to an orphaned inode, never to the log its receipt now names.
"""

from __future__ import annotations

import os
from typing import Any

import blake3

from settled.atomic import replacing

COPY_CHUNK = 1 << 20


def close_at_disk(path: str) -> dict[str, Any]:
    """The stream fact of a recovered receipt: cursor and digest of the bytes stored."""
    hasher = blake3.blake3()
    size = 0
    if os.path.exists(path):
        with open(path, "rb") as source, replacing(path, 0o400) as copy:
            while chunk := source.read(COPY_CHUNK):
                hasher.update(chunk)
                copy.write(chunk)
                size += len(chunk)
    return {"cursor": size, "digest": "blake3:" + hasher.hexdigest(), "drained": None,
            "not_stored": None, "cap": None}  # fmt: skip
