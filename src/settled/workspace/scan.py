"""The workspace scanner: a stat cache like git's index, and the walk that fills it.

Owns ``scan``, which builds an ``Index`` (per-directory stat-cache nodes, defined in ``index``,
each naming the tree object its directory hashes to): a walk with directory fds that lists and
lstats every entry (``walk``: a C loop without the GIL, or its pure Python twin), records every
entry by type and mode, hashes regular files (``scanread``: publishing them into an
``ObjectStore`` in the same read, hash and copy together, stored only if new), re-reads a file
only when the stat cache cannot vouch for it, and publishes the trees it built once every blob
they name is durable (and its stat-cache nodes into the ``NodeCache``). Speed without a weaker
proof: siblings (and an incremental scan's dirty directories) are listed together on the
walker's threads, the small files of a listing are read in batches by the same checks as one at
a time, on a thread while the scanner hashes what was read before (``ReadAhead``), and the
cyclic GC is paused while a scan allocates its entries (``gc_paused``).

Stat-cache rules (each a pure function with a named answer in ``scanrules``, as are the torn
read, symlink and hard-link rules below). A file or symlink whose type, mode, owner, size, ino,
dev, mtime_ns and ctime_ns equal its previous node's row is not re-read, unless its mtime or
ctime is not strictly older than that node's ``trusted_before_ns`` (the racy-git rule). A node
listed by this scan is trusted up to the wall clock taken before the walk (minus
``CLOCK_SLACK_NS``: the kernel stamps files from a clock that may lag ``time.time_ns()`` by a
tick; 2 s when ctime is a whole second, i.e. on a filesystem with second timestamps). A
directory whose rows come out exactly as before, with nothing re-read for being racy, keeps its
previous node (and cutoff), so an unchanged directory costs no new object. An incremental scan
rebuilds the nodes of the dirty directories (listed afresh) and of their ancestors (their old
rows, with the changed child's row replaced), and carries every other directory by reference.

Safety. Nothing outside the root is read: every name is resolved relative to an open directory
fd with ``O_NOFOLLOW``; symlinks are recorded with ``os.readlink``, never followed; FIFOs,
sockets and devices are recorded from lstat and never opened (a regular file is opened as
``O_PATH`` first, checked with fstat, and only then reopened for reading through
``/proc/self/fd``, so even a FIFO swapped in mid-walk is never opened). A file that changes while
it is read is retried, then the scan fails with ``TornRead``; a torn digest is never recorded.
A sparse file (``sparse.data_ranges``: holes found with ``SEEK_DATA``/``SEEK_HOLE`` on the
open file) is read range by range, each data range an object of its own, its holes never read
and hashed as zeros into its digest; the same fstat checks (after every range) make a change
during the read a torn read. A directory moved elsewhere mid-walk is listed as it was when
opened (its fd is held); mount points inside the root are crossed. Hard links: a file with
other links (``st_nlink > 1``) records its group's key (``manifest.link_key`` of its device
and inode: every link of it in this scan names the same group, which restore makes one inode
again), and a file is read once a scan: another link of it (same device, inode, size,
mtime and ctime, its ctime older than that read by the clock slack, the stat cache's racy rule)
takes the digest that read gave. Without that, 65,000 links of a 1 GiB file (`ln` is ~10 us)
made a close read 63 TiB. A link made or removed changes the file's ctime (and its link count),
so the stat cache re-reads every link of it and the group in its rows follows.

Names. Any name the kernel allows (any byte but ``/`` and NUL) and any symlink target is
recorded, as the text ``os.fsdecode`` makes of its bytes (both walkers decode so: the C one with
``PyUnicode_DecodeFSDefault``): a byte that is not UTF-8 is a lone surrogate, written
``\\udcXX`` in every JSON form (``canonical``), and restore writes the very bytes back.

Extended attributes (``xattrs``): read for every entry the stat cache does not vouch for, one
``listxattr`` (and a ``getxattr`` per attribute) by its name in its directory's fd, never
followed, after its stat; a small file the walker read says itself whether it has any (its
``flistxattr`` on the open file, between the read and the second fstat), and one that has
none costs nothing more. An entry the cache vouches for keeps the attributes its row recorded:
``setxattr`` and ``removexattr`` move the ctime, so an unchanged ctime (older than the cutoff)
means unchanged attributes; a directory, FIFO or device whose inode and ctime are its previous
row's takes that row's too. The root directory's are not recorded (``xattrs.NOT_RECORDED``).

Memory (issue 36). A scan does not hold what it has finished: it keeps the nodes of its
first ``KEEP_ENTRIES`` entries (and the root) for its index, which reads any other back from
the stat cache by ref; node bytes go to the cache in batches of ``NODES_FLUSH_BYTES``; trees
wait for the blobs they name in a spool (``_Spool``) that spills to an unlinked file past
``TREES_IN_MEMORY``; and its publisher counts a pack's members instead of holding each. The
whole ``settled close`` of 1,000,000 empty files peaked at ~200 MiB here (1.2 GiB before);
the entries budget (``entries_budget``) bounds what is left: time, and the distinct blobs.

About 890 lines, over the usual 400: the walk, its no-follow checks, the stat cache's use, the
listings ahead, the nodes and trees it builds and the incremental mode share one walker's state
(its open directories, the previous index's nodes, what is dirty and listed ahead), and split
they would share internals. What does not is apart: the loops and the read-ahead in ``walk``,
the rules in ``scanrules``, the reading of one file or symlink (opening, hashing, publishing,
torn-read retries, hard links) in ``scanread``, the errors and the entries budget in
``scanerrors``.

Given the root's recorded identity (``expect``), it scans that directory or nothing: a root
that is a symlink now, or another directory, raises ``WorkspaceReplaced`` (rootid).

Must never: follow a symlink, open a non-regular file, record a torn read, publish a tree before
the blobs it names are durable, write anything but store objects, or talk to the settled store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final

from settled.canonical import canonical_bytes
from settled.objects import ObjectStore
from settled.objects.hashing import DEFAULT_ALGORITHM, check_algorithm
from settled.workspace import rootid
from settled.workspace.cachetrust import filesystem_magic
from settled.workspace.ignore import NO_RULES, IgnoreRules
from settled.workspace.index import DirNode, Index, MemoryObjects, build_node, with_node
from settled.workspace.manifest import (
    DIR,
    FILE,
    ROOT,
    SYMLINK,
    TYPES,
    Entry,
    IndexMismatch,
    check_path,
    join,
    name_of,
    parent_of,
)
from settled.workspace.nodecache import NodeCache
from settled.workspace.publish import Publisher
from settled.workspace.scanerrors import (
    EntriesOverBudget,
    ScanError,
    TornRead,
    WorkspaceUnreadable,
    entries_budget,
)
from settled.workspace.scanread import PROC_FD, TORN_ATTEMPTS, FileReader, ScanStats
from settled.workspace.scanrules import CLOCK_SLACK_NS as CLOCK_SLACK_NS
from settled.workspace.scanrules import (
    RACY,
    REUSE,
    listed_dir_row_holds,
    same_dir,
    same_inode,
    stat_verdict,
)
from settled.workspace.walk import COARSE_FS_SLACK_NS as COARSE_FS_SLACK_NS
from settled.workspace.walk import (
    Job,
    Listed,
    Read,
    ReadAhead,
    choose,
    identity,
    open_beneath,
    workers,
)
from settled.workspace.walk import gc_paused as gc_paused
from settled.workspace.xattrs import Xattrs
from settled.workspace.xattrs import read_at as read_xattrs
from settled.workspace.xattrs import read_fd as read_fd_xattrs

Vouches = Callable[[int, int], bool]  # (a node's trusted_before_ns, its filesystem's magic)

KEEP_ENTRIES: Final = 150_000  # entries of the nodes a scan keeps in memory for its index
NODES_FLUSH_BYTES: Final = 4 << 20  # node bytes held before they go to the stat cache
TREES_IN_MEMORY: Final = 16 << 20  # tree bytes held before the rest spool to a temp file
AHEAD_BATCH: Final = 64  # subdirectories listed together, on the walker's threads
AHEAD_FDS: Final = 256  # at most this many listed ahead (each holds its directory fd)

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class ScanResult:
    index: Index
    stats: ScanStats = field(default_factory=ScanStats)
    blobs: frozenset[str] = frozenset()  # objects of the files this scan read (and published)
    trees: dict[str, str] = field(default_factory=dict)  # new tree id -> its directory path
    published_ref: str | None = None  # the list of both, published too (``list_published``)


def scan(
    root: str | os.PathLike[str],
    previous: Index | None = None,
    store: ObjectStore | None = None,
    algo: str = DEFAULT_ALGORITHM,
    *,
    only: Iterable[str] | None = None,
    cache: NodeCache | None = None,
    ignore: IgnoreRules = NO_RULES,
    list_published: bool = False,
    vouches: Vouches | None = None,
    expect: tuple[int, int] | None = None,
) -> ScanResult:
    """Scan the tree at ``root``; publish file contents and trees into ``store`` if given, and
    the stat-cache nodes into ``cache`` (else they are kept in memory, beside the previous
    scan's).

    ``only``: relative directory paths known dirty (``"."`` is the root). A directory is dirty
    when its own mode changed or any entry directly in it was created, removed, renamed, or
    changed in content, mode or type. Only those are re-listed, new directories found there are
    walked in full, and every other directory is carried over from ``previous``. ``None`` (the
    default) is a full scan, which is what a final scan must be.

    ``ignore``: the task's bound rules; an ignored directory is pruned (never listed nor
    walked), an ignored file never read, and neither appears in the index.

    ``list_published`` (with a store): also publish the list of the trees and blobs this scan
    published (``published_list``), durable with them; its id is ``published_ref``.

    ``vouches(trusted_before_ns, magic)``: whether the previous rows listed with that cutoff,
    in a directory on a filesystem of ``magic`` (``cachetrust``), may still vouch for their
    files; a directory whose rows may not is re-read whole. None: the stat cache's own rules.

    ``expect``: the root's (st_dev, st_ino) recorded at `task new` (rootid.read). The root is
    then opened without following a symlink at its last component and must be that directory,
    else ``WorkspaceReplaced`` and nothing is scanned (one open and one fstat, rootid).
    """
    check_algorithm(algo)
    started = time.time_ns()
    previous = _usable(previous, algo, only)
    if only is not None:  # a dirty directory inside an ignored one is never relisted
        only = [rel for rel in only if not _under_ignored(rel, ignore)]
    if not os.path.isdir(PROC_FD):
        raise ScanError(f"{PROC_FD} is missing: files could not be opened without following")
    if expect is not None:
        root_fd = rootid.open_checked(os.fspath(root), expect)
    else:
        root_fd = os.open(os.fspath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        scanner = _Scanner(root_fd, previous, store, cache, algo, started - CLOCK_SLACK_NS)
        scanner.ignore = ignore
        scanner.vouches = vouches
        scanner.list_published = list_published and store is not None
        with gc_paused():
            try:
                top = scanner.run(only)
            finally:
                scanner.to_publish.close()
    finally:
        os.close(root_fd)
    index = Index(algo, started, top, scanner.sink, scanner.nodes)
    scanner.stats.entries_carried = max(0, index.count - scanner.entries_listed)
    return ScanResult(
        index,
        scanner.stats,
        frozenset(scanner.reader.hashed),
        scanner.new_trees,
        scanner.published_ref,
    )


def _under_ignored(rel: str, ignore: IgnoreRules) -> bool:
    """Whether the directory ``rel`` or one of its ancestors is ignored."""
    if rel in (ROOT, ""):
        return False
    parts = rel.split("/")
    return any(ignore.ignores("/".join(parts[: i + 1]), True) for i in range(len(parts)))


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


_UNKNOWN: Final = DirNode("", "", "", 0, {}, 0, "")  # not looked up yet (None: no node)


class _Dir:
    """A directory whose node this scan builds: its rows so far and its previous node.
    ``listed``: its rows come from a listing now (else: its previous rows, with the rows of
    changed subdirectories replaced). ``racy``: a stat match was re-read for the racy rule."""

    __slots__ = ("listed", "path", "previous", "racy", "rows")

    def __init__(
        self, path: str, rows: dict[str, Entry], previous: DirNode | None, listed: bool
    ) -> None:
        self.path, self.rows, self.previous, self.listed = path, rows, previous, listed
        self.racy = False


class _Spool:
    """Byte strings kept in order, in memory up to ``TREES_IN_MEMORY`` and in an unlinked temp
    file past it, read back in order once: the trees a scan builds wait for the blobs they name
    to be durable, and a tree of 1,000 entries is ~150 KB."""

    def __init__(self) -> None:
        self.file = tempfile.SpooledTemporaryFile(max_size=TREES_IN_MEMORY)  # noqa: SIM115
        self.sizes: list[int] = []

    def append(self, data: bytes) -> None:
        self.file.write(data)
        self.sizes.append(len(data))

    def __iter__(self) -> Iterator[bytes]:
        self.file.seek(0)
        for size in self.sizes:
            yield self.file.read(size)

    def close(self) -> None:
        self.file.close()


class _Scanner:
    def __init__(
        self,
        root_fd: int,
        previous: Index | None,
        store: ObjectStore | None,
        cache: NodeCache | None,
        algo: str,
        trusted_before_ns: int,
    ) -> None:
        self.root_fd = root_fd
        self.previous = previous
        self.store = store
        self.algo = algo
        self.trusted_before_ns = trusted_before_ns  # for the nodes this scan lists
        self.stats = ScanStats()
        self.reader = FileReader(algo, store, self.stats)  # reads, hashes and publishes files
        self.sink: NodeCache | MemoryObjects
        if cache is not None:
            self.sink = cache
        else:  # nodes stay in memory, beside the previous scan's
            earlier = previous.reader if previous is not None else None
            self.sink = earlier if isinstance(earlier, MemoryObjects) else MemoryObjects(earlier)
        self.new_nodes: list[tuple[str, bytes]] = []  # not yet in the sink
        self.new_nodes_bytes = 0
        self.kept_entries = 0  # entries of the nodes in self.nodes
        self.full_mode = False
        self.previous_nodes: dict[str, DirNode | None] = {}  # previous_node's answers
        self.nodes: dict[str, DirNode] = {}  # every node built or kept, for the new index
        self.open: dict[str, _Dir] = {}  # incremental mode: directories whose node is rebuilt
        self.walked: set[str] = set()  # incremental mode: new directories walked in full
        self.passed: set[str] = set()  # incremental mode: rows refreshed on the way down
        self.entries_listed = 0
        self.new_trees: dict[str, str] = {}
        self.to_publish = _Spool()  # trees, published after the blobs they name
        self.list_published = False  # also publish the list of what this scan published
        self.published_ref: str | None = None
        self.publisher: Publisher | None = None
        self.ignore = NO_RULES
        self.vouches: Vouches | None = None
        self.judged: set[str] = set()  # directories whose cutoff vouching_node decided
        self.magics: dict[int, int] = {}  # st_dev -> filesystem magic
        self.walker = choose()
        self.stats.walker = self.walker.name
        self.entries_budget = entries_budget()
        self.workers = workers()
        self.ahead: dict[str, tuple[int, Listed | OSError]] = {}  # listed with a sibling
        self.dirty: list[str] = []  # incremental mode: the dirty directories, sorted
        self.dirty_at: dict[str, int] = {}  # where each is in that list
        self.dirty_next = 0  # the first of them not listed ahead yet
        self.dirty_ahead: dict[str, tuple[tuple[int, int], Listed | OSError]] = {}

    # -- modes ---------------------------------------------------------------------------------

    def run(self, only: Iterable[str] | None) -> Entry:
        """Full or incremental; with a store, blobs first (durable), then trees; then nodes."""
        with contextlib.ExitStack() as stack:
            if self.store is not None:
                stack.enter_context(self.store.batch())  # exits last: directory fsyncs
                self.publisher = stack.enter_context(Publisher(self.store))
                self.reader.publisher = self.publisher
            if only is None or self.previous is None:
                self.full_mode = True
                top = self.full()
            else:
                self.nodes = self.previous.loaded()
                top = self.incremental(only)
            if self.publisher is not None:
                self.publish(self.publisher)
        self.flush_nodes()
        return top

    def flush_nodes(self) -> None:
        """The nodes built so far into the sink (a node in the stat cache whose tree was never
        published is harmless: only a checkpoint's index names nodes, by ref)."""
        self.sink.put_many(self.new_nodes)
        self.new_nodes, self.new_nodes_bytes = [], 0

    def publish(self, publisher: Publisher) -> None:
        """Blobs, then trees (and the list of what was published), never a tree visible before
        the blobs it names are durable: staged into the blobs' own group when the publish is
        grouped (one pack, fsynced once, then named: blobs and trees become durable and
        visible in one step, which saves a pack's three fsyncs), else after the blobs'
        publisher closed."""
        if publisher.grouping:
            publisher.next_phase()
            for data in self.to_publish:
                publisher.submit_bytes(data, self.algo)
            if self.list_published:
                self.published_ref = publisher.submit_bytes(self.published_list(), self.algo)
            publisher.close()
            self.stats.blobs_written = publisher.created_in[0]
            self.stats.objects_grouped = publisher.grouped
            return
        publisher.close()  # every blob durable before a tree names it
        self.stats.blobs_written = publisher.created
        self.stats.objects_grouped = publisher.grouped
        self.publish_trees()
        if self.list_published:
            assert self.store is not None
            self.published_ref = self.store.put_bytes(self.published_list(), self.algo)

    def published_list(self) -> bytes:
        """What this scan published, for the read-back: tree id -> directory, blob digests."""
        return canonical_bytes({"trees": self.new_trees, "blobs": sorted(self.reader.hashed)})

    def full(self) -> Entry:
        top = Entry.from_stat(ROOT, os.fstat(self.root_fd))
        self.entries_listed += 1
        return with_node(top, self.walk(self.root_fd, ROOT))

    def incremental(self, only: Iterable[str]) -> Entry:
        assert self.previous is not None
        top = Entry.from_stat(ROOT, os.fstat(self.root_fd))
        self.entries_listed += 1
        self.dirty = sorted({_normalize_dirty(path) for path in only})
        self.dirty_at = {rel: at for at, rel in enumerate(self.dirty)}
        for rel in self.dirty:
            if self._covered(rel):
                continue
            fd, opened = self.open_nearest(rel)
            try:
                if not self._covered(opened):
                    self.relist(fd, opened)
            finally:
                if fd != self.root_fd:
                    os.close(fd)
        if not self.open:  # nothing dirty: the previous root node, as it was
            node = self.previous.node(ROOT)
            assert node is not None
            return with_node(top, node)
        return with_node(top, self.finish_open())

    def _covered(self, rel: str) -> bool:
        """Listed already by this scan: relisted, or inside a directory walked in full."""
        known = self.open.get(rel)
        return (known is not None and known.listed) or any(
            ancestor in self.walked for ancestor in _self_and_ancestors(rel)
        )

    # -- walking -------------------------------------------------------------------------------

    def walk(self, top_fd: int, top: str) -> DirNode:
        """List ``top`` and everything below it, holding one directory fd per level (and the
        fds of the siblings listed ahead); returns the node of ``top`` (each directory's node
        is built once its children are done)."""
        first, subdirs = self.list_dir(top_fd, top)
        stack = [(first, top_fd, subdirs)]
        try:
            while True:
                current, fd, pending = stack[-1]
                if pending:
                    name = pending.pop()
                    opened = self.descend(fd, current, name, pending)
                    if opened is not None:
                        sub, listed = opened
                        try:
                            child, below = self.record(sub, join(current.path, name), listed)
                        except BaseException:
                            os.close(sub)
                            raise
                        stack.append((child, sub, below))
                    continue
                stack.pop()
                if fd != top_fd:
                    os.close(fd)
                node = self.finish(current)
                if not stack:
                    return node
                parent = stack[-1][0]
                name = name_of(current.path)
                parent.rows[name] = with_node(parent.rows[name], node)
        finally:
            for _, fd, _ in stack:
                if fd != top_fd:
                    os.close(fd)
            for fd, _ in self.ahead.values():
                os.close(fd)
            self.ahead.clear()

    def descend(
        self, fd: int, current: _Dir, name: str, pending: list[str]
    ) -> tuple[int, Listed | OSError] | None:
        """The subdirectory ``name`` opened and listed (None if it is no longer one to enter).
        It was listed ahead with its siblings, or is now, with the next of them (``pending``,
        popped from the end): one ``scan_dirs`` call lists them on the walker's threads."""
        child = join(current.path, name)
        ahead = self.ahead.pop(child, None)
        if ahead is not None:
            return ahead
        room = max(0, min(AHEAD_BATCH, AHEAD_FDS - len(self.ahead)) - 1)
        names = [name, *pending[::-1][:room]]  # the next siblings, in the order they come
        opened: list[tuple[str, int]] = []
        try:
            for sibling in names:
                sub = self.open_subdir(fd, current, sibling)
                if sub is not None:
                    opened.append((join(current.path, sibling), sub))
            jobs = [self.job(path, sub) for path, sub in opened]
            listed = self.walker.scan_dirs(jobs, self.workers) if jobs else []
        except BaseException:
            for _, sub in opened:
                os.close(sub)
            raise
        for (path, sub), result in zip(opened, listed, strict=True):
            self.ahead[path] = (sub, result)
        return self.ahead.pop(child, None)

    def job(self, rel: str, fd: int) -> Job:
        previous = self.vouching_node(rel, fd)
        if previous is None:
            return fd, None, 0
        return fd, previous.entries, previous.trusted_before_ns

    def list_dir(self, fd: int, rel: str) -> tuple[_Dir, list[str]]:
        """Record every child of the directory open at ``fd``; return it and its subdir names.
        A dirty directory of an incremental scan was listed ahead with the next ones (if it
        is still the very directory that was listed then)."""
        ahead = self.listed_ahead(fd, rel)
        if ahead is None:
            (ahead,) = self.walker.scan_dirs([self.job(rel, fd)], 1)
        return self.record(fd, rel, ahead)

    def listed_ahead(self, fd: int, rel: str) -> Listed | OSError | None:
        """Incremental mode: the dirty directories from ``rel`` on are opened beneath the root
        (never following), listed together on the walker's threads and closed, a batch at a
        time; ``rel``'s listing, if the directory open at ``fd`` is the one that was listed."""
        if rel not in self.dirty_ahead:
            if rel not in self.dirty[self.dirty_next :]:
                return None
            start = self.dirty.index(rel, self.dirty_next)
            batch = self.dirty[start : start + AHEAD_BATCH]
            self.dirty_next = start + len(batch)
            opened = [(d, sub) for d in batch if (sub := open_beneath(self.root_fd, d)) is not None]
            try:
                jobs = [self.job(d, sub) for d, sub in opened]
                listed = self.walker.scan_dirs(jobs, self.workers)
                for (d, sub), result in zip(opened, listed, strict=True):
                    self.dirty_ahead[d] = (identity(os.fstat(sub)), result)
            finally:
                for _, sub in opened:
                    os.close(sub)
        listed_as, result = self.dirty_ahead.pop(rel)
        return result if listed_as == identity(os.fstat(fd)) else None

    def record(self, fd: int, rel: str, listed: Listed | OSError) -> tuple[_Dir, list[str]]:
        """The directory at ``rel`` from its listing: the cached entries the stat cache vouched
        for as they were, and the rest (new, changed, racy, directories, other types) recorded
        now, by name, in sorted order."""
        self.stats.dirs_listed += 1
        if isinstance(listed, OSError):
            name = listed.filename if isinstance(listed.filename, str) else None
            where = rel if name is None else ("" if rel == ROOT else rel + "/") + name
            raise WorkspaceUnreadable(where, listed) from listed
        rows, fresh = listed
        current = _Dir(rel, rows, self.previous_node(rel), listed=True)
        prefix = "" if rel == ROOT else rel + "/"
        ignore = self.ignore
        if ignore.patterns:  # the rules bound to the task: a vouched-for row obeys them too
            for name in [name for name in rows if ignore.ignores(prefix + name, False)]:
                del rows[name]
        self.stats.entries_reused += len(rows)
        subdirs = []
        fresh.sort()
        kept = []
        for name, st in fresh:
            if ignore.patterns and ignore.ignores(prefix + name, stat.S_ISDIR(st.st_mode)):
                continue  # left out by the task's bound rules: not recorded, never walked
            kept.append((name, st))
        self.within_budget(prefix, rows, kept)
        ahead = ReadAhead(self.walker, self.workers, fd, kept, overlap=self.workers > 1)
        try:
            for name, st in kept:
                entry = self.entry(fd, name, prefix + name, st, current, read=ahead.get(name))
                if entry is None:
                    continue  # vanished while read
                rows[name] = entry
                if entry.type == DIR:
                    subdirs.append(name)
        finally:
            ahead.close()  # no read runs in fd once this returns: the caller may close it
        self.entries_listed += len(rows)
        subdirs.reverse()  # popped from the end: walk in sorted order
        return current, subdirs

    def within_budget(
        self, prefix: str, rows: dict[str, Entry], kept: list[tuple[str, os.stat_result]]
    ) -> None:
        """Refuse the directory's entry that would pass the entries budget, by name, before
        any of its files is read."""
        room = self.entries_budget - self.entries_listed
        if len(rows) + len(kept) <= room:
            return
        names = sorted([*rows, *(name for name, _ in kept)])
        raise EntriesOverBudget(prefix + names[max(room, 0)], self.entries_budget)

    def vouching_node(self, rel: str, fd: int) -> DirNode | None:
        """``previous_node``, its cutoff taken away if its rows are no longer evidence (every
        file in it is then re-read, as racy); decided once a directory, before its listing."""
        node = self.previous_node(rel)
        if node is None or self.vouches is None or rel in self.judged:
            return node
        self.judged.add(rel)
        if node.trusted_before_ns and not self.vouches(node.trusted_before_ns, self.magic(fd)):
            node = self.previous_nodes[rel] = dataclasses.replace(node, trusted_before_ns=0)
            self.stats.dirs_unvouched += 1
        return node

    def magic(self, fd: int) -> int:
        """The filesystem type of the directory open at ``fd`` (one ``fstatfs`` a device)."""
        dev = os.fstat(fd).st_dev
        known = self.magics.get(dev)
        if known is None:
            known = self.magics[dev] = filesystem_magic(fd)
        return known

    def previous_node(self, rel: str) -> DirNode | None:
        """The previous index's node of ``rel`` (looked up from the root once, then kept:
        a full walk asks twice a directory, ~1.5 us each)."""
        if self.previous is None:
            return None
        known = self.previous_nodes.get(rel, _UNKNOWN)
        if known is _UNKNOWN:
            known = self.previous_nodes[rel] = self.previous.node(rel)
        return known

    def open_subdir(self, fd: int, current: _Dir, name: str) -> int | None:
        """Open a child directory without following; re-record it if it changed since lstat."""
        child = join(current.path, name)
        for _ in range(TORN_ATTEMPTS):
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                if error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise WorkspaceUnreadable(child, error) from error
                st = self.lstat(fd, name, child)
                entry = None if st is None else self.entry(fd, name, child, st, current)
                if entry is None:
                    current.rows.pop(name, None)
                    return None
                if entry.type != DIR:  # replaced (by a symlink, say): recorded, never entered
                    current.rows[name] = entry
                    return None
                continue  # replaced by another directory: open that one
            current.rows[name] = self.dir_row(child, os.fstat(sub), current.rows.get(name), sub)
            return sub
        raise TornRead(child, TORN_ATTEMPTS)

    def dir_row(self, child: str, st: os.stat_result, listed: Entry | None, fd: int) -> Entry:
        """The row of the directory open at ``fd``: its attributes as this scan's listing read
        them if it is still that inode unchanged (``listed``), else read now through ``fd``."""
        now = Entry.from_stat(child, st)
        if listed_dir_row_holds(listed, st):
            assert listed is not None
            return _with_xattrs(now, listed.xattrs)
        try:
            return _with_xattrs(now, read_fd_xattrs(fd, child))
        except OSError as error:
            raise WorkspaceUnreadable(child, error) from error

    def lstat(self, fd: int, name: str, child: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise WorkspaceUnreadable(child, error) from error

    # -- nodes and trees -----------------------------------------------------------------------

    def finish(self, current: _Dir) -> DirNode:
        """The directory's node: its previous one if nothing in it changed, else a new node
        (and, if its content changed, a new tree), queued for publishing."""
        previous = current.previous
        if self.full_mode:  # listed once: the previous index's node is not asked for again
            self.previous_nodes.pop(current.path, None)
        if previous is not None and not current.racy and current.rows == previous.entries:
            self.keep(previous)
            return previous
        if current.listed:
            trusted = self.trusted_before_ns
        else:
            assert previous is not None  # a directory not listed was carried from its node
            trusted = previous.trusted_before_ns
        made = build_node(current.path, self.algo, current.rows.values(), trusted)
        node = made.node
        self.stats.nodes_built += 1
        if previous is None or node.tree != previous.tree:
            self.stats.trees_built += 1
            self.new_trees.setdefault(node.tree, current.path)
            if self.store is not None:
                self.to_publish.append(made.tree_data)
        self.new_nodes.append((node.ref, made.node_data))
        self.new_nodes_bytes += len(made.node_data)
        if self.new_nodes_bytes >= NODES_FLUSH_BYTES:
            self.flush_nodes()
        self.keep(node)
        return node

    def keep(self, node: DirNode) -> None:
        """Keep ``node`` for the index, unless this full scan already keeps ``KEEP_ENTRIES``
        entries: past them the index reads its nodes back from the sink by ref, so a scan of
        millions of entries holds the directories it is walking, not all of them (the root is
        always kept, and an incremental scan keeps what it rebuilt)."""
        if node.path == ROOT or not self.full_mode or self.kept_entries < KEEP_ENTRIES:
            self.nodes[node.path] = node
            self.kept_entries += len(node.entries)

    def publish_trees(self) -> None:
        """Trees, once the blobs they name are durable."""
        assert self.store is not None
        with Publisher(self.store) as publisher:
            for data in self.to_publish:
                writer = self.store.writer(self.algo, size_hint=len(data))
                writer.write(data)
                publisher.submit(writer)
            publisher.close()
        self.stats.objects_grouped += publisher.grouped

    # -- entries -------------------------------------------------------------------------------

    def entry(
        self,
        fd: int,
        name: str,
        child: str,
        st: os.stat_result,
        at: _Dir,
        budget: int = TORN_ATTEMPTS,
        read: Read | None = None,
    ) -> Entry | None:
        """The entry for ``child`` given its lstat: from the stat cache, or read afresh (from
        ``read``, what the walker read of it ahead, unless that read was torn)."""
        if budget <= 0:
            raise TornRead(child, TORN_ATTEMPTS)
        kind = TYPES.get(stat.S_IFMT(st.st_mode))
        previous = at.previous
        cached = previous.child(name) if previous is not None else None
        if kind not in (FILE, SYMLINK):
            made = Entry.from_stat(child, st)
            if previous is not None and cached is not None and same_inode(cached, st, previous):
                return _with_xattrs(made, cached.xattrs)  # unchanged since: no setxattr either
            return self.with_xattrs(fd, name, made)
        if previous is not None and cached is not None:
            verdict = stat_verdict(cached, st, previous.trusted_before_ns)
            if verdict == REUSE:
                self.stats.entries_reused += 1
                return cached
            if verdict == RACY:
                at.racy = True
        if kind == SYMLINK:
            fresh = self.read_link(fd, name, child, st, at, budget)
        else:
            fresh = self.reader.from_read(child, read) if read is not None else None
            if fresh is not None and read is not None and not read[3]:
                return fresh  # the walker's flistxattr of the open file listed no name
            if fresh is None:
                fresh = self.read_file(fd, name, child, at, budget)
        return None if fresh is None else self.with_xattrs(fd, name, fresh)

    def with_xattrs(self, fd: int, name: str, entry: Entry) -> Entry:
        """``entry`` with the extended attributes its name has now (read after its stat: a
        change in between moves the ctime, which the next scan sees)."""
        try:
            return _with_xattrs(entry, read_xattrs(fd, name, entry.path))
        except OSError as error:
            raise WorkspaceUnreadable(entry.path, error) from error

    def read_link(
        self, fd: int, name: str, child: str, st: os.stat_result, at: _Dir, budget: int
    ) -> Entry | None:
        """The symlink's entry (``scanread``); one that is no longer a symlink is recorded as
        what it is now, within the same budget of attempts."""
        got = self.reader.read_link(fd, name, child, st)
        if isinstance(got, os.stat_result):
            return self.entry(fd, name, child, got, at, budget - 1)
        return got

    def read_file(self, fd: int, name: str, child: str, at: _Dir, budget: int) -> Entry | None:
        """The regular file's entry (``scanread``); one that is no longer a regular file is
        recorded as what it is now, within the same budget of attempts."""
        got = self.reader.read_file(fd, name, child)
        if isinstance(got, os.stat_result):
            return self.entry(fd, name, child, got, at, budget - 1)
        return got

    # -- incremental ---------------------------------------------------------------------------

    def working(self, rel: str) -> _Dir:
        """The directory at ``rel`` as the previous index knew it, to rebuild its node."""
        known = self.open.get(rel)
        if known is not None:
            return known
        previous = self.previous_node(rel)
        if previous is None:
            raise IndexMismatch(f"the previous index has no directory {rel!r}")
        made = self.open[rel] = _Dir(rel, dict(previous.entries), previous, listed=False)
        return made

    def open_nearest(self, rel: str) -> tuple[int, str]:
        """Open ``rel`` component by component without following; stop at the deepest directory
        that still is the one the previous index knew (its parent must be re-listed). The rows
        of the directories passed on the way are refreshed from what was opened."""
        fd, opened = self.root_fd, ROOT
        self.working(ROOT)
        for name in [] if rel == ROOT else rel.split("/"):
            parent = self.working(opened)
            known = parent.rows.get(name)
            if known is None or known.type != DIR:
                break
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                break
            st = os.fstat(sub)
            if not same_dir(known, st):
                os.close(sub)
                break
            child = join(opened, name)
            parent.rows[name] = _carried(self.dir_row(child, st, None, sub), known)
            if child not in self.passed:
                self.passed.add(child)
                self.entries_listed += 1
            if fd != self.root_fd:
                os.close(fd)
            fd, opened = sub, child
            self.working(child)
        return fd, opened

    def relist(self, fd: int, rel: str) -> None:
        """List ``rel`` afresh: a subdirectory that is the one the previous index knew is
        carried (or rebuilt later, if dirty); one that is new or replaced is walked in full."""
        current, subdirs = self.list_dir(fd, rel)
        self.open[rel] = current
        previous = current.previous
        for name in subdirs:
            known = previous.child(name) if previous is not None else None
            now = current.rows[name]
            if known is not None and same_dir(known, now):
                current.rows[name] = _carried(now, known)
                continue
            child = join(rel, name)
            sub = self.open_subdir(fd, current, name)
            if sub is None:
                continue
            try:
                node = self.walk(sub, child)
            finally:
                os.close(sub)
            current.rows[name] = with_node(current.rows[name], node)
            self.walked.add(child)

    def finish_open(self) -> DirNode:
        """Build the nodes of the directories this scan rebuilt, deepest first, each one's new
        node replacing its row in its parent; returns the root's node."""
        for rel in sorted(self.open, key=_depth, reverse=True):
            node = self.finish(self.open[rel])
            if rel == ROOT:
                return node
            parent = self.open[parent_of(rel)]
            row = parent.rows.get(name_of(rel))
            if row is not None and row.type == DIR:
                parent.rows[name_of(rel)] = with_node(row, node)
        raise AssertionError("the root is always rebuilt with the directories below it")


def _with_xattrs(entry: Entry, xattrs: Xattrs | None) -> Entry:
    """``entry`` recording ``xattrs`` (built positionally: they are its last field)."""
    if entry.xattrs == xattrs:
        return entry
    return _new_tuple(Entry, (*entry[:_XATTRS_AT], xattrs))


_new_tuple: Final = tuple.__new__
_XATTRS_AT: Final = Entry._fields.index("xattrs")
assert len(Entry._fields) - 1 == _XATTRS_AT, "_with_xattrs builds Entry positionally: update it"


def _carried(now: Entry, known: Entry) -> Entry:
    """A directory's fresh stat row, still pointing at the node and tree it had."""
    return now._replace(tree=known.tree, node=known.node, below=known.below)


def _depth(rel: str) -> int:
    return 0 if rel == ROOT else rel.count("/") + 1


def _normalize_dirty(path: str) -> str:
    return check_path(path.rstrip("/") or ROOT)


def _self_and_ancestors(rel: str) -> list[str]:
    parts = rel.split("/")
    return [ROOT] + ["/".join(parts[: i + 1]) for i in range(len(parts))] if rel != ROOT else [ROOT]
