"""Thin ctypes bindings for the Linux calls Python 3.11 lacks: unshare, mount, mount_setattr,
prctl and capget/capset.

Owns only the calling convention and the errno: each function raises OSError naming the call
and its argument on failure, never returns a status to be forgotten. libc is loaded on the
first call, which an owner makes before it forks (the zygote once for all its owners), so the
child only calls. Never decides what to call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Final

CLONE_NEWNS: Final = 0x00020000
CLONE_NEWCGROUP: Final = 0x02000000
CLONE_NEWPID: Final = 0x20000000

MS_RDONLY: Final = 1
MS_NOSUID: Final = 2
MS_NODEV: Final = 4
MS_NOEXEC: Final = 8
MS_REMOUNT: Final = 32
MS_BIND: Final = 4096
MS_REC: Final = 16384
MS_PRIVATE: Final = 1 << 18

MOUNT_ATTR_RDONLY: Final = 0x1
AT_FDCWD: Final = -100
AT_RECURSIVE: Final = 0x8000
_SYS_MOUNT_SETATTR: Final = 442  # same number on every architecture (added in 5.12)

PR_CAPBSET_DROP: Final = 24
PR_SET_DUMPABLE: Final = 4
PR_SET_NO_NEW_PRIVS: Final = 38
PR_CAP_AMBIENT: Final = 47
PR_CAP_AMBIENT_CLEAR_ALL: Final = 4
_LINUX_CAPABILITY_VERSION_3: Final = 0x20080522


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _b(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def unshare(flags: int) -> None:
    _check(_libc().unshare(flags), f"unshare({flags:#x})")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    result = _libc().mount(_b(source), _b(target), _b(fstype), flags, _b(data))
    _check(result, f"mount {fstype or 'bind'} on {target}")


def make_readonly(path: str, *, recursive: bool) -> None:
    """mount_setattr(2): one call makes a mount (and, recursive, every mount below it) read-only,
    where a remount per submount would be dozens of calls."""
    _set_readonly(path, recursive=recursive, readonly=True)


def make_writable(path: str, *, recursive: bool) -> None:
    """The opposite: clear the read-only flag of a mount made read-only by make_readonly (a new
    bind mount inherits the flags of the mount it copies)."""
    _set_readonly(path, recursive=recursive, readonly=False)


def _set_readonly(path: str, *, recursive: bool, readonly: bool) -> None:
    attr = (
        _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
        if readonly
        else _MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)
    )
    flags = AT_RECURSIVE if recursive else 0
    result = _libc().syscall(
        _SYS_MOUNT_SETATTR,
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(int(result), f"mount_setattr({'read-only' if readonly else 'writable'}) on {path}")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_libc().prctl(option, arg2, arg3, arg4, arg5), f"prctl({option})")


def last_cap() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as handle:
        return int(handle.read())


def capget() -> tuple[int, int, int]:
    """(effective, permitted, inheritable) of this thread, as 64-bit masks."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc().capget(ctypes.byref(header), data), "capget")
    return (
        data[0].effective | data[1].effective << 32,
        data[0].permitted | data[1].permitted << 32,
        data[0].inheritable | data[1].inheritable << 32,
    )


def capset(effective: int, permitted: int, inheritable: int) -> None:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for index, shift in ((0, 0), (1, 32)):
        data[index].effective = effective >> shift & 0xFFFFFFFF
        data[index].permitted = permitted >> shift & 0xFFFFFFFF
        data[index].inheritable = inheritable >> shift & 0xFFFFFFFF
    _check(_libc().capset(ctypes.byref(header), data), "capset")
