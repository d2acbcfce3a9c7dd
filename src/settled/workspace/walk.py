"""The scanner's hot loops (listing directories, reading small files), and which of two runs.

Owns ``scan_dirs(dirs, workers)``: for each ``(fd, cached, cutoff)``, list the directory open
at ``fd``, lstat every entry relative to it (never following), and split the entries into
``rows`` (name -> the cached ``Entry``, for each file or symlink the stat cache vouches for:
every stat field equal and both timestamps strictly older than ``cutoff``, the racy-git rule)
and ``fresh`` (``(name, os.stat_result)`` of everything else, which the scanner records or
re-reads). An entry gone between the listing and its lstat is left out; any other failure is
that directory's result, an ``OSError`` with the entry's name as ``filename`` when it concerns
one entry (the scanner raises it when it reaches that directory).

And ``read_files(dir_fd, names, limit, workers)``: the files of one directory that the scanner
must read, each opened without following (``O_PATH``), checked to be a regular file of at most
``limit`` bytes by fstat, only then reopened for reading through ``/proc/self/fd`` (one lookup
in that directory, held open: a path walk from ``/proc`` each time cost ~20% more), read one
byte past its size, ``flistxattr``'ed (whether it has any extended attribute: one syscall on
the open file, so the scanner reads names only of the few files that have some) and fstat'd
again: ``(before, data, after, xattrs)``, or None for anything else
(gone, no longer a regular file, larger, unreadable), which the scanner then reads the slow
way, with its own checks and errors. The scanner decides from the two stats whether the read
was torn; nothing here records anything. ``start_reads(dir_fd, names, limit)`` does the same
reads in order on a thread of their own and returns ``take(n)``, which hands out the results
not taken yet up to the n-th name (waiting for them): the scanner hashes what was read while
the rest is read (``ReadAhead``).

Two implementations with one contract: ``_walk`` (C: getdents64, fstatat and the reads without
the GIL on up to ``workers`` threads, the stat cache compared in C; built by ``pip install -e
.``) and the ``python_*`` functions below (one directory, one file at a time). The C one is
used when it imports; ``SETTLED_WALKER=python`` chooses the Python one, and
``SETTLED_WALKER=native`` makes a missing extension an error instead of a fallback. Which one
ran is in every scan's stats (``walker``), so a slow fallback is never silent. The tests run
the scanner over both and compare their results.

Must never: follow a symlink, open a file that fstat did not show to be regular, open anything
else but the directories it is given, or vouch for an entry that the other implementation would
re-read (``reusable`` is the rule for both).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Final, NamedTuple

from settled.errors import SettledError
from settled.workspace.manifest import TYPES, Entry

NATIVE: Final = "native"
PYTHON: Final = "python"
COARSE_FS_SLACK_NS: Final = 2_000_000_000

Fresh = list[tuple[str, os.stat_result]]
Listed = tuple[dict[str, Entry], Fresh]
Job = tuple[int, dict[str, Entry] | None, int]  # fd, the cached rows, their cutoff
ScanDirs = Callable[[list[Job], int], list[Listed | OSError]]
Read = tuple[os.stat_result, bytes, os.stat_result, bool]  # before, the bytes, after, xattrs
ReadFiles = Callable[[int, list[str], int, int], list[Read | None]]
Take = Callable[[int], list[Read | None]]  # the results not taken yet, up to the n-th name
StartReads = Callable[[int, list[str], int], Take]


class Walker(NamedTuple):
    name: str
    scan_dirs: ScanDirs
    read_files: ReadFiles
    start_reads: StartReads


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


_PROC_FD: Final = "/proc/self/fd"


def python_read_files(dir_fd: int, names: list[str], limit: int, workers: int) -> list[Read | None]:
    """The pure Python twin of ``_walk.read_files`` (``workers`` ignored: one at a time)."""
    proc_fd = os.open(_PROC_FD, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return [_read_file(dir_fd, name, limit, proc_fd) for name in names]
    finally:
        os.close(proc_fd)


def python_start_reads(dir_fd: int, names: list[str], limit: int) -> Take:
    """The twin of ``_walk.read_files_start``: the files are read when taken, on the caller's
    thread (no overlap, the same reads)."""
    taken = [0]

    def take(upto: int) -> list[Read | None]:
        start, taken[0] = taken[0], max(taken[0], min(upto, len(names)))
        return python_read_files(dir_fd, names[start : taken[0]], limit, 1)

    return take


def native_start_reads(dir_fd: int, names: list[str], limit: int) -> Take:
    """``_walk.read_files_start``: the files read in order on a thread of the C extension's own
    (no Python on it, so no wait for the GIL before or after a read), taken as they are done."""
    from settled.workspace import _walk

    pending = _walk.read_files_start(dir_fd, names, limit)

    def take(upto: int) -> list[Read | None]:
        return _walk.read_files_take(pending, upto)

    return take


def reopen(path: str, proc_fd: int | None = None) -> int:
    """An ``O_PATH`` fd's file opened for reading through ``/proc/self/fd`` (``path``, relative
    to ``proc_fd`` if given), without updating its atime when this process may (the file's
    owner, or root): a first checkpoint reads every file, and each atime update (relatime: the
    first read since a write) dirties an inode for the journal to commit. Nothing settled
    records or compares reads the atime."""
    try:
        return os.open(path, _READ_FLAGS | os.O_NOATIME, dir_fd=proc_fd)
    except PermissionError:
        return os.open(path, _READ_FLAGS, dir_fd=proc_fd)


_READ_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC


def _read_file(dir_fd: int, name: str, limit: int, proc_fd: int) -> Read | None:
    try:
        path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        before = os.fstat(path_fd)
        if not stat.S_ISREG(before.st_mode) or before.st_size > limit:
            return None
        fd = reopen(str(path_fd), proc_fd)
    except OSError:
        return None
    finally:
        os.close(path_fd)
    try:
        chunks, room = [], before.st_size + 1
        while room > 0 and (chunk := os.read(fd, room)):
            chunks.append(chunk)
            room -= len(chunk)
        data = b"".join(chunks)
        xattrs = _has_xattrs(fd)  # before the second fstat: a change after it moves the ctime
        return before, data, os.fstat(fd), xattrs
    except OSError:
        return None
    finally:
        os.close(fd)


def _has_xattrs(fd: int) -> bool:
    """Whether the open file has an extended attribute (True if that cannot be told)."""
    try:
        return bool(os.listxattr(fd))
    except OSError as error:
        return error.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP)


def _native() -> Walker | None:
    try:
        from settled.workspace import _walk
    except ImportError:
        return None
    if any(Entry._fields[index] != field for field, index in _LAYOUT.items()):
        raise WalkerUnavailable(
            "manifest.Entry's fields moved: update _walk.c's E_* positions and walk._LAYOUT"
        )
    return Walker(NATIVE, _walk.scan_dirs, _walk.read_files, native_start_reads)


def choose(wanted: str | None = None) -> Walker:
    """The walker to use: ``wanted`` (or ``SETTLED_WALKER``), else the C one if built."""
    wanted = wanted or os.environ.get("SETTLED_WALKER") or None
    if wanted not in (None, NATIVE, PYTHON):
        raise WalkerUnavailable(f"SETTLED_WALKER={wanted!r}: expected {NATIVE!r} or {PYTHON!r}")
    if wanted == PYTHON:
        return PYTHON_WALKER
    native = _native()
    if native is not None:
        return native
    if wanted == NATIVE:
        raise WalkerUnavailable(
            "the C walker settled.workspace._walk is not built: reinstall with "
            "`pip install -e .` (it needs gcc and the Python headers)"
        )
    return PYTHON_WALKER


PYTHON_WALKER: Final = Walker(PYTHON, python_scan_dirs, python_read_files, python_start_reads)


READ_SMALL: Final = 64 * 1024 - 1  # read whole by the walker (below sparse.MIN_HOLE: no hole)
READ_AHEAD_BYTES: Final = 8 << 20  # the most of them held at once
READ_TAKE: Final = 16  # overlapped: the reads taken at a time (the first wait is for this many)
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ROOT: Final = "."


class ReadAhead:
    """The small regular files of one listing, read by the walker in batches (without the GIL)
    just before the scanner records them, at most ``READ_AHEAD_BYTES`` at a time; what a batch
    could not read is read the slow way.

    ``overlap`` (two CPUs or more, and more than ``READ_TAKE`` files): a batch is read in order
    on a thread of its own (``start_reads``) while the scanner hashes and stages what was read
    before, taking ``READ_TAKE`` results at a time, so a first checkpoint's reading and hashing
    run side by side instead of in turn. The same files are read by the same checks, and the
    scanner judges each read by its two stats as before. ``close`` waits until no read runs,
    so the directory's fd is never closed (and its number never reused) under one."""

    def __init__(
        self,
        walker: Walker,
        workers: int,
        fd: int,
        kept: list[tuple[str, os.stat_result]],
        overlap: bool = False,
    ) -> None:
        self.walker, self.workers, self.fd = walker, workers, fd
        self.small = [
            (name, st.st_size)
            for name, st in kept
            if stat.S_ISREG(st.st_mode) and st.st_size <= READ_SMALL
        ]
        self.wanted = {name for name, _ in self.small}
        self.next = 0
        self.read: dict[str, Read | None] = {}
        self.overlap = overlap and len(self.small) > READ_TAKE
        self.batch: list[str] = []  # overlapped: the batch being read, and what was taken
        self.taken = 0
        self.take: Take | None = None

    def get(self, name: str) -> Read | None:
        if name not in self.wanted:
            return None
        if name not in self.read:
            self.fetch()
        return self.read.pop(name, None)

    def fetch(self) -> None:
        if not self.overlap:
            names = self._names()
            got = self.walker.read_files(self.fd, names, READ_SMALL, self.workers)
        elif self.take is None:  # a batch's first files are read here while its thread starts
            names = self._names()
            self.batch, self.taken = names[READ_TAKE:], 0
            if self.batch:
                self.take = self.walker.start_reads(self.fd, self.batch, READ_SMALL)
            names = names[:READ_TAKE]
            got = self.walker.read_files(self.fd, names, READ_SMALL, 1)
        else:
            start, self.taken = self.taken, min(self.taken + READ_TAKE, len(self.batch))
            names, got = self.batch[start : self.taken], self.take(self.taken)
            if self.taken == len(self.batch):
                self.take = None  # all taken: its thread has ended
        self.read.update(zip(names, got, strict=True))

    def _names(self) -> list[str]:
        """The next names to read, up to ``READ_AHEAD_BYTES`` (one at least)."""
        names: list[str] = []
        total = 0
        while self.next < len(self.small) and (not names or total < READ_AHEAD_BYTES):
            name, size = self.small[self.next]
            names.append(name)
            total += size
            self.next += 1
        return names

    def close(self) -> None:
        """Wait for the reads of a batch not taken to the end (the scan failed meanwhile)."""
        if self.take is not None:
            take, self.take = self.take, None
            take(len(self.batch))


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def open_beneath(root_fd: int, rel: str) -> int | None:
    """The directory at ``rel`` opened component by component from the root, never following
    a symlink; None if it cannot be (the walk then opens and lists it itself)."""
    fd = root_fd
    try:
        for name in [] if rel == _ROOT else rel.split("/"):
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = sub
    except OSError:
        if fd != root_fd:
            os.close(fd)
        return None
    return fd if fd != root_fd else os.dup(root_fd)


def workers() -> int:
    """Threads for the walker's system calls: one for each CPU this process may run on, at
    most 4. Measured here (2 CPUs, 30,000 files of 100 B, warm): reading them took 7.6 us a
    file on one thread, 5.0 on two, 9-11 on four (every open and close takes the process's
    file table lock); listing and lstat'ing 100,000 entries, 278 ms on one, 165 on two, 177 on
    four."""
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except OSError:
        return 1


_gc_lock = threading.Lock()
_gc_pausers = [0, False]  # scans in progress; whether the collector ran before the first


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the duration (back on when the last concurrent
    scan ends, if it was on before the first). A scan allocates hundreds of thousands of
    entries, stat results and writers, none of them in a cycle, and the collector walking
    them again and again cost ~1 s of CPU in the first checkpoint of 100,000 files here."""
    with _gc_lock:
        if _gc_pausers[0] == 0:
            _gc_pausers[1] = gc.isenabled()
            gc.disable()
        _gc_pausers[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers[0] -= 1
            if _gc_pausers[0] == 0 and _gc_pausers[1]:
                gc.enable()
