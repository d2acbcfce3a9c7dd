"""The Linux calls Python 3.11 lacks: unshare, mount, mount_setattr, pivot_root, umount2, prctl,
capget/capset and clone3 (and fcntl with an integer argument, so the owner's launch path needs
no fcntl module), setns, keyctl and a seccomp filter (joining a task's pod) and sethostname
(making one), as one interface over two bindings.

Owns only the calling convention and the errno: each function raises OSError naming the call
and its argument on failure, never returns a status to be forgotten. Never decides what to
call (spawn.py decides whether to clone3; mountview and privileges what to mount and drop).

The binding is the C module `_linux` (built by `pip install -e .`; a fresh owner imports it in
~0.1 ms, where ctypes costs ~2 ms, and a call costs ~1 us where ctypes costs ~10), else ctypes
(linux_ctypes.py): where the module was not built, or where SETTLED_LINUX_CALLS=ctypes asks
(the tests run both). `BINDING` says which, and every receipt names it (owner.calls). Imports
only os and errno besides the binding: the owner loads it on its launch path.
"""

from __future__ import annotations

import errno
import os

TYPE_CHECKING = False  # typing costs ~1.5 ms to import: the launch path does without it
if TYPE_CHECKING:
    from typing import Any, Final

CALLS_ENV = "SETTLED_LINUX_CALLS"  # "ctypes": never the C binding


def _binding() -> tuple[str, Any]:
    if os.environ.get(CALLS_ENV) != "ctypes":
        try:
            from settled.boundary import _linux  # type: ignore[attr-defined, unused-ignore]
        except ImportError:
            pass
        else:
            return "c", _linux
    from settled.boundary import linux_ctypes

    return "ctypes", linux_ctypes


BINDING, _call = _binding()  # _call: Any, the binding module (C or ctypes)

CLONE_PARENT: Final = 0x00008000  # the child's parent is the caller's (exit_signal 0)
CLONE_NEWNS: Final = 0x00020000
CLONE_NEWCGROUP: Final = 0x02000000
CLONE_NEWUTS: Final = 0x04000000
CLONE_NEWIPC: Final = 0x08000000
CLONE_NEWUSER: Final = 0x10000000
CLONE_NEWPID: Final = 0x20000000
CLONE_NEWNET: Final = 0x40000000
CLONE_INTO_CGROUP: Final = 0x200000000  # Linux 5.7

MS_RDONLY: Final = 1
MS_NOSUID: Final = 2
MS_NODEV: Final = 4
MS_NOEXEC: Final = 8
MS_REMOUNT: Final = 32
MS_BIND: Final = 4096
MS_REC: Final = 16384
MS_PRIVATE: Final = 1 << 18
MS_SHARED: Final = 1 << 20

MNT_DETACH: Final = 2

MOUNT_ATTR_RDONLY: Final = 0x1
AT_FDCWD: Final = -100
AT_SYMLINK_NOFOLLOW: Final = 0x100
AT_RECURSIVE: Final = 0x8000

F_ADD_SEALS: Final = 1033
F_SETPIPE_SZ: Final = 1031
F_SEAL_SEAL: Final = 0x1
F_SEAL_SHRINK: Final = 0x2
F_SEAL_GROW: Final = 0x4
F_SEAL_WRITE: Final = 0x8

PR_SET_PDEATHSIG: Final = 1
PR_CAPBSET_DROP: Final = 24
PR_SET_DUMPABLE: Final = 4
PR_SET_NO_NEW_PRIVS: Final = 38
PR_CAP_AMBIENT: Final = 47
PR_CAP_AMBIENT_CLEAR_ALL: Final = 4


def _check(result: int, what: str) -> int:
    if result < 0:
        raise OSError(-result, f"{what}: {os.strerror(-result)}")
    return result


