"""The verified-object record: which objects were re-hashed successfully, and as which file.

Owns ``VerifiedRecord``, a table ``verified_objects`` in ``<home>/index.db`` (beside the stat
cache's nodes): ``digest -> (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns, verified_at_ns)``,
the identity taken by ``fstat`` of the object file at the moment its bytes were last re-hashed
and found to hash to its name (the local store's ``Stamp`` of that copy), and
``Verified.vouches_for``, the rule by which a read-back may trust an object without reading it
again: the racy-git rule applied to the object store.

The rule. An ``lstat`` of the object's name now must give a regular file with exactly the
recorded device, inode, size, mtime and ctime. Any write, truncate, replace or chmod of the file
changes its ctime (or its inode), a deleted one fails the lstat, and ctime cannot be set from
user space (short of setting the system clock). And, as git does for its index, the recorded
ctime and mtime must be strictly older than the instant the re-hash began (less
``scan.CLOCK_SLACK_NS``, 2 s on a filesystem that stamps whole seconds): otherwise a change
made in the same timestamp tick, right after the re-hash, could leave the identity as it was.
Such a re-hash is not recorded (it would vouch for nothing); the next read-back re-hashes the
object and records it, by then safely old.

Packs verified whole (``verified_packs``): ``(dev, ino) -> (ctime_ns, index ctime_ns,
verified_at_ns)`` of a pack whose every member hashed to its name between two equal fstats of
it. A packed object's ``Stamp`` is its pack's inode, ctime and device and its index's ctime (and
its own size), so a stamp equal to such a row in those fields names a member of that very pack,
unchanged, through that very index (a write to the pack, or an index replaced by the
quarantine, moves a ctime); the same racy rule applies to both ctimes. One row a pack, not one
an object.

It is a cache. A lost, unreadable or stale row costs a re-hash, never a wrong answer: a row
only ever says "this inode, unchanged since then, hashed right". Writes are one transaction per
read-back, ``synchronous=NORMAL`` like the nodes. The rows looked up are memoized for the life
of the object (one per workspace service), so repeated checkpoints of one workspace do not
query them again; another process's newer rows are found when the memo misses, and an older
memo entry can only make the read-back re-hash.

Must never: record an object whose bytes did not hash to its name; vouch for an object whose
identity differs in any field; raise because the record cannot be read or written (the
read-back then re-hashes, and says how many it re-hashed).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final, NamedTuple

from settled.home import private_file
from settled.localdb import BUSY_TIMEOUT_S, enable_wal
from settled.objects import Stamp
from settled.workspace.scan import CLOCK_SLACK_NS, COARSE_FS_SLACK_NS

_BATCH: Final = 10_000  # digests per lookup query (SQLite allows 32,766 variables)
_SCAN_FROM: Final = 10_000  # looking up this many, the table may be cheaper read whole
_COLUMNS: Final = "digest, dev, ino, size, mtime_ns, ctime_ns, verified_at_ns"
# Rows that can vouch (``Verified.settled``, computed by SQLite: in Python it cost ~3 us a row),
# as ``digest`` and ``key_of``'s fields. A value that is not an integer never equals an lstat's.
_SETTLED_ROWS: Final = (
    "SELECT digest, ctime_ns, ino, mtime_ns, size, dev FROM verified_objects "
    "WHERE {where} "
    f"AND max(ctime_ns, mtime_ns) < verified_at_ns - {CLOCK_SLACK_NS} "
    f"- (ctime_ns % 1000000000 = 0) * {COARSE_FS_SLACK_NS}"
)

# Packs verified whole that can vouch (the same rule, on the pack's ctime and its index's).
_SETTLED_PACKS: Final = (
    "SELECT dev, ino, changed_ns, modified_ns FROM verified_packs "
    f"WHERE max(changed_ns, modified_ns) < verified_at_ns - {CLOCK_SLACK_NS} "
    f"- (changed_ns % 1000000000 = 0) * {COARSE_FS_SLACK_NS}"
)

Key = tuple[int, int, int, int, int]  # ctime_ns, ino, mtime_ns, size, dev: compared per object


def key_of(st: os.stat_result) -> Key:
    """The identity a record row must match, in the order that fails fastest."""
    return (st.st_ctime_ns, st.st_ino, st.st_mtime_ns, st.st_size, st.st_dev)


class Verified(NamedTuple):
    """An object's identity when its bytes last hashed to its name, and when that began."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    verified_at_ns: int

    @classmethod
    def of(cls, st: os.stat_result, verified_at_ns: int) -> Verified:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, verified_at_ns)

    @classmethod
    def of_stamp(cls, stamp: Stamp, verified_at_ns: int) -> Verified:
        """The identity of the copy an ``ObjectStore.reread`` read (the local store's stamp is
        the object file's fstat identity, so this is ``of`` that fstat)."""
        return cls(
            stamp.volume, stamp.copy, stamp.size, stamp.modified_ns, stamp.changed_ns,
            verified_at_ns,
        )  # fmt: skip

    @staticmethod
    def could_settle(stamp: Stamp, verified_at_ns: int) -> bool:
        """False if the identity of ``stamp``, re-hashed from ``verified_at_ns``, cannot be
        ``settled`` (its copy changed within the clock's slack of the re-hash: every object a
        checkpoint just published). ``record`` writes only settled rows, so a read-back need
        not build the others (~1 us each)."""
        cutoff = verified_at_ns - CLOCK_SLACK_NS
        return stamp.changed_ns < cutoff and stamp.modified_ns < cutoff

    @property
    def settled(self) -> bool:
        """The file's last change was strictly older than the re-hash (the racy-git rule):
        only then can an unchanged identity vouch for its bytes."""
        coarse = self.ctime_ns % 1_000_000_000 == 0
        cutoff = self.verified_at_ns - CLOCK_SLACK_NS - (COARSE_FS_SLACK_NS if coarse else 0)
        return self.ctime_ns < cutoff and self.mtime_ns < cutoff

    @property
    def key(self) -> Key:
        return (self.ctime_ns, self.ino, self.mtime_ns, self.size, self.dev)

    def vouches_for(self, st: os.stat_result) -> bool:
        """True if ``st`` (an lstat now) is the very file that was verified, changed since in
        no way the kernel records, and that file's last change was not racy with the re-hash."""
        return self.settled and stat.S_ISREG(st.st_mode) and key_of(st) == self.key


