"""Restore a manifest into an empty directory, exactly, or not at all.

Owns ``restore``: read the manifest back by its exact id, rebuild the tree in a private temp
directory beside ``dest`` (directories, files with content verified by hash while copying,
symlinks as links, FIFOs with ``mkfifo``), apply modes after content (files as they are
finished, directories last and deepest first, the root last of all), fsync, then rename the
temp directory onto ``dest``. Sockets and devices cannot be restored and are named in the result.

Must never: write outside the temp directory or ``dest``; follow a symlink (a manifest path
whose parent is not a directory restored earlier is refused, so a link created by the restore is
never traversed); leave a partial tree at ``dest`` (on any failure the temp directory is removed
and ``dest`` is untouched); replace a ``dest`` that exists and is not an empty directory;
accept content that does not hash to its digest.
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
_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


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

    @property
    def complete(self) -> bool:
        return not self.not_restorable


def restore(
    store: ObjectStore, manifest_id: str, dest: str | os.PathLike[str], *, durable: bool = True
) -> RestoreResult:
    """Rebuild the tree of ``manifest_id`` at ``dest`` (absent, or an empty directory).

    ``durable`` fsyncs every file and directory before the final rename (and the parent after),
    so a restore that returned survives a crash.
    """
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
            builder = _Builder(store, manifest, root_fd, durable)
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
        builder.bytes_written, tuple(builder.not_restorable),
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
    def __init__(self, store: ObjectStore, manifest: Manifest, root_fd: int, durable: bool) -> None:
        self.store = store
        self.manifest = manifest
        self.root_fd = root_fd
        self.durable = durable
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
            self.finish_dir(entry.path, entry.mode)
        self.finish_dir(ROOT, root.mode if root is not None else 0o755)

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
        elif entry.type == FIFO:
            os.mkfifo(path, 0o600, dir_fd=fd)
            os.chmod(path, entry.mode, dir_fd=fd)  # the FIFO this restore just made
        else:
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
            os.fchmod(out, entry.mode)  # after the content: a write would clear set-id bits
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

    def finish_dir(self, path: str, mode: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.root_fd)
        try:
            if self.durable:
                os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
