"""Restore a manifest into an empty directory, exactly, or not at all.

Owns ``restore``: reach ``dest``'s parent from ``/`` without following a symlink and hold it
open, read the manifest back by its exact id, rebuild the tree in a private temp directory made
through that fd beside ``dest`` (directories, files with content verified by hash while copying,
symlinks as links, FIFOs with ``mkfifo``; a sparse file sized by ``ftruncate`` and its extents
written at their offsets, so its holes stay holes), apply owners, modes and recorded
modification times after content (files as they are finished, directories last and deepest
first, since making a child changes its directory's time, the root last of all), fsync, then
rename the temp directory onto ``dest`` within the parent's fd (``renameat``), so a symlink
swapped in after the checks cannot redirect the restore. Sockets and devices cannot be restored
and are named in the result; a device node is never created.

Any depth. Every call below the temp directory names one component relative to its directory's
fd (``mkdir``, ``open``, ``symlink``, ``mkfifo`` with ``dir_fd``; ``fchown``, ``fchmod`` and
``utime`` on open fds; a symlink's owner and time by its name in its directory's fd, never
followed): the build holds the fds of the directories from the root down to the one it fills,
one per level, as the scan does, so a tree deeper than PATH_MAX restores like any other. The
cleanup of a failed restore walks by fds too (``fwalk`` and ``rmtree`` with ``dir_fd``).

Hard links. The files of one link group (``Entry.link``, a ``settled.tree/v4`` field) are one
inode again: the first member is written (its content checked, owner, mode and time applied),
every later one that records the same content, size, mode, owner and time is ``linkat``'ed to
it (relative to both directories' fds), never copied, and counted in ``hard_links``; one that
disagrees (the file changed between its links' reads) is written as a file of its own. Members
the checkpoint left out (outside the workspace, ignored) are simply absent.

Restore grants nothing (tar's convention). The command that made the workspace is hostile, and
the restore often runs as root: a set-uid file of ``nobody`` restored by root with its mode
would be a set-uid *root* file. So every entry is owned by whoever restores, unless
``same_owner`` (root only) chowns each entry to its recorded uid and gid; and a set-uid bit is
kept only with ``same_owner`` or when the recorded uid is the restoring euid, a set-gid bit only
with ``same_owner`` or when the recorded gid is the restoring egid or one of its groups (the
entry is then given that group). An entry that records no owner (a v1 tree) keeps no set-id
bit, even with ``same_owner``: there is no owner to restore. The sticky bit is kept. Every bit
dropped is named in the result (``setid_dropped``); ``earned_setid`` is the rule, without I/O.

Extended attributes (``xattrs.py``), after the owner and the mode and before the time:
``user.*`` and the POSIX ACLs always, ``trusted.*`` and ``security.*`` (file capabilities,
set last of all: a chown or a write clears one) only with ``same_owner``, exactly like set-id
bits; every one not set is named in the result (``xattrs_dropped``). A directory's default
ACL is set when it is finished, after everything below it exists, so nothing restored
inherits it (each child's own ACL is set from its record), and the temp directory drops the
ACLs it inherited from the destination's parent before anything is made in it, so an entry
that records none ends with none. The root's attributes are not recorded (``NOT_RECORDED``).

Times. An entry whose tree records its ``mtime`` (``settled.tree/v3``) gets it back, atime and
mtime both (``utime`` with ``ns=``, on the open fd, or the link itself for a symlink), so a
build tool that compares times sees the order the checkpoint saw and rebuilds nothing after a
restore. An entry of an older tree keeps the time its restore wrote (counted in
``times_unrecorded``); the root's time is in a v4 manifest's root. A time that cannot be set
fails the restore like any other write: a restored tree is exact or absent.

About 770 lines, over the usual 400: the destination's no-follow walk and the builder (its walk
by fds, link groups, owners, modes, attributes and times) share the parent's fd and the one
cleanup path that leaves nothing behind; what does not, the attribute rules, is ``xattrs``.

Must never: write outside the temp directory or ``dest``; follow a symlink (a ``dest`` that is
a symlink or lies under one is refused, naming it; a manifest path whose parent is not a
directory restored earlier is refused, so a link created by the restore is never traversed);
leave a partial tree at ``dest`` (on any failure the temp directory is removed and ``dest`` is
untouched); replace a ``dest`` that exists and is not an empty directory; accept content that
does not hash to its digest; create a set-id file or directory owned by anyone the
checkpoint's author could not already run as, or set a file capability, ``trusted.*`` or
``security.*`` attribute without ``same_owner``; create a device node.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from settled.errors import EXIT_USAGE, SettledError
from settled.objects import CHUNK, ObjectMissing, ObjectStore
from settled.objects.hashing import Hasher, format_digest, new_hasher
from settled.workspace.manifest import (
    DIR,
    FILE,
    ROOT,
    SYMLINK,
    Entry,
    Manifest,
    UnsafePath,
    check_path,
    name_of,
    parent_of,
    read_manifest,
)
from settled.workspace.sparse import hash_zeros
from settled.workspace.walk import open_beneath
from settled.workspace.xattrs import drop_inherited_acls, setting_order
from settled.workspace.xattrs import restorable as xattr_restorable

FIFO: Final = "fifo"
SETID: Final = stat.S_ISUID | stat.S_ISGID
_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FIFO: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC  # never blocks
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WALK_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC  # needs search, not read


class RestoreError(SettledError):
    """The manifest could not be restored; nothing was left at the destination."""


class DestinationNotEmpty(RestoreError):
    def __init__(self, dest: str) -> None:
        super().__init__(
            f"restore destination {dest!r} exists and is not an empty directory; "
            "choose a new path or empty it"
        )
        self.dest = dest


class DestinationIsSymlink(RestoreError):
    def __init__(self, dest: str, component: str, target: str) -> None:
        where = "is" if component == dest else f"goes through {component!r}, which is"
        super().__init__(
            f"restore destination {dest!r} {where} a symlink to {target!r}; restore never "
            "follows a symlink, so nothing was written. Name a path without symlinks"
        )
        self.dest, self.component, self.target = dest, component, target


class DestinationMoved(RestoreError):
    def __init__(self, dest: str) -> None:
        super().__init__(
            f"the parent of restore destination {dest!r} was moved or replaced during the "
            "restore; nothing was left at the destination. Restore again"
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
    exit_code = EXIT_USAGE  # an option this caller cannot use: nothing was read or written

    def __init__(self, euid: int) -> None:
        super().__init__(
            f"restore --same-owner chowns every entry to its recorded owner, which needs root; "
            f"this process runs as euid {euid}. Restore without --same-owner (every entry is "
            "then yours, and set-id bits you have not earned are dropped), or run it as root"
        )
        self.euid = euid


class XattrNotRestorable(RestoreError):
    def __init__(self, path: str, name: str, error: OSError) -> None:
        super().__init__(
            f"cannot set extended attribute {name!r} of {path!r}: {error.strerror or error}; "
            "restore refused, nothing written at the destination (restore onto a filesystem "
            "that supports it)"
        )
        self.path, self.name = path, name


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
    times_unrecorded: int = 0  # entries that record no mtime (a v1/v2 tree, a v3 manifest's root)
    hard_links: int = 0  # files made as another link of a file written (a link group's members)
    xattrs_dropped: tuple[tuple[str, str], ...] = ()  # (path, xattr) not set: not earned

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
    parent_fd, name = _open_parent(dest)
    try:
        _check_dest(parent_fd, name, dest)
        manifest = read_manifest(store, manifest_id)
        temp = _make_temp(parent_fd, name, dest)
        try:
            root_fd = os.open(temp, _DIR_FLAGS, dir_fd=parent_fd)
            try:
                os.fchmod(root_fd, 0o700)  # not set-gid, even in a set-gid parent
                drop_inherited_acls(root_fd)  # nothing below inherits the parent's default ACL
                builder = _Builder(store, manifest, root_fd, durable, restorer)
                builder.build()
            finally:
                os.close(root_fd)
            _check_dest(parent_fd, name, dest)
            _check_still_at(dest, parent_fd)
            _rename(parent_fd, temp, name, dest)
            try:
                _check_still_at(dest, parent_fd)
            except RestoreError:  # the parent moved between the check and the rename: undo
                os.rename(name, temp, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                raise
        except BaseException:
            _remove_tree(parent_fd, temp)
            raise
        if durable:
            os.fsync(parent_fd)
    finally:
        os.close(parent_fd)
    counts = builder.counts
    return RestoreResult(
        manifest_id, dest, counts[FILE], counts[DIR], counts[SYMLINK], counts[FIFO],
        builder.bytes_written, tuple(builder.not_restorable), tuple(sorted(builder.dropped)),
        same_owner and not builder.unrecorded, builder.unrecorded, builder.timeless,
        builder.linked, tuple(builder.xattrs_dropped),
    )  # fmt: skip


# -- the destination: reached without following, worked on through its parent's fd -----------
#
# Every step after ``_open_parent`` is relative to ``parent_fd``: the temp directory is made
# with ``mkdir(dir_fd=)``, the tree is built through the temp directory's own fd, and the
# rename is ``renameat`` within ``parent_fd``. So a symlink swapped in after the check, at
# the parent or at any ancestor, cannot redirect the restore: the fd is the directory that was
# checked, wherever it is now. ``_check_still_at`` re-walks the path before the rename (refused:
# nothing written) and after it (undone: the tree is renamed back and removed), so the result
# never names a path that does not hold the tree. A swap at ``dest`` itself cannot be followed
# either: ``rename`` replaces a final-component symlink rather than following it, and a
# directory cannot replace a symlink (ENOTDIR), so that restore is refused.


def _open_parent(dest: str) -> tuple[int, str]:
    """An fd of ``dest``'s parent (readable, for fsync) and ``dest``'s name, reached from ``/``
    one component at a time with ``O_NOFOLLOW``: ``DestinationIsSymlink`` names the first
    component that is a symlink, and nothing is followed to find it."""
    head, name = os.path.split(dest)
    if not name:
        raise RestoreError(f"restore destination {dest!r} is the root directory; choose a path")
    fd = os.open("/", _WALK_FLAGS)
    try:
        walked = ""
        for part in filter(None, head.split("/")):
            walked += "/" + part
            try:
                next_fd = os.open(part, _WALK_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as error:
                raise _refusal(fd, part, walked, dest, error) from None
            os.close(fd)
            fd = next_fd
        try:
            return os.open(".", _DIR_FLAGS, dir_fd=fd), name
        except OSError as error:
            raise _refusal(fd, ".", head, dest, error) from None
    finally:
        os.close(fd)


def _refusal(dir_fd: int, name: str, shown: str, dest: str, error: OSError) -> RestoreError:
    """Why ``name`` (shown as ``shown``) on the way to ``dest`` cannot be entered."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return RestoreError(f"parent directory {shown!r} of {dest!r} does not exist")
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return DestinationIsSymlink(dest, shown, _readlink(dir_fd, name))
    if st is not None and not stat.S_ISDIR(st.st_mode):
        return RestoreError(f"{shown!r} on the way to restore destination {dest!r} is no directory")
    return RestoreError(f"cannot open {shown!r} on the way to {dest!r}: {error.strerror or error}")


