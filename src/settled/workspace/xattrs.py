"""Extended attributes of workspace entries: read by the scan, recorded in trees, set by restore.

Owns ``read_at`` (one entry's attributes, read by its name in its directory's fd through
``/proc/self/fd/<dir fd>/<name>`` with ``follow_symlinks=False``: one ``listxattr``, and a
``getxattr`` for each name it lists) and ``read_fd`` (an open directory's), the form a tree
records (``{name: base64 value}``, names sorted by the canonical encoding), its checks, which
attributes a restore sets (``restorable``, the rule that mirrors restore's set-id rule), and
``NOT_RECORDED``, what the proof still does not cover, which every checkpoint receipt names.

What is recorded: every attribute the scanning process can list and read, of every namespace:
``user.*``, ``trusted.*`` (listed only to CAP_SYS_ADMIN), ``security.*`` (``security.capability``:
file capabilities; an LSM's labels) and ``system.posix_acl_access`` / ``system.posix_acl_default``
(POSIX ACLs, in the kernel's binary form). A filesystem without extended attributes (ENOTSUP)
records none; an attribute gone between the listing and its read is left out.

Why reading them costs nothing on an unchanged tree: ``setxattr`` and ``removexattr`` change the
inode's ctime, so an entry the stat cache vouches for (ctime unchanged, older than its cutoff)
has the attributes its row recorded, and only a fresh entry pays the ``listxattr``. A change
between an entry's lstat and the read of its attributes leaves a ctime that the next scan sees
changed, so it is re-read then: the stat cache never vouches for attributes it did not see.

Restore. ``user.*`` and the POSIX ACLs are the restorer's to set on files it owns, and are
always set; ``trusted.*``, ``security.*`` (a file capability is privilege, like a set-uid bit)
and any other name only with ``same_owner`` (root restoring every owner), else named in the
result as dropped. The command that wrote them is hostile: a capability restored onto a file
owned by the restorer would grant what its author never had.

An attribute's name is any bytes but NUL after its namespace, as a file's name is: recorded as
the text ``os.fsdecode`` makes of them (a byte that is not UTF-8 written ``\\udcXX``), so a
command that names one ``user.\\xff`` cannot keep a task from completing.

Must never: follow a symlink, open the entry it reads, or accept a tree form that is not
canonical (sorted names, standard base64 that re-encodes to
itself, within the kernel's sizes).
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
from typing import Any, Final

Xattrs = tuple[tuple[str, bytes], ...]  # (name, value), sorted by name; () records none
NONE: Final[Xattrs] = ()
FIELD: Final = "xattrs"
CAPABILITY: Final = "security.capability"
ACL_ACCESS: Final = "system.posix_acl_access"
ACL_DEFAULT: Final = "system.posix_acl_default"
ACLS: Final = (ACL_ACCESS, ACL_DEFAULT)
NAMESPACES: Final = ("user.", "trusted.", "security.", "system.")
MAX_NAME: Final = 255  # XATTR_NAME_MAX
MAX_VALUE: Final = 65536  # XATTR_SIZE_MAX
_PROC_FD: Final = "/proc/self/fd"
_NONE_HERE: Final = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP})
_GONE: Final = frozenset({errno.ENODATA, errno.ENOENT})

NOT_RECORDED: Final = (
    "the workspace root directory's extended attributes and ACLs",
    "extended attributes the scanning process cannot list or read "
    "(trusted.* without CAP_SYS_ADMIN)",
    "file flags (chattr +i, +a and the others: FS_IOC_GETFLAGS)",
    "atime, ctime and birth time (the mtime is recorded)",
    "inode numbers (hard links of regular files are recorded as link groups; "
    "hard links of other entries restore as separate entries)",
    "sockets and device nodes beyond their type and number (never restored)",
)
"""What a checkpoint does not cover, named in every checkpoint receipt's ``covers``."""


def read_at(dir_fd: int, name: str, path: str) -> Xattrs:
    """The attributes of the entry ``name`` in the directory open at ``dir_fd`` (never
    followed: a symlink's own), sorted; ``path`` names it in an error."""
    where = f"{_PROC_FD}/{dir_fd}/{name}"
    try:
        names = os.listxattr(where, follow_symlinks=False)
    except OSError as error:
        if error.errno in _NONE_HERE or error.errno in _GONE:
            return NONE
        raise
    if not names:
        return NONE
    return _values(names, path, lambda attr: os.getxattr(where, attr, follow_symlinks=False))


