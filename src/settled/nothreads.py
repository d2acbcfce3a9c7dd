"""Whether this process may still start a thread (or a thread pool): an owner says no once its
command runs.

An owner starts every thread it needs (its first drain, its lease keeper, its log flusher)
before its command starts, and none after: under a fork storm the host may have no task left to
give (pid_max, threads-max), and an owner that needed one to enforce its deadline or write its
receipt would fail exactly when it matters. What could start one later asks here first and does
its work on the calling thread instead: the store's write gate (store/gate.py), BLAKE3's thread
pool and the S3 store's concurrent requests (objects/hashing.py), a PostgreSQL pool (the owner
opens its stores with `threads=False`).

Standard library only; no state but one process-wide answer. Must never start anything itself.
"""

from __future__ import annotations

_REFUSED: list[str] = []


def refuse(why: str) -> None:
    """From now on this process starts no thread; `why` is said to whoever asks."""
    if not _REFUSED:
        _REFUSED.append(why)


def refused() -> str | None:
    """Why this process may start no thread, or None when it may."""
    return _REFUSED[0] if _REFUSED else None
