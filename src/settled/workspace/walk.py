"""The scanner's per-directory hot loop, and which implementation of it runs.

Owns ``scan_dirs(dirs, workers)``: for each ``(fd, cached, cutoff)``, list the directory open
at ``fd``, lstat every entry relative to it (never following), and split the entries into
``rows`` (name -> the cached ``Entry``, for each file or symlink the stat cache vouches for:
every stat field equal and both timestamps strictly older than ``cutoff``, the racy-git rule)
and ``fresh`` (``(name, os.stat_result)`` of everything else, which the scanner records or
re-reads). An entry gone between the listing and its lstat is left out; any other failure is
that directory's result, an ``OSError`` with the entry's name as ``filename`` when it concerns
one entry (the scanner raises it when it reaches that directory).

Two implementations with one contract: ``_walk.scan_dirs`` (C: getdents64 and fstatat without
the GIL on up to ``workers`` threads, the stat cache compared in C; built by ``pip install -e
.``) and ``python_scan_dirs`` below (``os.scandir`` and ``os.stat``, one directory at a time).
The C one is used when it imports; ``SETTLED_WALKER=python`` chooses the Python one, and
``SETTLED_WALKER=native`` makes a missing extension an error instead of a fallback. Which one
ran is in every scan's stats (``walker``), so a slow fallback is never silent. The tests run
the scanner over both and compare their results.

Must never: follow a symlink, open anything but the directory it is given, or vouch for an
entry that the other implementation would re-read (``scan._verdict`` is the rule for both).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Final

from settled.errors import SettledError
from settled.workspace.manifest import TYPES, Entry

NATIVE: Final = "native"
PYTHON: Final = "python"
COARSE_FS_SLACK_NS: Final = 2_000_000_000

Fresh = list[tuple[str, os.stat_result]]
Listed = tuple[dict[str, Entry], Fresh]
Job = tuple[int, dict[str, Entry] | None, int]  # fd, the cached rows, their cutoff
ScanDirs = Callable[[list[Job], int], list[Listed | OSError]]

# The C loop reads an Entry by position: these must be where it looks (see _walk.c).
_LAYOUT: Final = {
    "type": 1, "mode": 2, "size": 3, "digest": 4, "target": 5, "ino": 7, "dev": 8,
    "mtime_ns": 9, "ctime_ns": 10, "uid": 14, "gid": 15,
}  # fmt: skip


class WalkerUnavailable(SettledError):
    """The walker asked for by ``SETTLED_WALKER`` cannot be used."""


def reusable(cached: Entry, st: os.stat_result, cutoff: int) -> bool:
    """The stat cache vouches for ``cached``: a file or symlink whose type, mode, owner, size,
    ino, dev, mtime_ns and ctime_ns equal the lstat's, both timestamps strictly older than
    ``cutoff`` (2 s less on a filesystem whose ctime is a whole second)."""
    if (cached.digest or cached.target) is None:
        return False
    if not (
        cached.mtime_ns == st.st_mtime_ns
        and cached.ctime_ns == st.st_ctime_ns
        and cached.size == st.st_size
        and cached.ino == st.st_ino
        and cached.dev == st.st_dev
        and cached.mode == stat.S_IMODE(st.st_mode)
        and cached.uid == st.st_uid  # a chown changes ctime too; the owner is in the tree
        and cached.gid == st.st_gid
        and cached.type == TYPES.get(stat.S_IFMT(st.st_mode), "")
    ):
        return False
    return trusted(cached, cutoff)


def trusted(cached: Entry, cutoff: int) -> bool:
    """Racy-git: a stat match proves nothing for a timestamp at or after the cache's cutoff."""
    coarse = cached.ctime_ns % 1_000_000_000 == 0
    limit = cutoff - (COARSE_FS_SLACK_NS if coarse else 0)
    return cached.mtime_ns < limit and cached.ctime_ns < limit


def python_scan_dirs(dirs: list[Job], workers: int) -> list[Listed | OSError]:
    """The pure Python twin of ``_walk.scan_dirs`` (``workers`` is ignored: one at a time)."""
    results: list[Listed | OSError] = []
    for fd, cached, cutoff in dirs:
        try:
            results.append(_scan_dir(fd, cached, cutoff))
        except OSError as error:
            results.append(error)
    return results


def _scan_dir(fd: int, cached: dict[str, Entry] | None, cutoff: int) -> Listed:
    rows: dict[str, Entry] = {}
    fresh: Fresh = []
    with os.scandir(fd) as listing:
        names = [item.name for item in listing]
    known = cached or {}
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # vanished while listed
        except OSError as error:
            error.filename = name
            raise
        entry = known.get(name)
        if entry is not None and reusable(entry, st, cutoff):
            rows[name] = entry
        else:
            fresh.append((name, st))
    return rows, fresh


def _native() -> ScanDirs | None:
    try:
        from settled.workspace import _walk
    except ImportError:
        return None
    if any(Entry._fields[index] != field for field, index in _LAYOUT.items()):
        raise WalkerUnavailable(
            "manifest.Entry's fields moved: update _walk.c's E_* positions and walk._LAYOUT"
        )
    scan_dirs: ScanDirs = _walk.scan_dirs
    return scan_dirs


def choose(wanted: str | None = None) -> tuple[str, ScanDirs]:
    """The walker to use: ``wanted`` (or ``SETTLED_WALKER``), else the C one if built."""
    wanted = wanted or os.environ.get("SETTLED_WALKER") or None
    if wanted not in (None, NATIVE, PYTHON):
        raise WalkerUnavailable(f"SETTLED_WALKER={wanted!r}: expected {NATIVE!r} or {PYTHON!r}")
    if wanted == PYTHON:
        return PYTHON, python_scan_dirs
    native = _native()
    if native is not None:
        return NATIVE, native
    if wanted == NATIVE:
        raise WalkerUnavailable(
            "the C walker settled.workspace._walk is not built: reinstall with "
            "`pip install -e .` (it needs gcc and the Python headers)"
        )
    return PYTHON, python_scan_dirs
