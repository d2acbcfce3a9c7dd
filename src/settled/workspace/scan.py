"""The workspace scanner: a stat cache like git's index, and the walk that fills it.

Owns ``scan``, which fills an ``Index`` (entries and their stat cache, defined in ``manifest``):
a walk with directory fds, ``os.scandir`` and lstat that records every entry by type and mode,
hashes regular files (publishing them into an ``ObjectStore`` in the same read: hash and copy
together, link only if new), and re-reads a file only when the stat cache cannot vouch for it.

Stat-cache rules. A file or symlink whose type, mode, size, ino, dev, mtime_ns and ctime_ns equal
the previous index's is not re-read, unless its mtime or ctime is not strictly older than the
previous index's ``trusted_before_ns`` (the racy-git rule). ``trusted_before_ns`` is the wall
clock taken before the walk of a full scan (minus ``CLOCK_SLACK_NS``: the kernel stamps files
from a clock that may lag ``time.time_ns()`` by a tick; 2 s when ctime is a whole second, i.e.
on a filesystem with second timestamps). An incremental scan keeps its previous index's value,
because entries it carries over were vouched for only up to then.

Safety. Nothing outside the root is read: every name is resolved relative to an open directory
fd with ``O_NOFOLLOW``; symlinks are recorded with ``os.readlink``, never followed; FIFOs,
sockets and devices are recorded from lstat and never opened (a regular file is opened as
``O_PATH`` first, checked with fstat, and only then reopened for reading through
``/proc/self/fd``, so even a FIFO swapped in mid-walk is never opened). A file that changes while
it is read is retried, then the scan fails with ``TornRead``; a torn digest is never recorded.
A directory moved elsewhere mid-walk is listed as it was when opened (its fd is held); mount
points inside the root are crossed; hard links are recorded as separate files.

About 500 lines, over the usual 400: the walk, its no-follow checks, the stat cache, torn-read
retries and the incremental mode share one walker's state, and split they would share internals.

Must never: follow a symlink, open a non-regular file, record a torn read, write anything but
store objects, or talk to the settled store or database.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from settled.errors import SettledError
from settled.workspace.hashing import DEFAULT_ALGORITHM, check_algorithm, format_digest, new_hasher
from settled.workspace.manifest import (
    DIR,
    FILE,
    ROOT,
    SYMLINK,
    TYPES,
    Entry,
    Index,
    IndexMismatch,
    check_path,
    join,
)
from settled.workspace.objects import CHUNK, ObjectStore, Publisher

CLOCK_SLACK_NS: Final = 20_000_000
COARSE_FS_SLACK_NS: Final = 2_000_000_000
TORN_ATTEMPTS: Final = 4
TORN_BACKOFF_S: Final = (0.0, 0.005, 0.02, 0.05)

_PROC_FD: Final = "/proc/self/fd"
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ScanError(SettledError):
    """The workspace could not be scanned as asked."""


class TornRead(ScanError):
    def __init__(self, path: str, attempts: int) -> None:
        super().__init__(
            f"{path!r} changed while it was read, {attempts} times in a row; "
            "no digest recorded. Scan again once nothing writes to it."
        )
        self.path, self.attempts = path, attempts


class WorkspaceUnreadable(ScanError):
    def __init__(self, path: str, error: OSError) -> None:
        super().__init__(f"cannot read {path!r} in the workspace: {error.strerror or error}")
        self.path = path


class UnrepresentablePath(ScanError):
    def __init__(self, path: str) -> None:
        super().__init__(f"path {path!r} is not valid UTF-8; rename it to checkpoint it")
        self.path = path


@dataclass
class ScanStats:
    files_hashed: int = 0
    bytes_read: int = 0
    blobs_written: int = 0
    entries_reused: int = 0  # files and symlinks vouched for by the stat cache, not re-read
    entries_carried: int = 0  # incremental mode: entries of directories not re-listed
    dirs_listed: int = 0
    torn_retries: int = 0


@dataclass(frozen=True)
class ScanResult:
    index: Index
    stats: ScanStats = field(default_factory=ScanStats)


def scan(
    root: str | os.PathLike[str],
    previous: Index | None = None,
    store: ObjectStore | None = None,
    algo: str = DEFAULT_ALGORITHM,
    *,
    only: Iterable[str] | None = None,
) -> ScanResult:
    """Scan the tree at ``root``; publish file contents into ``store`` if given.

    ``only``: relative directory paths known dirty (``"."`` is the root). A directory is dirty
    when its own mode changed or any entry directly in it was created, removed, renamed, or
    changed in content, mode or type. Only those are re-listed, new directories found there are
    walked in full, and every other entry is carried over from ``previous``. ``None`` (the
    default) is a full scan, which is what a final scan must be.
    """
    check_algorithm(algo)
    started = time.time_ns()
    previous = _usable(previous, algo, only)
    if not os.path.isdir(_PROC_FD):
        raise ScanError(f"{_PROC_FD} is missing: files could not be opened without following")
    root_fd = os.open(os.fspath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        scanner = _Scanner(root_fd, previous, store, algo)
        scanner.run(only)
    finally:
        os.close(root_fd)
    if only is None or previous is None:
        trusted = started - CLOCK_SLACK_NS
    else:  # carried entries were vouched for only up to the previous cutoff
        trusted = previous.trusted_before_ns
    out = scanner.out
    index = Index(algo, started, trusted, tuple(out[path] for path in sorted(out)))
    return ScanResult(index, scanner.stats)


def _usable(previous: Index | None, algo: str, only: Iterable[str] | None) -> Index | None:
    if only is not None and previous is None:
        raise IndexMismatch("an incremental scan (only=...) needs the previous index")
    if previous is not None and previous.algorithm != algo:
        if only is not None:
            raise IndexMismatch(
                f"previous index uses {previous.algorithm}, this scan {algo}: run a full scan"
            )
        return None  # a full scan in another algorithm: nothing in the cache is usable
    return previous


def _cached_matches(cached: Entry, st: os.stat_result, kind: str) -> bool:
    return (
        cached.mtime_ns == st.st_mtime_ns
        and cached.ctime_ns == st.st_ctime_ns
        and cached.size == st.st_size
        and cached.ino == st.st_ino
        and cached.dev == st.st_dev
        and cached.mode == stat.S_IMODE(st.st_mode)
        and cached.type == kind
    )


def _trusted(cached: Entry, trusted_before_ns: int) -> bool:
    """Racy-git: a stat match proves nothing for a timestamp at or after the cache's cutoff."""
    coarse = cached.ctime_ns % 1_000_000_000 == 0
    cutoff = trusted_before_ns - (COARSE_FS_SLACK_NS if coarse else 0)
    return cached.mtime_ns < cutoff and cached.ctime_ns < cutoff


