"""Restore a manifest into an empty directory, exactly, or not at all.

Owns ``restore``: read the manifest back by its exact id, rebuild the tree in a private temp
directory beside ``dest`` (directories, files with content verified by hash while copying,
symlinks as links, FIFOs with ``mkfifo``), apply owners and modes after content (files as they
are finished, directories last and deepest first, the root last of all), fsync, then rename the
temp directory onto ``dest``. Sockets and devices cannot be restored and are named in the
result; a device node is never created.

Restore grants nothing (tar's convention). The command that made the workspace is hostile, and
the restore often runs as root: a set-uid file of ``nobody`` restored by root with its mode
would be a set-uid *root* file. So every entry is owned by whoever restores, unless
``same_owner`` (root only) chowns each entry to its recorded uid and gid; and a set-uid bit is
kept only with ``same_owner`` or when the recorded uid is the restoring euid, a set-gid bit only
with ``same_owner`` or when the recorded gid is the restoring egid or one of its groups (the
entry is then given that group). An entry that records no owner (a v1 tree) keeps no set-id
bit, even with ``same_owner``: there is no owner to restore. The sticky bit is kept. Every bit
dropped is named in the result (``setid_dropped``); ``earned_setid`` is the rule, without I/O.

Must never: write outside the temp directory or ``dest``; follow a symlink (a manifest path
whose parent is not a directory restored earlier is refused, so a link created by the restore is
never traversed); leave a partial tree at ``dest`` (on any failure the temp directory is removed
and ``dest`` is untouched); replace a ``dest`` that exists and is not an empty directory;
accept content that does not hash to its digest; create a set-id file or directory owned by
anyone the checkpoint's author could not already run as; create a device node.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Final

from settled.errors import SettledError
from settled.workspace.hashing import format_digest, new_hasher
from settled.workspace.manifest import (
    DIR,
    FILE,
    ROOT,
    SYMLINK,
    Entry,
    Manifest,
    UnsafePath,
    check_path,
    parent_of,
    read_manifest,
)
from settled.workspace.objects import CHUNK, ObjectMissing, ObjectStore

FIFO: Final = "fifo"
SETID: Final = stat.S_ISUID | stat.S_ISGID
_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FIFO: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC  # never blocks


class RestoreError(SettledError):
    """The manifest could not be restored; nothing was left at the destination."""


class DestinationNotEmpty(RestoreError):
    def __init__(self, dest: str) -> None:
        super().__init__(
            f"restore destination {dest!r} exists and is not an empty directory; "
            "choose a new path or empty it"
        )
        self.dest = dest


class BlobCorrupt(RestoreError):
    def __init__(self, digest: str, path: str, actual: str) -> None:
        super().__init__(
            f"object {digest} for {path!r} reads back as {actual}; restore refused, "
            "nothing written at the destination"
        )
        self.digest, self.path, self.actual = digest, path, actual


class SameOwnerNeedsRoot(RestoreError):
    def __init__(self, euid: int) -> None:
        super().__init__(
            f"restore --same-owner chowns every entry to its recorded owner, which needs root; "
            f"this process runs as euid {euid}. Restore without --same-owner (every entry is "
            "then yours, and set-id bits you have not earned are dropped), or run it as root"
        )
        self.euid = euid


class OwnerNotRestorable(RestoreError):
    def __init__(self, path: str, uid: int, gid: int, error: OSError) -> None:
        super().__init__(
            f"cannot give {path!r} its recorded owner {uid}:{gid}: {error.strerror or error}; "
            "restore refused, nothing written at the destination (restore without "
            "--same-owner to own every entry yourself)"
        )
        self.path, self.uid, self.gid = path, uid, gid


@dataclass(frozen=True)
class Restorer:
    """Who restores: the identity the set-id rule compares recorded owners with."""

    euid: int
    groups: frozenset[int]  # the egid and the supplementary groups
    same_owner: bool = False

    @classmethod
    def current(cls, same_owner: bool = False) -> Restorer:
        return cls(os.geteuid(), frozenset({os.getegid(), *os.getgroups()}), same_owner)


def earned_setid(entry: Entry, uid: int, gid: int, restorer: Restorer) -> int:
    """The set-id bits of ``entry.mode`` that its restored copy, now owned by ``uid``:``gid``,
    may keep: set-uid only if that is its recorded owner and it was restored as such
    (``same_owner``) or is the restorer's own euid; set-gid only if that is its recorded group
    and it was restored as such or is one of the restorer's groups. An entry that records no
    owner keeps neither."""
    kept = 0
    if (
        entry.uid is not None
        and uid == entry.uid
        and (restorer.same_owner or entry.uid == restorer.euid)
    ):
        kept |= stat.S_ISUID
    if (
        entry.gid is not None
        and gid == entry.gid
        and (restorer.same_owner or entry.gid in restorer.groups)
    ):
        kept |= stat.S_ISGID
    return entry.mode & SETID & kept


@dataclass(frozen=True)
class RestoreResult:
    manifest_id: str
    dest: str
    files: int
    dirs: int
    symlinks: int
    fifos: int
    bytes_written: int
    not_restorable: tuple[tuple[str, str], ...]  # (path, type): sockets and devices
    setid_dropped: tuple[str, ...] = ()  # paths restored without the set-id bits they recorded
    owners_restored: bool = False  # every entry chowned to its recorded owner (same_owner)
    owners_unrecorded: int = 0  # entries whose checkpoint records no owner (a v1 tree)

    @property
    def complete(self) -> bool:
        return not self.not_restorable


def restore(
    store: ObjectStore,
    manifest_id: str,
    dest: str | os.PathLike[str],
    *,
    durable: bool = True,
    same_owner: bool = False,
) -> RestoreResult:
    """Rebuild the tree of ``manifest_id`` at ``dest`` (absent, or an empty directory).

    ``durable`` fsyncs every file and directory before the final rename (and the parent after),
    so a restore that returned survives a crash. ``same_owner`` gives every entry its recorded
    owner (root only: ``SameOwnerNeedsRoot`` otherwise, before anything is read or written);
    without it every entry is the restorer's, and set-id bits follow ``earned_setid``.
    """
    restorer = Restorer.current(same_owner)
    if same_owner and restorer.euid != 0:
        raise SameOwnerNeedsRoot(restorer.euid)
    dest = os.path.abspath(os.fspath(dest))
    _check_dest(dest)
    manifest = read_manifest(store, manifest_id)
    parent = os.path.dirname(dest)
    try:
        temp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.restore-", dir=parent)
    except FileNotFoundError:
        raise RestoreError(f"parent directory {parent!r} of {dest!r} does not exist") from None
    try:
        root_fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(root_fd, 0o700)  # not set-gid, even in a set-gid parent: entries are ours
            builder = _Builder(store, manifest, root_fd, durable, restorer)
            builder.build()
        finally:
            os.close(root_fd)
        _check_dest(dest)
        try:
            os.rename(temp, dest)
        except OSError as error:
            if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise DestinationNotEmpty(dest) from None
            raise
    except BaseException:
        _remove_tree(temp)
        raise
    if durable:
        _fsync_path(parent)
    counts = builder.counts
    return RestoreResult(
        manifest_id, dest, counts[FILE], counts[DIR], counts[SYMLINK], counts[FIFO],
        builder.bytes_written, tuple(builder.not_restorable), tuple(sorted(builder.dropped)),
        same_owner and not builder.unrecorded, builder.unrecorded,
    )  # fmt: skip


def _check_dest(dest: str) -> None:
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or os.listdir(dest):
        raise DestinationNotEmpty(dest)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    """Remove a failed restore's temp tree, even where modes were already applied."""
    with contextlib.suppress(FileNotFoundError):
        for top, _, _ in os.walk(path):  # never follows symlinks
            with contextlib.suppress(OSError):
                os.chmod(top, 0o700)
        shutil.rmtree(path)


