"""The ctypes binding of boundary/linux.py: the fallback where the C binding (_linux.c) is not
built, or where SETTLED_LINUX_CALLS=ctypes asks for it (the tests run both).

The same functions as the C module, the same contract: each returns the call's result, or
-errno on failure (linux.py raises). libc is loaded on the first call, which an owner makes
before it clones (the zygote once for all its owners), so the child only calls. clone3 goes
through PyDLL, which keeps the GIL held across the call, as the C binding does.
"""

from __future__ import annotations

import ctypes
import errno
import os

_SYS_MOUNT_SETATTR = 442  # the same on every architecture (added in 5.12)
_SYS_CLONE3 = 435  # likewise (added in 5.3)
_CLONE_PIDFD = 0x00001000
_CLONE_INTO_CGROUP = 0x200000000
_CLONE_PARENT = 0x00008000
_SIGCHLD = 17
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_BPF_MAXINSNS = 4096
# The calls glibc has no wrapper for, whose numbers differ between architectures; elsewhere
# they answer ENOSYS (linux.py names the call).
_SYSCALLS = {
    "x86_64": {"keyctl": 250, "pivot_root": 155},
    "aarch64": {"keyctl": 219, "pivot_root": 41},
}.get(os.uname().machine, {})


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


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


_LIBC: list[ctypes.CDLL] = []
_HELD: list[ctypes.PyDLL] = []


def _libc() -> ctypes.CDLL:
    if not _LIBC:
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
        libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        _LIBC.append(libc)
    return _LIBC[0]


def _held() -> ctypes.PyDLL:
    """libc through PyDLL: the GIL stays held across the call. A clone3 child returns into
    Python as a copy of the calling thread, so that thread must hold the GIL when it clones,
    or the child would wait forever for a lock held by no thread of its own."""
    if not _HELD:
        held = ctypes.PyDLL(None, use_errno=True)
        held.syscall.restype = ctypes.c_long
        _HELD.append(held)
    return _HELD[0]


def _result(value: int) -> int:
    return -ctypes.get_errno() if value < 0 else value


def clone3(flags: int, cgroup_fd: int) -> tuple[int, int]:
    pidfd = ctypes.c_int(-1)
    args = _CloneArgs(
        flags=flags | _CLONE_PIDFD,
        pidfd=ctypes.addressof(pidfd),
        exit_signal=0 if flags & _CLONE_PARENT else _SIGCHLD,  # CLONE_PARENT refuses one
        cgroup=cgroup_fd if flags & _CLONE_INTO_CGROUP else 0,
    )
    pid = int(
        _held().syscall(
            ctypes.c_long(_SYS_CLONE3), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args))
        )
    )
    if pid < 0:
        return -ctypes.get_errno(), -1
    return pid, -1 if pid == 0 else pidfd.value


def unshare(flags: int) -> int:
    return _result(_libc().unshare(flags))


def mount(
    source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None
) -> int:
    return _result(_libc().mount(source, target, fstype, flags, data))


def mount_setattr(dirfd: int, path: bytes, at_flags: int, attr_set: int, attr_clr: int) -> int:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    value = _libc().syscall(
        _SYS_MOUNT_SETATTR,
        ctypes.c_int(dirfd),
        ctypes.c_char_p(path),
        ctypes.c_uint(at_flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    return _result(int(value))


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _result(_libc().prctl(option, arg2, arg3, arg4, arg5))


def fcntl(fd: int, cmd: int, arg: int) -> int:
    return _result(_libc().fcntl(fd, cmd, ctypes.c_long(arg)))


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def poll_in(fds: list[int], timeout: int) -> list[int] | int:
    """poll(2) for POLLIN: the ready descriptors, or -errno (CDLL releases the GIL)."""
    array = (_PollFd * len(fds))(*[_PollFd(fd, 1, 0) for fd in fds])
    ready = _libc().poll(array, len(fds), timeout)
    if ready < 0:
        return -ctypes.get_errno()
    return [entry.fd for entry in array if entry.revents]


def capget() -> tuple[int, int, int, int]:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc().capget(ctypes.byref(header), data) < 0:
        return -ctypes.get_errno(), 0, 0, 0
    return (
        0,
        data[0].effective | data[1].effective << 32,
        data[0].permitted | data[1].permitted << 32,
        data[0].inheritable | data[1].inheritable << 32,
    )


def capset(effective: int, permitted: int, inheritable: int) -> int:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for index, shift in ((0, 0), (1, 32)):
        data[index].effective = effective >> shift & 0xFFFFFFFF
        data[index].permitted = permitted >> shift & 0xFFFFFFFF
        data[index].inheritable = inheritable >> shift & 0xFFFFFFFF
    return _result(_libc().capset(ctypes.byref(header), data))


def setns(fd: int, nstype: int) -> int:
    return _result(_libc().setns(fd, nstype))


def umount2(target: bytes, flags: int) -> int:
    return _result(_libc().umount2(target, flags))


def sethostname(name: bytes) -> int:
    return _result(_libc().sethostname(name, len(name)))


def _syscall(name: str, *args: object) -> int:
    number = _SYSCALLS.get(name)
    if number is None:
        return -errno.ENOSYS
    return _result(int(_libc().syscall(ctypes.c_long(number), *args)))


def pivot_root(new_root: bytes, put_old: bytes) -> int:
    return _syscall("pivot_root", ctypes.c_char_p(new_root), ctypes.c_char_p(put_old))


def keyctl(operation: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    args = (ctypes.c_ulong(a & 0xFFFFFFFFFFFFFFFF) for a in (arg2, arg3, arg4, arg5))
    return _syscall("keyctl", ctypes.c_int(operation), *args)


def keyctl_name(operation: int, name: bytes) -> int:
    zero = ctypes.c_ulong(0)
    return _syscall("keyctl", ctypes.c_int(operation), ctypes.c_char_p(name), zero, zero, zero)


def seccomp_filter(program: bytes) -> int:
    count, rest = divmod(len(program), 8)  # struct sock_filter: u16 code, u8 jt, jf, u32 k
    if rest or count > _BPF_MAXINSNS:
        return -errno.EINVAL
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(count, ctypes.addressof(buffer))
    value = _libc().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0)
    return _result(value)
