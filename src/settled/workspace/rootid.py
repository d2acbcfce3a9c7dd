"""A workspace root's identity: the directory bound at `task new`, by device and inode.

Owns three reads of the filesystem, and nothing else:
- ``read`` (at `task new`): the root opened with ``O_DIRECTORY|O_NOFOLLOW`` (a symlink at its
  last component is refused; the path was resolved once with realpath before, and that
  resolved path is what the task records), its ``(st_dev, st_ino)``, and the identities of
  the directories that hold it (``ancestors``), as the task record stores them
  (``{"dev", "ino", "ancestors": [[dev, ino], ...]}``);
- ``open_checked`` (every scan): the root opened the same way and its identity compared with
  the recorded one, one open and one fstat; another directory, a symlink, a file or nothing
  there raises ``WorkspaceReplaced`` (any other error of the open is raised as it is);
- ``ancestors``: the directories above an opened one, two ways, both without following a
  link: its ``..`` chain from the descriptor (the mount tree: at a mount's root ``..`` goes to
  the directory it is mounted on), and its chain inside its own filesystem (the directory
  reopened by its file handle through a mount of that filesystem's root, ``open_by_handle_at``,
  then ``..`` from there), so a bind mount of a subdirectory shows the directories it really
  lies in. The second needs such a mount in this mount namespace and a filesystem that gives
  handles (ext4, tmpfs, xfs, btrfs do); without either it is left out, and the first stands.

Whether two recorded identities overlap is decided in store/rows.py (pure). Never writes,
never follows a symlink, never reads a file's contents.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Final

from settled.errors import WorkspaceReplaced
from settled.where import mountinfo_path

Identity = tuple[int, int]

_ROOT_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_UP_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_DEPTH: Final = 4096  # a chain of `..` longer than any path can be (PATH_MAX / 2)
MAX_HANDLE_SZ: Final = 128
AT_EMPTY_PATH: Final = 0x1000
MOUNTINFO: Final = "/proc/self/mountinfo"


def identity_of(fd: int) -> Identity:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def recorded(identity: dict[str, Any] | None) -> Identity | None:
    """The root's (dev, ino) a task record holds; None for a task made before identities."""
    if identity is None:
        return None
    return int(identity["dev"]), int(identity["ino"])


def read(root: str) -> dict[str, Any]:
    """What `task new` records of the resolved root `root` (see the module's docstring).
    OSError if it cannot be opened as a directory without following a symlink."""
    fd = os.open(root, _ROOT_FLAGS)
    try:
        dev, ino = identity_of(fd)
        chain = ancestors(fd)
    finally:
        os.close(fd)
    return {"dev": dev, "ino": ino, "ancestors": [list(pair) for pair in chain]}


def open_checked(root: str, expected: Identity) -> int:
    """A descriptor of the directory at `root`, which is the one recorded (`expected`), else
    WorkspaceReplaced naming what is there now. One open and one fstat."""
    try:
        fd = os.open(root, _ROOT_FLAGS)
    except OSError as error:
        if error.errno not in _REPLACED:
            raise  # the root is there but cannot be opened now (no descriptor, no access)
        raise WorkspaceReplaced(root, expected, None, _why_not_opened(root, error)) from None
    found = identity_of(fd)
    if found != expected:
        os.close(fd)
        raise WorkspaceReplaced(root, expected, found, "another directory")
    return fd


_REPLACED: Final = frozenset((errno.ELOOP, errno.ENOTDIR, errno.ENOENT))


def _why_not_opened(root: str, error: OSError) -> str:
    if error.errno == errno.ELOOP or (error.errno == errno.ENOTDIR and os.path.islink(root)):
        return "a symlink"
    if error.errno == errno.ENOTDIR:
        return "not a directory"
    return "nothing"


def ancestors(fd: int) -> list[Identity]:
    """The directories holding the one open at `fd`, innermost first, each once: its `..`
    chain, then those of its chain inside its filesystem that the first did not name."""
    chain = dotdot_chain(fd)
    seen = set(chain)
    for pair in filesystem_chain(fd):
        if pair not in seen:
            seen.add(pair)
            chain.append(pair)
    return chain


def dotdot_chain(fd: int) -> list[Identity]:
    """`..` from `fd` until it leads nowhere new (the root of this mount namespace), or to a
    directory this process may not search (the chain then stops there: fewer overlaps are
    caught, and the task is not refused for it)."""
    chain: list[Identity] = []
    here = identity_of(fd)
    try:
        current = os.open("..", _UP_FLAGS, dir_fd=fd)
    except OSError:
        return chain
    try:
        for _ in range(MAX_DEPTH):
            up = identity_of(current)
            if up == here:
                break
            chain.append(up)
            parent = os.open("..", _UP_FLAGS, dir_fd=current)
            os.close(current)
            current, here = parent, up
    except OSError:
        pass
    finally:
        os.close(current)
    return chain


def filesystem_chain(fd: int) -> list[Identity]:
    """The directories holding `fd`'s inside its own filesystem (through a mount of that
    filesystem's root), innermost first; empty when there is no such mount here or the
    filesystem gives no handles."""
    dev = os.fstat(fd).st_dev
    mount = _root_mount_of(dev)
    if mount is None:
        return []
    try:
        reopened = _reopen_by_handle(fd, mount)
    except OSError:
        return []
    try:
        if identity_of(reopened) != identity_of(fd):
            return []
        return dotdot_chain(reopened)
    finally:
        os.close(reopened)


def _reopen_by_handle(fd: int, mount: str) -> int:
    """`fd`'s directory opened again by its file handle, through the mount at `mount` (ctypes
    imported here: only `task new` pays for it, never a scan)."""
    import ctypes

    class FileHandle(ctypes.Structure):
        _fields_ = (
            ("handle_bytes", ctypes.c_uint),
            ("handle_type", ctypes.c_int),
            ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ),
        )

    libc = ctypes.CDLL(None, use_errno=True)
    handle = FileHandle()
    handle.handle_bytes = MAX_HANDLE_SZ
    mount_id = ctypes.c_int()
    if libc.name_to_handle_at(fd, b"", ctypes.byref(handle), ctypes.byref(mount_id),
                              AT_EMPTY_PATH) != 0:  # fmt: skip
        raise OSError(ctypes.get_errno(), "name_to_handle_at")
    mount_fd = os.open(mount, _ROOT_FLAGS)  # not O_PATH: open_by_handle_at refuses one
    try:
        if os.fstat(mount_fd).st_dev != os.fstat(fd).st_dev:
            raise OSError(errno.EXDEV, "mount point moved")
        opened = libc.open_by_handle_at(mount_fd, ctypes.byref(handle), _UP_FLAGS)
        if opened < 0:
            raise OSError(ctypes.get_errno(), "open_by_handle_at")
        return int(opened)
    finally:
        os.close(mount_fd)


def _root_mount_of(dev: int) -> str | None:
    """Where a mount of the filesystem `dev` whose root is that filesystem's own is mounted in
    this mount namespace, or None."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as lines:
            for line in lines:
                fields = line.split(" ")
                if len(fields) < 5 or fields[3] != "/":
                    continue
                major, _, minor = fields[2].partition(":")
                if os.makedev(int(major), int(minor)) == dev:
                    return mountinfo_path(fields[4])
    except (OSError, ValueError):
        return None
    return None
