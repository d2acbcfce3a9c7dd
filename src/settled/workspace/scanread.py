"""Reading one file or symlink of a scan: its bytes hashed (and published) from a read that
did not tear, its target read between two lstats of the same link.

Owns ``FileReader``, the part of a scan (``scan``) that opens and reads: a regular file is
opened ``O_PATH | O_NOFOLLOW`` first, checked with fstat, and only then reopened for reading
through ``/proc/self/fd`` (a FIFO or device swapped in is never opened); it is read whole (or,
if sparse, data range by data range, its holes hashed as zeros and never read), hashed and
handed to the object store's writer in the same pass, and fstat again: a read the rules call
torn (``scanrules.changed_while_read``) is aborted, nothing of it linked, and retried
``TORN_ATTEMPTS`` times with a backoff before ``TornRead``. A file with other links that this
scan already read takes that read's digest when ``scanrules.hard_link_verdict`` allows. A
small file the walker read ahead is judged by the same rule (``from_read``). Also owns
``ScanStats``, the counters a scan keeps (most of them counted here).

Must never: follow a symlink, open anything but a regular file for reading, record or publish a
torn read, hold more than one chunk (``CHUNK``) of a file in memory, or decide what an entry of
another type is (a file that is no longer one is handed back as its stat, for the scanner).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from settled.objects import CHUNK, ObjectStore
from settled.objects.hashing import Hasher, format_digest, new_hasher
from settled.workspace.manifest import Entry
from settled.workspace.publish import Publisher
from settled.workspace.scanerrors import HolesOverBudget, TornRead, WorkspaceUnreadable
from settled.workspace.scanrules import (
    REUSE,
    LinkRead,
    changed_while_read,
    hard_link_verdict,
    range_changed_while_read,
    symlink_unchanged,
)
from settled.workspace.sparse import (
    Extent,
    data_ranges,
    hash_zeros,
    holes_budget,
    may_have_holes,
    unallocated,
)
from settled.workspace.walk import Read, reopen

TORN_ATTEMPTS: Final = 4
TORN_BACKOFF_S: Final = (0.0, 0.005, 0.02, 0.05)
PROC_FD: Final = "/proc/self/fd"


@dataclass
class ScanStats:
    """What one scan did, counted as it went (the reads here, the listings by ``scan``)."""

    files_hashed: int = 0
    bytes_read: int = 0
    blobs_written: int = 0
    entries_reused: int = 0  # files and symlinks vouched for by the stat cache, not re-read
    entries_carried: int = 0  # incremental mode: entries of directories not re-listed
    dirs_listed: int = 0
    torn_retries: int = 0
    trees_built: int = 0  # directories whose tree changed (published when a store is given)
    nodes_built: int = 0  # directories whose stat-cache node changed
    objects_grouped: int = 0  # objects made durable by one group sync, not an fsync each
    sparse_files: int = 0  # files read as data extents and holes (the holes never read)
    hole_bytes: int = 0  # what the hashed files' holes added to the hash (sparse.holes_budget)
    links_reused: int = 0  # hard links given the digest of another link read in this scan
    # directories whose cached rows were not evidence (``cachetrust``: a session could have
    # written a mapped page unseen since they were listed), so every file in them was re-read
    dirs_unvouched: int = 0
    walker: str = ""  # which scan_dir listed the directories: "native" (C) or "python"


class FileReader:
    """Reads the files and symlinks of one scan into entries: hashed in ``algo``, published
    through ``publisher`` when the scan has a store (set once it opens), counted in ``stats``.
    ``hashed``: every object of the files read (the scan's blobs); ``links``: the read of each
    multiply-linked file, by (dev, ino), that its other links may take."""

    def __init__(self, algo: str, store: ObjectStore | None, stats: ScanStats) -> None:
        self.algo = algo
        self.store = store
        self.stats = stats
        self.publisher: Publisher | None = None
        self.hashed: set[str] = set()
        self.links: dict[tuple[int, int], LinkRead] = {}
        self.holes_budget = holes_budget()
        self.buffer = bytearray(CHUNK)
        self.view = memoryview(self.buffer)

    def from_read(self, child: str, read: Read) -> Entry | None:
        """The entry of a small file the walker read whole (None if the read was torn: the
        file is then read again the slow way, with its retries)."""
        before, data, after, _ = read
        if changed_while_read(before, after, len(data)):
            self.stats.torn_retries += 1
            return None
        if self.publisher is None:
            hasher = new_hasher(self.algo, size_hint=len(data))
            hasher.update(data)
            digest = format_digest(self.algo, hasher.hexdigest())
        else:  # staged into the group's pack, or committed
            digest = self.publisher.submit_bytes(data, self.algo)
        self.stats.files_hashed += 1
        self.stats.bytes_read += len(data)
        self.hashed.add(digest)
        return Entry.from_stat(child, before, digest=digest)

    def read_link(
        self, fd: int, name: str, child: str, before: os.stat_result
    ) -> Entry | os.stat_result | None:
        """The entry of the symlink ``before`` described, its target read between two lstats
        of the same link (retried while it changes); its lstat if it is no longer a symlink,
        None if it is gone."""
        for _ in range(TORN_ATTEMPTS):
            try:
                target = os.readlink(name, dir_fd=fd)
                after = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            except OSError as error:
                raise WorkspaceUnreadable(child, error) from error
            if not stat.S_ISLNK(after.st_mode):
                return after
            if symlink_unchanged(before, after, target):
                return Entry.from_stat(child, after, target=target)
            before = after
            self.stats.torn_retries += 1
        raise TornRead(child, TORN_ATTEMPTS)

    def read_file(self, fd: int, name: str, child: str) -> Entry | os.stat_result | None:
        """The entry of the regular file ``name``, hashed (and published) from one read that
        did not tear (retried with a backoff while it does), or the digest another link of it
        got in this scan; its stat if it is no longer a regular file, None if it is gone."""
        for attempt in range(TORN_ATTEMPTS):
            if attempt:
                time.sleep(TORN_BACKOFF_S[attempt])
            opened = self.open_regular(fd, name, child)
            if opened is None:
                return None
            if isinstance(opened, os.stat_result):  # no longer a regular file
                return opened
            file_fd, before = opened
            linked = self.linked_entry(child, before)
            if linked is not None:
                os.close(file_fd)
                return linked
            holes = unallocated(before)
            left = self.holes_budget - self.stats.hole_bytes
            if holes > left:
                os.close(file_fd)
                raise HolesOverBudget(child, before.st_size, holes, left, self.holes_budget)
            read_at = time.time_ns()
            try:
                ranges = data_ranges(file_fd, before.st_size) if may_have_holes(before) else None
                if ranges is None:
                    digest, extents = self.hash_open_file(file_fd, before), None
                else:
                    digest, extents = self.hash_sparse_file(file_fd, before, ranges)
            finally:
                os.close(file_fd)
            if digest is not None:
                entry = Entry.from_stat(child, before, digest=digest, extents=extents)
                self.stats.files_hashed += 1
                self.stats.sparse_files += extents is not None
                self.stats.hole_bytes += holes
                if before.st_nlink > 1:
                    self.links[(before.st_dev, before.st_ino)] = LinkRead(
                        before.st_size, before.st_mtime_ns, before.st_ctime_ns, read_at,
                        digest, extents,
                    )  # fmt: skip
                self.hashed.update(entry.blobs())
                return entry
            self.stats.torn_retries += 1
        raise TornRead(child, TORN_ATTEMPTS)

    def linked_entry(self, child: str, st: os.stat_result) -> Entry | None:
        """The entry of a hard link whose file this scan read through another link, if
        ``scanrules.hard_link_verdict`` lets it take that read's digest; None: read it."""
        known = self.links.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        if hard_link_verdict(st, known) != REUSE:
            return None
        assert known is not None
        self.stats.links_reused += 1
        return Entry.from_stat(child, st, digest=known.digest, extents=known.extents)

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
                return reopen(f"{PROC_FD}/{path_fd}"), st
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
            torn = changed_while_read(before, os.fstat(fd), got)
            return None if torn else format_digest(self.algo, hasher.hexdigest())
        writer = self.store.writer(self.algo, size_hint=size)
        try:
            got = self._read_all(fd, size, writer.write)
            torn = changed_while_read(before, os.fstat(fd), got)
        except BaseException:
            writer.abort()
            raise
        if torn:
            writer.abort()  # nothing is linked
            return None
        digest = writer.digest()
        self.publisher.submit(writer)  # fsync and link on a publisher thread
        return digest

    def hash_sparse_file(
        self, fd: int, before: os.stat_result, ranges: list[tuple[int, int]]
    ) -> tuple[str | None, tuple[Extent, ...]]:
        """Hash the whole logical content (holes as zeros, never read) and publish each data
        range as an object of its own; (None, ()) if the file changed while it was read. Each
        range is checked unchanged (fstat) before it is handed to the publisher, so what a torn
        read publishes is at most what was read before the change, never a torn object."""
        size = before.st_size
        logical = new_hasher(self.algo, size_hint=size)
        extents: list[Extent] = []
        pos = 0
        for offset, length in ranges:
            hash_zeros(logical, offset - pos)
            digest = self._hash_range(fd, before, offset, length, logical)
            if digest is None:
                return None, ()
            extents.append((offset, length, digest))
            pos = offset + length
        hash_zeros(logical, size - pos)
        # a file of holes only was never checked yet
        if changed_while_read(before, os.fstat(fd), size):
            return None, ()
        return format_digest(self.algo, logical.hexdigest()), tuple(extents)

    def _hash_range(
        self, fd: int, before: os.stat_result, offset: int, length: int, logical: Hasher
    ) -> str | None:
        """One data range: hashed into ``logical`` and into its own object, published if the
        file is unchanged after it (else None, nothing published)."""
        if self.store is None or self.publisher is None:
            own = new_hasher(self.algo, size_hint=length)
            got = self._read_range(fd, offset, length, (logical.update, own.update))
            torn = range_changed_while_read(before, os.fstat(fd), got, length)
            return None if torn else format_digest(self.algo, own.hexdigest())
        writer = self.store.writer(self.algo, size_hint=length)
        try:
            got = self._read_range(fd, offset, length, (logical.update, writer.write))
            torn = range_changed_while_read(before, os.fstat(fd), got, length)
        except BaseException:
            writer.abort()
            raise
        if torn:
            writer.abort()
            return None
        digest = writer.digest()
        self.publisher.submit(writer)  # fsync and link on a publisher thread
        return digest

    def _read_range(
        self,
        fd: int,
        offset: int,
        length: int,
        sinks: tuple[Callable[[memoryview], object], Callable[[memoryview], object]],
    ) -> int:
        """Read ``length`` bytes at ``offset`` into both sinks (fewer only if the file shrank)."""
        got = 0
        view = self.view
        first, second = sinks
        while got < length:
            count = os.preadv(fd, [view[: min(CHUNK, length - got)]], offset + got)
            if not count:
                break
            first(view[:count])
            second(view[:count])
            got += count
        self.stats.bytes_read += got
        return got

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