def _readlink(dir_fd: int, name: str) -> str:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as error:
        return f"(unreadable: {error.strerror or error})"


def _check_dest(parent_fd: int, name: str, dest: str) -> None:
    """``dest`` is absent or an empty directory (not a symlink to one)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise DestinationIsSymlink(dest, dest, _readlink(parent_fd, name))
    if not stat.S_ISDIR(st.st_mode):
        raise DestinationNotEmpty(dest)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as error:
        raise _refusal(parent_fd, name, dest, dest, error) from None
    try:
        if os.listdir(fd):
            raise DestinationNotEmpty(dest)
    finally:
        os.close(fd)


def _check_still_at(dest: str, parent_fd: int) -> None:
    """The path to ``dest`` still leads, without a symlink, to the directory ``parent_fd`` is."""
    again, _ = _open_parent(dest)
    try:
        now, then = os.fstat(again), os.fstat(parent_fd)
    finally:
        os.close(again)
    if (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino):
        raise DestinationMoved(dest)


def _make_temp(parent_fd: int, name: str, dest: str) -> str:
    """A new private directory beside ``dest``, made through the parent's fd."""
    for _ in range(100):
        temp = f".{name[:64]}.restore-{secrets.token_hex(6)}"
        try:
            os.mkdir(temp, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            continue
        except OSError as error:
            raise RestoreError(
                f"cannot make a temp directory beside {dest!r}: {error.strerror or error}"
            ) from None
        return temp
    raise RestoreError(f"no unused temp directory name beside {dest!r} in 100 tries")


def _rename(parent_fd: int, temp: str, name: str, dest: str) -> None:
    try:
        os.rename(temp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except OSError as error:
        if error.errno == errno.ENOTDIR:  # something not a directory was put at dest
            _check_dest(parent_fd, name, dest)
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise DestinationNotEmpty(dest) from None
        raise


def _remove_tree(parent_fd: int, temp: str) -> None:
    """Remove a failed restore's temp tree, even where modes were already applied, without
    following a symlink (``fwalk`` and ``rmtree`` work through directory fds)."""
    with contextlib.suppress(FileNotFoundError):
        _unlock(parent_fd, temp)
        for _, subdirs, _, dir_fd in os.fwalk(temp, dir_fd=parent_fd):
            for subdir in subdirs:
                _unlock(dir_fd, subdir)
        shutil.rmtree(temp, dir_fd=parent_fd)


def _unlock(dir_fd: int, name: str) -> None:
    """Make the directory ``name`` (never what a symlink there names) 0o700."""
    try:
        fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)  # an O_PATH fd cannot be fchmod'ed
    except OSError:
        pass
    finally:
        os.close(fd)


def _inode_facts(entry: Entry) -> tuple[object, ...]:
    """What every link of one file shares, as its entry records it."""
    return (
        entry.digest, entry.size, entry.extents, entry.mode, entry.uid, entry.gid, entry.mtime,
        entry.xattrs,
    )  # fmt: skip


class _Builder:
    """The tree built through directory fds: a walk that holds one fd per level (the fds of
    the directories from the root down to the one being filled), so every call names one
    component, whatever the depth (a path of 20 directories of 250-byte names is past
    PATH_MAX, and restored by name as any other)."""

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
        self.timeless = 0  # entries that record no mtime
        self.children: dict[str, list[Entry]] = {}  # a directory's path -> its entries
        self.counts = {FILE: 0, DIR: 0, SYMLINK: 0, FIFO: 0}
        self.bytes_written = 0
        self.not_restorable: list[tuple[str, str]] = []
        self.xattrs_dropped: list[tuple[str, str]] = []  # (path, name) not this restorer's
        self.linked = 0  # files made as another link of a file this restore wrote
        self.groups: dict[str, Entry] = {}  # a link group's key -> its member written first
        self.source: tuple[str, int] | None = None  # a group's first directory, held open

    def build(self) -> None:
        root = self.plan()
        try:
            self.make_all()
        finally:
            self.let_go_of_source()
        self.finish_all(root if root is not None else Entry(ROOT, DIR, 0o755, 0))

    def plan(self) -> Entry | None:
        """Every entry under its parent directory (the root entry returned apart); refused
        before anything is made if a path is unsafe or its parent is no directory of the
        manifest (a symlink, say: the restore then never goes through it)."""
        dirs = {ROOT} | {entry.path for entry in self.manifest.entries if entry.type == DIR}
        root: Entry | None = None
        for entry in self.manifest.entries:
            if entry.path == ROOT:
                root = entry
                continue
            path = check_path(entry.path)
            parent = parent_of(path)
            if parent not in dirs:
                raise UnsafePath(path, "is not inside a directory this restore created")
            self.children.setdefault(parent, []).append(entry)
        return root

    def make_all(self) -> None:
        """Every entry made, depth first, each relative to its directory's fd."""
        stack = [(self.root_fd, iter(self.children.get(ROOT, ())))]
        try:
            while stack:
                fd, pending = stack[-1]
                entry = next(pending, None)
                if entry is None:
                    stack.pop()
                    if fd != self.root_fd:
                        os.close(fd)
                    continue
                sub = self.make(fd, entry)
                if sub is not None:
                    stack.append((sub, iter(self.children.get(entry.path, ()))))
        finally:
            for fd, _ in stack:
                if fd != self.root_fd:
                    os.close(fd)

    def finish_all(self, root: Entry) -> None:
        """Owners, modes and times of the directories, each after everything below it (a
        child made or changed afterwards would change its time), the root last of all."""
        stack = [(self.root_fd, root, self.subdirs(ROOT))]
        try:
            while stack:
                fd, entry, pending = stack[-1]
                child = next(pending, None)
                if child is None:
                    stack.pop()
                    try:
                        self.finish_dir(fd, entry)
                    finally:
                        if fd != self.root_fd:
                            os.close(fd)
                    continue
                sub = os.open(name_of(child.path), _DIR_FLAGS, dir_fd=fd)
                stack.append((sub, child, self.subdirs(child.path)))
        finally:
            for fd, _, _ in stack:
                if fd != self.root_fd:
                    os.close(fd)

    def subdirs(self, path: str) -> Iterator[Entry]:
        return (entry for entry in self.children.get(path, ()) if entry.type == DIR)

    def make(self, fd: int, entry: Entry) -> int | None:
        """Make ``entry`` in the directory open at ``fd``; a directory's own fd is returned
        (the caller fills it, then closes it)."""
        name = name_of(entry.path)
        sub = None
        if entry.type == DIR:
            os.mkdir(name, 0o700, dir_fd=fd)
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
        elif entry.type == FILE:
            if not self.link_member(fd, name, entry):
                self.write_file(fd, name, entry)
        elif entry.type == SYMLINK and entry.target is not None:
            os.symlink(entry.target, name, dir_fd=fd)
            self.give_link_owner(fd, name, entry)
            self.set_xattrs(f"/proc/self/fd/{fd}/{name}", entry)
            self.set_time(entry, name, fd)
        elif entry.type == FIFO:
            os.mkfifo(name, 0o600, dir_fd=fd)
            fifo = os.open(name, _OPEN_FIFO, dir_fd=fd)  # the FIFO this restore just made
            try:
                self.settle(fifo, entry)
                self.set_time(entry, fifo)
            finally:
                os.close(fifo)
        else:  # sockets, and devices: never mknod'ed
            self.not_restorable.append((entry.path, entry.type))
            return None
        self.counts[entry.type] += 1
        return sub

    def write_file(self, dir_fd: int, name: str, entry: Entry) -> None:
        path, digest = entry.path, entry.digest
        assert digest is not None  # a valid manifest's files all have digests
        out = os.open(name, _CREATE, 0o600, dir_fd=dir_fd)
        try:
            if entry.extents is not None:
                size = self.write_sparse(entry, out)
            else:
                actual, size = self.copy(digest, path, out)
                if actual != digest or size != entry.size:
                    raise BlobCorrupt(digest, path, actual)
            self.settle(out, entry)  # after the content: a write would clear set-id bits
            self.set_time(entry, out)  # after every write: a write would set it to now
            if self.durable:
                os.fsync(out)
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        os.close(out)
        self.bytes_written += size
        if entry.link is not None:
            self.groups.setdefault(entry.link, entry)

    # -- hard links ------------------------------------------------------------------------------

    def link_member(self, fd: int, name: str, entry: Entry) -> bool:
        """Make ``entry`` another link of its group's file, if this restore wrote one that it
        agrees with (content, size, mode, owner, time: one inode has one of each); the blob is
        never copied again. A member that disagrees (the file changed between two links'
        reads) is written as a file of its own: it gets exactly what it recorded."""
        first = self.groups.get(entry.link) if entry.link is not None else None
        if first is None or _inode_facts(first) != _inode_facts(entry):
            return False
        source_fd = self.source_dir(parent_of(first.path))
        os.link(
            name_of(first.path), name, src_dir_fd=source_fd, dst_dir_fd=fd, follow_symlinks=False
        )
        self.linked += 1
        if first.path in self.dropped:  # one inode: its links lack the bits it lacks
            self.dropped.append(entry.path)
        self.xattrs_dropped += [
            (entry.path, attr)
            for attr, _ in entry.xattrs or ()
            if not xattr_restorable(attr, self.who.same_owner)
        ]  # and the attributes it lacks
        return True

    def source_dir(self, path: str) -> int:
        """The directory ``path`` of the temp tree, opened one name at a time from the root
        without following (every directory is this restore's own, 0o700 until the finish),
        kept open for the next member of the group."""
        if self.source is not None and self.source[0] == path:
            return self.source[1]
        self.let_go_of_source()
        fd = open_beneath(self.root_fd, path)
        if fd is None:  # a directory this restore made, gone or replaced under it
            raise OSError(errno.ENOENT, f"the restore's own directory {path!r} cannot be opened")
        self.source = (path, fd)
        return fd

    def let_go_of_source(self) -> None:
        if self.source is not None:
            os.close(self.source[1])
            self.source = None

    def write_sparse(self, entry: Entry, out: int) -> int:
        """A sparse file: its size set by ``ftruncate`` (a hole throughout), then each extent
        written at its offset, so every hole stays a hole and no zero is written for one. Each
        extent is checked against its own digest and the whole, holes as zeros, against the
        file's; returns the bytes written."""
        assert entry.digest is not None and entry.extents is not None
        algo, path = self.manifest.algorithm, entry.path
        os.ftruncate(out, entry.size)
        logical = new_hasher(algo, size_hint=entry.size)
        pos = written = 0
        for offset, length, digest in entry.extents:
            hash_zeros(logical, offset - pos)
            os.lseek(out, offset, os.SEEK_SET)
            actual, size = self.copy(digest, path, out, also=logical)
            if actual != digest or size != length:
                raise BlobCorrupt(digest, path, actual)
            pos, written = offset + length, written + length
        hash_zeros(logical, entry.size - pos)
        actual = format_digest(algo, logical.hexdigest())
        if actual != entry.digest:
            raise BlobCorrupt(entry.digest, path, actual)
        return written

    def copy(
        self, digest: str, path: str, out: int, *, also: Hasher | None = None
    ) -> tuple[str, int]:
        """Copy the object into ``out`` while hashing it (into ``also`` too, if given);
        returns what it hashed to."""
        algo = self.manifest.algorithm
        try:
            source = self.store.open(digest)
        except ObjectMissing:
            raise BlobCorrupt(digest, path, "(missing from the object store)") from None
        hasher, size = new_hasher(algo), 0
        with source:
            while data := source.read(CHUNK):
                hasher.update(data)
                if also is not None:
                    also.update(data)
                chunk = memoryview(data)
                while chunk:
                    chunk = chunk[os.write(out, chunk) :]
                size += len(data)
        return format_digest(algo, hasher.hexdigest()), size

    def finish_dir(self, fd: int, entry: Entry) -> None:
        self.settle(fd, entry)
        self.set_time(entry, fd)  # the root's too: a rename keeps the renamed dir's time
        if self.durable:  # after the owner, mode and time, so the fsync covers them
            os.fsync(fd)

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
        self.set_xattrs(fd, entry)

    def set_xattrs(self, target: int | str, entry: Entry) -> None:
        """The entry's recorded extended attributes, after its owner and mode (a chown clears
        a file capability, and an ACL is the mode's group bits too), the capability last;
        those ``xattrs.restorable`` refuses this restorer are named in ``xattrs_dropped``.
        ``target``: an open fd, or a symlink's ``/proc/self/fd/<dir fd>/<name>``, never
        followed. One that cannot be set fails the restore, naming it."""
        for name, value in setting_order(entry.xattrs or ()):
            if not xattr_restorable(name, self.who.same_owner):
                self.xattrs_dropped.append((entry.path, name))
                continue
            try:
                if isinstance(target, int):
                    os.setxattr(target, name, value)
                else:
                    os.setxattr(target, name, value, follow_symlinks=False)
            except OSError as error:
                raise XattrNotRestorable(entry.path, name, error) from None

    def set_time(self, entry: Entry, target: int | str, dir_fd: int | None = None) -> None:
        """Give the entry its recorded mtime (as atime too): through an fd this restore opened,
        or, for a symlink, the link itself by its name in ``dir_fd`` (never what it points at)."""
        if entry.mtime is None:
            self.timeless += 1
            return
        times = (entry.mtime, entry.mtime)
        if isinstance(target, int):
            os.utime(target, ns=times)
        else:
            os.utime(target, ns=times, dir_fd=dir_fd, follow_symlinks=False)

    def give_link_owner(self, dir_fd: int, name: str, entry: Entry) -> None:
        """A symlink's owner (its mode means nothing on Linux, and it has no set-id bits)."""
        if not entry.owned:
            self.unrecorded += 1
        elif self.who.same_owner:
            assert entry.uid is not None and entry.gid is not None
            try:
                os.chown(name, entry.uid, entry.gid, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as error:
                raise OwnerNotRestorable(entry.path, entry.uid, entry.gid, error) from None