def _b(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def unshare(flags: int) -> None:
    _check(_call.unshare(flags), f"unshare({flags:#x})")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    result = _call.mount(_b(source), os.fsencode(target), _b(fstype), flags, _b(data))
    _check(result, f"mount {fstype or 'bind'} on {target}")


def umount2(target: str, flags: int = 0) -> None:
    _check(_call.umount2(os.fsencode(target), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_call.pivot_root(os.fsencode(new_root), os.fsencode(put_old)), f"pivot_root {new_root}")


def setns(fd: int, nstype: int) -> None:
    _check(_call.setns(fd, nstype), f"setns({nstype:#x})")


def sethostname(name: str) -> None:
    _check(_call.sethostname(name.encode()), f"sethostname {name}")


def keyctl(operation: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    """keyctl(2) with integer arguments (key serials, a permission mask): podns names them."""
    return _check(_call.keyctl(operation, arg2, arg3, arg4, arg5), f"keyctl({operation})")


def keyctl_name(operation: int, name: str) -> int:
    """keyctl(2) whose one argument is a name: KEYCTL_JOIN_SESSION_KEYRING."""
    return _check(_call.keyctl_name(operation, name.encode()), f"keyctl({operation}, {name!r})")


def seccomp_filter(program: bytes) -> None:
    """Install a classic BPF program (an array of struct sock_filter) as a seccomp filter on
    this thread: inherited by every child and kept across exec; it can never be removed."""
    _check(_call.seccomp_filter(program), "seccomp filter")


def make_readonly(path: str, *, recursive: bool, dir_fd: int = AT_FDCWD) -> None:
    """mount_setattr(2): one call makes a mount (and, recursive, every mount below it) read-only,
    where a remount per submount would be dozens of calls. With `dir_fd`, `path` is looked up
    from that directory and a symlink as its last component is not followed."""
    flags = (AT_RECURSIVE if recursive else 0) | (AT_SYMLINK_NOFOLLOW if dir_fd >= 0 else 0)
    result = _call.mount_setattr(dir_fd, os.fsencode(path), flags, MOUNT_ATTR_RDONLY, 0)
    _check(result, f"mount_setattr(read-only) on {path}")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_call.prctl(option, arg2, arg3, arg4, arg5), f"prctl({option})")


def fcntl(fd: int, cmd: int, arg: int) -> int:
    return _check(_call.fcntl(fd, cmd, arg), f"fcntl({fd}, {cmd})")


def poll_in(fds: list[int], timeout_ms: int = -1) -> list[int]:
    """The descriptors of `fds` (at most 8) readable (or at EOF, or in error) within
    `timeout_ms` (-1: without end); an interrupted wait returns [] (EINTR)."""
    found = _call.poll_in(fds, timeout_ms)
    if isinstance(found, int):
        if found == -errno.EINTR:
            return []
        _check(found, "poll")
    return list(found)


_LAST_CAP: list[int] = []


def last_cap() -> int:
    if not _LAST_CAP:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            _LAST_CAP.append(int(handle.read()))
    return _LAST_CAP[0]


def capget() -> tuple[int, int, int]:
    """(effective, permitted, inheritable) of this thread, as 64-bit masks."""
    result, effective, permitted, inheritable = _call.capget()
    _check(result, "capget")
    return effective, permitted, inheritable


def capset(effective: int, permitted: int, inheritable: int) -> None:
    _check(_call.capset(effective, permitted, inheritable), "capset")


def clone3(flags: int, cgroup_fd: int = -1) -> tuple[int, int]:
    """clone3(2) with CLONE_PIDFD added: (pid, pidfd) in the parent, (0, -1) in the child,
    which continues from here as a copy of the calling thread alone (no fork handler runs:
    the caller has no other thread). `cgroup_fd` is the directory for CLONE_INTO_CGROUP. With
    CLONE_PARENT the child is the caller's parent's (its exit signal is the caller's own, as
    clone3 refuses one with that flag)."""
    pid, pidfd = _call.clone3(flags, cgroup_fd)
    _check(pid, f"clone3({flags:#x})")
    return pid, pidfd


def clone3_missing() -> str | None:
    """Why clone3 with CLONE_INTO_CGROUP cannot be used here, or None when it can. The probe
    names a descriptor that cannot be open (INT_MAX), so a kernel that knows the call and the
    flag answers EBADF and creates nothing."""
    result, _pidfd = _call.clone3(CLONE_INTO_CGROUP, (1 << 31) - 1)
    if result >= 0:  # pragma: no cover - a descriptor INT_MAX was open: never here
        if result == 0:
            os._exit(0)
        os.waitpid(result, 0)
        return "clone3 probe: descriptor INT_MAX is open, so the probe created a process"
    if -result == errno.EBADF:  # the call and the flag are known
        return None
    if -result == errno.ENOSYS:
        return "the kernel has no clone3 (Linux < 5.3, or a seccomp filter refuses it)"
    if -result == errno.EINVAL:
        return "the kernel has no CLONE_INTO_CGROUP (Linux < 5.7)"
    return f"clone3 probe failed: {os.strerror(-result)}"
