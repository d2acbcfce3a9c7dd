"""Thin ctypes bindings for the Linux calls Python 3.11 lacks: unshare, mount, mount_setattr,
prctl, capget/capset and clone3.

Owns only the calling convention and the errno: each function raises OSError naming the call
and its argument on failure, never returns a status to be forgotten. libc is loaded on the
first call, which an owner makes before it forks (the zygote once for all its owners), so the
child only calls. Never decides what to call (spawn.py decides whether to clone3). Imports only
ctypes and os: the owner loads it on its launch path, before its command runs.
"""

from __future__ import annotations

import ctypes
import errno
import os

TYPE_CHECKING = False  # typing costs ~1.5 ms to import: the launch path does without it
if TYPE_CHECKING:
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

CLONE_PIDFD: Final = 0x00001000
CLONE_INTO_CGROUP: Final = 0x200000000  # Linux 5.7
_SYS_CLONE3: Final = 435  # the same on every architecture (added in 5.3)
_SIGCHLD: Final = 17


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


class _CloneArgs(ctypes.Structure):
    """struct clone_args up to `cgroup` (CLONE_ARGS_SIZE_VER2, 88 bytes)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size",
            "tls", "set_tid", "set_tid_size", "cgroup",
        )
    ]  # fmt: skip


_LIBC: ctypes.CDLL | None = None
_HELD: ctypes.PyDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = _load()
    return _LIBC


def _load() -> ctypes.CDLL:
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


def _held() -> ctypes.PyDLL:
    """libc through PyDLL: the GIL stays held across the call. A clone3 child returns into
    Python as a copy of the calling thread, so that thread must hold the GIL when it clones,
    or the child would wait forever for a lock held by no thread of its own."""
    global _HELD
    if _HELD is None:
        _HELD = ctypes.PyDLL(None, use_errno=True)
        _HELD.syscall.restype = ctypes.c_long
    return _HELD


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


def clone3(flags: int, cgroup_fd: int = -1) -> tuple[int, int]:
    """clone3(2) with CLONE_PIDFD added: (pid, pidfd) in the parent, (0, -1) in the child,
    which continues from here as a copy of the calling thread alone (no fork handler runs:
    the caller has no other thread). `cgroup_fd` is the directory for CLONE_INTO_CGROUP."""
    pidfd = ctypes.c_int(-1)
    args = _CloneArgs(
        flags=flags | CLONE_PIDFD,
        pidfd=ctypes.addressof(pidfd),
        exit_signal=_SIGCHLD,
        cgroup=cgroup_fd if flags & CLONE_INTO_CGROUP else 0,
    )
    pid = _held().syscall(
        ctypes.c_long(_SYS_CLONE3), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args))
    )
    if pid == 0:
        return 0, -1
    _check(int(pid), f"clone3({flags:#x})")
    return int(pid), pidfd.value


def clone3_missing() -> str | None:
    """Why clone3 with CLONE_INTO_CGROUP cannot be used here, or None when it can. The probe
    names a descriptor that cannot be open (INT_MAX), so a kernel that knows the call and the
    flag answers EBADF and creates nothing."""
    args = _CloneArgs(flags=CLONE_INTO_CGROUP, exit_signal=_SIGCHLD, cgroup=(1 << 31) - 1)
    result = _held().syscall(
        ctypes.c_long(_SYS_CLONE3), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args))
    )
    err = ctypes.get_errno()
    if result >= 0:  # pragma: no cover - a descriptor INT_MAX was open: never here
        if result == 0:
            os._exit(0)
        os.waitpid(int(result), 0)
        return "clone3 probe: descriptor INT_MAX is open, so the probe created a process"
    if err == errno.EBADF:  # the call and the flag are known
        return None
    if err == errno.ENOSYS:
        return "the kernel has no clone3 (Linux < 5.3, or a seccomp filter refuses it)"
    if err == errno.EINVAL:
        return "the kernel has no CLONE_INTO_CGROUP (Linux < 5.7)"
    return f"clone3 probe failed: {os.strerror(err)}"