class VerifiedRecord:
    """The record in the SQLite file at ``path``; safe to share between threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._memo: dict[str, Key | None] = {}  # None: no row, or one that vouches for nothing
        self._packs: dict[tuple[int, int], tuple[int, int]] | None = None  # read once, kept
        self._db: sqlite3.Connection | None = None
        self.unusable: str | None = None  # why the record could not be used, if it could not
        try:
            private_file(path)
            db = sqlite3.connect(
                path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            enable_wal(db, path)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS verified_objects (digest TEXT PRIMARY KEY, "
                "dev INTEGER, ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, "
                "verified_at_ns INTEGER) WITHOUT ROWID"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS verified_packs (dev INTEGER, ino INTEGER, "
                "changed_ns INTEGER, modified_ns INTEGER, verified_at_ns INTEGER, "
                "PRIMARY KEY (dev, ino)) WITHOUT ROWID"
            )
            self._db = db
        except Exception as error:  # a cache: without it every object is re-hashed
            self.unusable = f"cannot open the verified-object record at {path}: {error}"

    def known(self, digests: Collection[str]) -> Mapping[str, Key | None]:
        """For each of ``digests``, the identity (``key_of`` an lstat) that vouches for it, or
        None: never verified, an unusable row, or a re-hash that was racy with the file's last
        change (such a row vouches for nothing until a later re-hash records it again). The
        mapping is the memo itself: read it, do not keep it."""
        with self._lock:
            memo = self._memo
            wanted = [digest for digest in digests if digest not in memo]
            if not wanted:
                return memo
            found: dict[str, Key] = {}
            if self._db is not None:
                try:
                    found = self._read(wanted)
                except sqlite3.Error as error:  # the unread ones are re-hashed: not in memo
                    self.unusable = f"cannot read the verified-object record: {error}"
                    return memo
            for digest in wanted:
                memo[digest] = found.get(digest)
            return memo

    def packs(self) -> Mapping[tuple[int, int], tuple[int, int]]:
        """The containers verified whole that can vouch (``settled``): ``(volume, copy)`` of
        a stamp -> its ``(changed_ns, modified_ns)`` then. A packed object's stamp equal to one
        of them but for the size is a member of a pack whose every member hashed right, and
        that pack and its index are unchanged since (``record_packs``). One row per pack, read
        whole once: a home has few packs (one or two a checkpoint)."""
        with self._lock:
            if self._packs is None:
                self._packs = {}
                if self._db is not None:
                    try:
                        rows = self._db.execute(_SETTLED_PACKS).fetchall()
                    except sqlite3.Error as error:
                        self.unusable = f"cannot read the verified-object record: {error}"
                        rows = []
                    self._packs = {(dev, ino): (c, m) for dev, ino, c, m in rows}
            return self._packs

    def record_packs(self, stamps: Iterable[tuple[Stamp, int]]) -> None:
        """Record each pack verified whole: the stamp of one of its members (size aside) and
        when the re-hash began; only those that can vouch (``settled``), in one transaction."""
        rows = []
        for stamp, verified_at_ns in stamps:
            row = Verified.of_stamp(stamp, verified_at_ns)
            if row.settled:
                rows.append((row.dev, row.ino, row.ctime_ns, row.mtime_ns, verified_at_ns))
        if not rows:
            return
        with self._lock:
            if self._packs is not None:
                for dev, ino, changed, modified, _ in rows:
                    self._packs[(dev, ino)] = (changed, modified)
            self._write_rows(
                "INSERT OR REPLACE INTO verified_packs (dev, ino, changed_ns, modified_ns, "
                "verified_at_ns) VALUES (?, ?, ?, ?, ?)",
                rows,
            )

    def _write_rows(self, statement: str, rows: list[tuple[Any, ...]]) -> None:
        """`statement` for each row in one transaction (holding `_lock`); an error makes the
        record unusable, never the checkpoint that asked."""
        if self._db is None or not rows:
            return
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(statement, rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.Error as error:
            self.unusable = f"cannot write the verified-object record: {error}"

    def _read(self, wanted: list[str]) -> dict[str, Key]:
        """The rows that vouch, of ``wanted``: looked up by key, or, when they are most of the
        table, read in one pass (100,000 of 104,000 rows: 0.3-0.4 s by key, 0.2-0.3 s so)."""
        assert self._db is not None
        found: dict[str, Key] = {}
        rows: Iterable[tuple[str, int, int, int, int, int]]
        if len(wanted) >= _SCAN_FROM:
            total = self._db.execute("SELECT count(*) FROM verified_objects").fetchone()[0]
            if total <= 2 * len(wanted):
                want = set(wanted)
                rows = self._db.execute(_SETTLED_ROWS.format(where="1"))
                for digest, ctime_ns, ino, mtime_ns, size, dev in rows:
                    if digest in want:
                        found[digest] = (ctime_ns, ino, mtime_ns, size, dev)
                return found
        wanted.sort()  # the primary key's order: the lookups walk the b-tree forward
        for start in range(0, len(wanted), _BATCH):
            chunk = wanted[start : start + _BATCH]
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(_SETTLED_ROWS.format(where=f"digest IN ({marks})"), chunk)
            for digest, ctime_ns, ino, mtime_ns, size, dev in rows:
                found[digest] = (ctime_ns, ino, mtime_ns, size, dev)
        return found

    def record(self, rows: Iterable[tuple[str, Verified]]) -> None:
        """Record each ``(digest, identity)`` just re-hashed successfully, in one transaction;
        only those that can vouch (``settled``). A re-hash racy with its copy's last change
        (every object a checkpoint has just published) could vouch for nothing, so it is not
        written: an older row of the same digest stays, and vouches only for the copy it names
        (an unchanged copy that hashed right), else costs a re-hash. Writing them cost a close
        of 1,000 new files ~1,000 random b-tree inserts and the WAL checkpoints they caused."""
        items = list(rows)
        if not items:
            return
        with self._lock:
            settled = []
            for digest, row in items:
                if row.settled:
                    self._memo[digest] = row.key
                    settled.append((digest, row))
                else:
                    self._memo[digest] = None
            self._write_rows(
                f"INSERT OR REPLACE INTO verified_objects ({_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(digest, *row) for digest, row in settled],
            )

    def forget(self, digests: Iterable[str]) -> None:
        """Drop the rows of objects found missing or damaged (their files are gone or moved)."""
        gone = list(digests)
        if not gone:
            return
        with self._lock:
            for digest in gone:
                self._memo[digest] = None
            if self._db is None:
                return
            try:
                self._db.executemany(
                    "DELETE FROM verified_objects WHERE digest=?", [(d,) for d in gone]
                )
            except sqlite3.Error as error:
                self.unusable = f"cannot write the verified-object record: {error}"

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