def _same_link(before: os.stat_result, after: os.stat_result, target: str) -> bool:
    return (before.st_ino, before.st_dev, before.st_ctime_ns) == (
        after.st_ino,
        after.st_dev,
        after.st_ctime_ns,
    ) and after.st_size == len(os.fsencode(target))


def _torn(before: os.stat_result, after: os.stat_result, got: int) -> bool:
    return (
        got != before.st_size
        or after.st_size != before.st_size
        or after.st_mtime_ns != before.st_mtime_ns
        or after.st_ctime_ns != before.st_ctime_ns
        or after.st_ino != before.st_ino
    )


class _Scanner:
    def __init__(
        self, root_fd: int, previous: Index | None, store: ObjectStore | None, algo: str
    ) -> None:
        self.root_fd = root_fd
        self.previous = previous
        self.cache = previous.by_path if previous is not None else {}
        self.trusted_before_ns = previous.trusted_before_ns if previous is not None else 0
        self.store = store
        self.algo = algo
        self.stats = ScanStats()
        self.out: dict[str, Entry] = {}
        self.recorded: set[str] | None = None  # incremental mode: paths recorded afresh
        self.publisher: Publisher | None = None
        self.buffer = bytearray(CHUNK)
        self.view = memoryview(self.buffer)

    # -- modes ---------------------------------------------------------------------------------

    def run(self, only: Iterable[str] | None) -> None:
        """Full or incremental; with a store, inside one batch and through one publisher."""
        with contextlib.ExitStack() as stack:
            if self.store is not None:
                stack.enter_context(self.store.batch())  # exits last: directory fsyncs
                self.publisher = stack.enter_context(Publisher())
            if only is None or self.previous is None:
                self.full()
            else:
                self.incremental(only)
            if self.publisher is not None:
                self.publisher.close()  # every blob durable before the scan returns
                self.stats.blobs_written = self.publisher.created

    def full(self) -> None:
        self.out[ROOT] = Entry.from_stat(ROOT, os.fstat(self.root_fd))
        self.walk(self.root_fd, ROOT)

    def incremental(self, only: Iterable[str]) -> None:
        self.out = dict(self.cache)
        self.recorded = set()
        self.record(Entry.from_stat(ROOT, os.fstat(self.root_fd)))
        walked: set[str] = set()
        for rel in sorted({_normalize_dirty(path) for path in only}):
            if any(ancestor in walked for ancestor in _self_and_ancestors(rel)):
                continue
            fd, opened = self.open_nearest(rel)
            try:
                self.relist(fd, opened, walked)
            finally:
                if fd != self.root_fd:
                    os.close(fd)
        self.stats.entries_carried = len(self.out) - len(self.recorded)

    # -- walking -------------------------------------------------------------------------------

    def walk(self, top_fd: int, top: str) -> None:
        """List ``top`` and everything below it, holding one directory fd per level."""
        stack = [(top, top_fd, self.list_dir(top_fd, top)[1])]
        try:
            while stack:
                rel, fd, pending = stack[-1]
                if not pending:
                    stack.pop()
                    if fd != top_fd:
                        os.close(fd)
                    continue
                child = join(rel, pending.pop())
                sub = self.open_subdir(fd, child)
                if sub is not None:
                    stack.append((child, sub, self.list_dir(sub, child)[1]))
        finally:
            for _, fd, _ in stack:
                if fd != top_fd:
                    os.close(fd)

    def list_dir(self, fd: int, rel: str) -> tuple[set[str], list[str]]:
        """Record every child of the directory open at ``fd``; return names and subdir names."""
        self.stats.dirs_listed += 1
        try:
            with os.scandir(fd) as listing:
                names = sorted(item.name for item in listing)
        except OSError as error:
            raise WorkspaceUnreadable(rel, error) from error
        present, subdirs = set(), []
        for name in names:
            child = join(rel, name)
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise UnrepresentablePath(child) from None
            st = self.lstat(fd, name, child)
            entry = None if st is None else self.entry(fd, name, child, st)
            if entry is None:
                continue  # vanished while listed
            self.record(entry)
            present.add(name)
            if entry.type == DIR:
                subdirs.append(name)
        subdirs.reverse()  # popped from the end: walk in sorted order
        return present, subdirs

    def record(self, entry: Entry) -> None:
        self.out[entry.path] = entry
        if self.recorded is not None:
            self.recorded.add(entry.path)

    def open_subdir(self, fd: int, child: str) -> int | None:
        """Open a child directory without following; re-record it if it changed since lstat."""
        name = child.rpartition("/")[2]
        for _ in range(TORN_ATTEMPTS):
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                if error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise WorkspaceUnreadable(child, error) from error
                st = self.lstat(fd, name, child)
                entry = None if st is None else self.entry(fd, name, child, st)
                if entry is None:
                    self.out.pop(child, None)
                    return None
                if entry.type != DIR:  # replaced (by a symlink, say): recorded, never entered
                    self.record(entry)
                    return None
                continue  # replaced by another directory: open that one
            self.record(Entry.from_stat(child, os.fstat(sub)))
            return sub
        raise TornRead(child, TORN_ATTEMPTS)

    def lstat(self, fd: int, name: str, child: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise WorkspaceUnreadable(child, error) from error

    # -- entries -------------------------------------------------------------------------------

    def entry(
        self, fd: int, name: str, child: str, st: os.stat_result, budget: int = TORN_ATTEMPTS
    ) -> Entry | None:
        """The entry for ``child`` given its lstat: from the stat cache, or read afresh."""
        if budget <= 0:
            raise TornRead(child, TORN_ATTEMPTS)
        kind = TYPES.get(stat.S_IFMT(st.st_mode))
        if kind not in (FILE, SYMLINK):
            return Entry.from_stat(child, st)
        cached = self.cache.get(child)
        if (
            cached is not None
            and _cached_matches(cached, st, kind)
            and (cached.digest or cached.target) is not None
            and _trusted(cached, self.trusted_before_ns)
        ):
            self.stats.entries_reused += 1
            return cached
        if kind == SYMLINK:
            return self.read_link(fd, name, child, st, budget)
        return self.read_file(fd, name, child, budget)

    def read_link(
        self, fd: int, name: str, child: str, before: os.stat_result, budget: int
    ) -> Entry | None:
        for _ in range(TORN_ATTEMPTS):
            try:
                target = os.readlink(name, dir_fd=fd)
                after = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            except OSError as error:
                raise WorkspaceUnreadable(child, error) from error
            if not stat.S_ISLNK(after.st_mode):
                return self.entry(fd, name, child, after, budget - 1)
            if _same_link(before, after, target):
                try:
                    target.encode("utf-8")
                except UnicodeEncodeError:
                    raise UnrepresentablePath(f"{child} -> {target}") from None
                return Entry.from_stat(child, after, target=target)
            before = after
            self.stats.torn_retries += 1
        raise TornRead(child, TORN_ATTEMPTS)

    def read_file(self, fd: int, name: str, child: str, budget: int) -> Entry | None:
        for attempt in range(TORN_ATTEMPTS):
            if attempt:
                time.sleep(TORN_BACKOFF_S[attempt])
            opened = self.open_regular(fd, name, child)
            if opened is None:
                return None
            if isinstance(opened, os.stat_result):  # no longer a regular file
                return self.entry(fd, name, child, opened, budget - 1)
            file_fd, before = opened
            try:
                digest = self.hash_open_file(file_fd, before)
            finally:
                os.close(file_fd)
            if digest is not None:
                self.stats.files_hashed += 1
                return Entry.from_stat(child, before, digest=digest)
            self.stats.torn_retries += 1
        raise TornRead(child, TORN_ATTEMPTS)

    def open_regular(
        self, fd: int, name: str, child: str
    ) -> tuple[int, os.stat_result] | os.stat_result | None:
        """``(fd, stat)`` of the file opened for reading, its stat if it is no longer a regular
        file, or None if it is gone. Opens nothing but a regular file."""
        try:
            path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                st = os.fstat(path_fd)
                if not stat.S_ISREG(st.st_mode):
                    return st
                return os.open(f"{_PROC_FD}/{path_fd}", os.O_RDONLY | os.O_CLOEXEC), st
            finally:
                os.close(path_fd)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise WorkspaceUnreadable(child, error) from error

    def hash_open_file(self, fd: int, before: os.stat_result) -> str | None:
        """Hash (and publish) the open file; None if it changed while it was read."""
        size = before.st_size
        if self.store is None or self.publisher is None:
            hasher = new_hasher(self.algo, size_hint=size)
            got = self._read_all(fd, size, hasher.update)
            torn = _torn(before, os.fstat(fd), got)
            return None if torn else format_digest(self.algo, hasher.hexdigest())
        writer = self.store.writer(self.algo, size_hint=size)
        try:
            got = self._read_all(fd, size, writer.write)
            torn = _torn(before, os.fstat(fd), got)
        except BaseException:
            writer.abort()
            raise
        if torn:
            writer.abort()  # nothing is linked
            return None
        digest = writer.digest()
        self.publisher.submit(writer)  # fsync and link on a publisher thread
        return digest

    def _read_all(self, fd: int, size: int, sink: Callable[[memoryview], object]) -> int:
        got = 0
        view = self.view
        while got <= size:  # read past the size: a file that grew is torn
            count = os.readv(fd, [self.buffer])
            if not count:
                break
            sink(view[:count])
            got += count
            if count < CHUNK and got >= size:
                break  # a short read at the size is the end; growth after it shows in fstat
        self.stats.bytes_read += got
        return got

    # -- incremental ---------------------------------------------------------------------------

    def open_nearest(self, rel: str) -> tuple[int, str]:
        """Open ``rel`` component by component without following; stop at the deepest directory
        that still is the one the previous index knew (its parent must be re-listed)."""
        fd, opened = self.root_fd, ROOT
        for name in [] if rel == ROOT else rel.split("/"):
            child = join(opened, name)
            known = self.cache.get(child)
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                break
            st = os.fstat(sub)
            if (
                known is None
                or known.type != DIR
                or (known.ino, known.dev) != (st.st_ino, st.st_dev)
            ):
                os.close(sub)
                break
            if fd != self.root_fd:
                os.close(fd)
            fd, opened = sub, child
        return fd, opened

    def relist(self, fd: int, rel: str, walked: set[str]) -> None:
        self.record(Entry.from_stat(rel, os.fstat(fd)))  # its own mtime (and mode) moved too
        names, subdirs = self.list_dir(fd, rel)
        for old in self.previous_children(rel):
            if old.rpartition("/")[2] not in names:
                self.out.pop(old, None)
                self.forget_below(old)
            elif self.out[old].type != DIR:
                self.forget_below(old)  # a directory replaced by a file or link
        for name in reversed(subdirs):
            child = join(rel, name)
            known, now = self.cache.get(child), self.out[child]
            if (
                known is not None
                and known.type == DIR
                and (known.ino, known.dev) == (now.ino, now.dev)
            ):
                continue  # same directory: its contents are carried (or re-listed if dirty)
            self.forget_below(child)
            sub = self.open_subdir(fd, child)
            if sub is not None:
                try:
                    self.walk(sub, child)
                finally:
                    os.close(sub)
                walked.add(child)

    def previous_children(self, rel: str) -> list[str]:
        prefix = "" if rel == ROOT else rel + "/"
        return [p for p in self._previous_below(prefix) if "/" not in p[len(prefix) :]]

    def forget_below(self, rel: str) -> None:
        for path in self._previous_below(rel + "/"):
            self.out.pop(path, None)

    def _previous_below(self, prefix: str) -> list[str]:
        paths = self.previous.paths if self.previous is not None else []
        start = bisect.bisect_left(paths, prefix)
        end = len(paths) if not prefix else bisect.bisect_left(paths, prefix[:-1] + "0")
        return [p for p in paths[start:end] if p != ROOT]


def _normalize_dirty(path: str) -> str:
    return check_path(path.rstrip("/") or ROOT)


def _self_and_ancestors(rel: str) -> list[str]:
    parts = rel.split("/")
    return [ROOT] + ["/".join(parts[: i + 1]) for i in range(len(parts))] if rel != ROOT else [ROOT]