class _Builder:
    def __init__(
        self, store: ObjectStore, manifest: Manifest, root_fd: int, durable: bool, who: Restorer
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.root_fd = root_fd
        self.durable = durable
        self.who = who
        self.dropped: list[str] = []  # paths whose set-id bits were not earned
        self.unrecorded = 0  # entries that record no owner
        self.dirs: list[Entry] = []
        self.made_dirs: set[str] = {ROOT}
        self.counts = {FILE: 0, DIR: 0, SYMLINK: 0, FIFO: 0}
        self.bytes_written = 0
        self.not_restorable: list[tuple[str, str]] = []

    def build(self) -> None:
        root: Entry | None = None
        for entry in self.manifest.entries:
            if entry.path == ROOT:
                root = entry
                continue
            path = check_path(entry.path)
            if parent_of(path) not in self.made_dirs:
                raise UnsafePath(path, "is not inside a directory this restore created")
            self.make(entry)
        for entry in sorted(self.dirs, key=lambda e: e.path.count("/"), reverse=True):
            self.finish_dir(entry)
        self.finish_dir(root if root is not None else Entry(ROOT, DIR, 0o755, 0))

    def make(self, entry: Entry) -> None:
        path, fd = entry.path, self.root_fd
        if entry.type == DIR:
            os.mkdir(path, 0o700, dir_fd=fd)
            self.made_dirs.add(path)
            self.dirs.append(entry)
        elif entry.type == FILE:
            self.write_file(entry)
        elif entry.type == SYMLINK and entry.target is not None:
            os.symlink(entry.target, path, dir_fd=fd)
            self.give_link_owner(entry)
        elif entry.type == FIFO:
            os.mkfifo(path, 0o600, dir_fd=fd)
            fifo = os.open(path, _OPEN_FIFO, dir_fd=fd)  # the FIFO this restore just made
            try:
                self.settle(fifo, entry)
            finally:
                os.close(fifo)
        else:  # sockets, and devices: never mknod'ed
            self.not_restorable.append((path, entry.type))
            return
        self.counts[entry.type] += 1

    def write_file(self, entry: Entry) -> None:
        path, digest = entry.path, entry.digest
        assert digest is not None  # a valid manifest's files all have digests
        out = os.open(path, _CREATE, 0o600, dir_fd=self.root_fd)
        try:
            actual, size = self.copy(digest, path, out)
            if actual != digest or size != entry.size:
                raise BlobCorrupt(digest, path, actual)
            self.settle(out, entry)  # after the content: a write would clear set-id bits
            if self.durable:
                os.fsync(out)
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(path, dir_fd=self.root_fd)
            raise
        os.close(out)
        self.bytes_written += size

    def copy(self, digest: str, path: str, out: int) -> tuple[str, int]:
        """Copy the object into ``out`` while hashing it; returns what it hashed to."""
        algo = self.manifest.algorithm
        try:
            source = self.store.open(digest)
        except ObjectMissing:
            raise BlobCorrupt(digest, path, "(missing from the object store)") from None
        hasher, size = new_hasher(algo), 0
        with source:
            while data := source.read(CHUNK):
                hasher.update(data)
                chunk = memoryview(data)
                while chunk:
                    chunk = chunk[os.write(out, chunk) :]
                size += len(data)
        return format_digest(algo, hasher.hexdigest()), size

    def finish_dir(self, entry: Entry) -> None:
        fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.root_fd)
        try:
            if self.durable:
                os.fsync(fd)
            self.settle(fd, entry)
        finally:
            os.close(fd)

    # -- owners and modes ----------------------------------------------------------------------

    def settle(self, fd: int, entry: Entry) -> None:
        """Give the open entry its owner (``same_owner``) and then its mode, set-id bits only
        where earned. The owner first: a chown clears set-id bits."""
        if not entry.owned:
            self.unrecorded += 1
        elif self.who.same_owner:
            assert entry.uid is not None and entry.gid is not None
            try:
                os.fchown(fd, entry.uid, entry.gid)
            except OSError as error:
                raise OwnerNotRestorable(entry.path, entry.uid, entry.gid, error) from None
        mode = entry.mode
        if mode & SETID:
            st = os.fstat(fd)
            if (
                mode & stat.S_ISGID
                and entry.gid is not None
                and st.st_gid != entry.gid
                and entry.gid in self.who.groups
            ):  # a member may give its file that group: no privilege is needed, none granted
                with contextlib.suppress(OSError):
                    os.fchown(fd, -1, entry.gid)
                    st = os.fstat(fd)
            kept = earned_setid(entry, st.st_uid, st.st_gid, self.who)
            if kept != mode & SETID:
                self.dropped.append(entry.path)
            mode = (mode & ~SETID) | kept
        os.fchmod(fd, mode)

    def give_link_owner(self, entry: Entry) -> None:
        """A symlink's owner (its mode means nothing on Linux, and it has no set-id bits)."""
        if not entry.owned:
            self.unrecorded += 1
        elif self.who.same_owner:
            assert entry.uid is not None and entry.gid is not None
            try:
                os.chown(
                    entry.path, entry.uid, entry.gid, dir_fd=self.root_fd, follow_symlinks=False
                )
            except OSError as error:
                raise OwnerNotRestorable(entry.path, entry.uid, entry.gid, error) from None