def read_fd(fd: int, path: str) -> Xattrs:
    """The attributes of the file or directory open at ``fd``."""
    try:
        names = os.listxattr(fd)
    except OSError as error:
        if error.errno in _NONE_HERE:
            return NONE
        raise
    if not names:
        return NONE
    return _values(names, path, lambda attr: os.getxattr(fd, attr))


def _values(names: list[str], path: str, get: Any) -> Xattrs:
    found = []
    for name in sorted(names):  # any bytes, as a file's name (os.fsdecode's text)
        try:
            found.append((name, bytes(get(name))))
        except OSError as error:
            if error.errno not in _GONE and error.errno not in (errno.EACCES, errno.EPERM):
                raise
    return tuple(found)


def form(xattrs: Xattrs) -> dict[str, str]:
    """The tree form: name -> the value in standard base64."""
    return {name: base64.b64encode(value).decode("ascii") for name, value in xattrs}


def parse(raw: object, path: str) -> Xattrs:
    """A tree form's attributes, checked (``ValueError`` naming the entry)."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"entry {path!r} xattrs {raw!r} is not a non-empty object")
    found = []
    for name, text in raw.items():
        if not isinstance(text, str):
            raise ValueError(f"entry {path!r} xattr {name!r} has a value that is not base64")
        try:
            value = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                f"entry {path!r} xattr {name!r} has a value that is not base64"
            ) from None
        if base64.b64encode(value).decode("ascii") != text:
            raise ValueError(f"entry {path!r} xattr {name!r} is not canonical base64")
        found.append((name, value))
    found.sort()
    check(tuple(found), path)
    return tuple(found)


def check(xattrs: object, path: str) -> None:
    """Sorted, unique, named in a known namespace by bytes (any but NUL, as a file's name:
    ``manifest.is_decoded_name``), within the kernel's sizes."""
    from settled.workspace.manifest import is_decoded_name  # manifest imports this module

    if not isinstance(xattrs, tuple):
        raise ValueError(f"entry {path!r} xattrs {xattrs!r} are not a tuple")
    last = ""
    for item in xattrs:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"entry {path!r} has xattr {item!r}, not (name, value)")
        name, value = item
        if not isinstance(name, str) or not name.startswith(NAMESPACES) or "\0" in name:
            raise ValueError(f"entry {path!r} has xattr name {name!r} outside every namespace")
        if not is_decoded_name(name):
            raise ValueError(f"entry {path!r} has xattr name {name!r}, which no bytes decode to")
        size = len(os.fsencode(name))
        if size > MAX_NAME or name <= last:
            raise ValueError(f"entry {path!r} xattr {name!r} is too long, unsorted or repeated")
        if not isinstance(value, bytes) or len(value) > MAX_VALUE:
            raise ValueError(f"entry {path!r} xattr {name!r} value is not bytes of <= 64 KiB")
        last = name


def restorable(name: str, same_owner: bool) -> bool:
    """Whether a restore sets ``name``: ``user.*`` and the POSIX ACLs always (the restorer
    may set them on what it owns); anything else (``trusted.*``, ``security.*``, a file
    capability above all) only when every owner is restored too (``same_owner``, root)."""
    return same_owner or name.startswith("user.") or name in ACLS


def setting_order(xattrs: Xattrs) -> list[tuple[str, bytes]]:
    """The order a restore sets them: a file capability last (a write or a chown clears it)."""
    return sorted(xattrs, key=lambda item: item[0] == CAPABILITY)


def drop_inherited_acls(fd: int) -> None:
    """Remove the ACLs a directory made by a restore inherited from the destination's parent
    (its default ACL would be inherited by everything made below it)."""
    for name in (ACL_DEFAULT, ACL_ACCESS):
        try:
            os.removexattr(fd, name)
        except OSError as error:
            if error.errno not in _GONE and error.errno not in _NONE_HERE:
                raise
