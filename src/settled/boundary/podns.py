"""A task is a pod: its own user, IPC, UTS and network namespaces and session keyring, which
every session of the task joins (the network namespace: with `--network none`) and no other
task's does.

What the pod gives (docs/TRUST.md): a command's SysV IPC objects and POSIX message queues live in
its task's IPC namespace, its hostname is its task's id (its UTS namespace), and its keys live in
its task's keyrings: the session keyring every session of the task joins, and the user keyrings
of its task's user namespace. With `--network none` its network is its task's loopback and
nothing else (podnet.py). Another task's command sees none of it; the task's next session, and a
concurrent one, see all of it.

The user namespace maps every uid and gid to itself, so uid 0 inside is uid 0 outside, files keep
their owners, and `--user UID` means the same uid. What changes is where capabilities hold: a
command's capabilities are over its pod's namespaces only, never over its mount, PID or cgroup
namespaces, which the host's user namespace owns (so no capability over its own view at all),
nor over the host's network namespace with `--network host` (measured here: no raw or ICMP
socket and no port below 1024 there); with `--network none` they hold over its task's network
namespace, so ports below 1024 and raw sockets work on its loopback.

Since uids are shared, the kernel's "user" permission bits of a key grant across pods: a seccomp
filter refuses every KEYCTL_SETPERM that grants a bit to anyone but the key's possessor,
KEYCTL_CHOWN, and KEYCTL_JOIN_SESSION_KEYRING (which makes keyrings readable and linkable by
their uid), so no command opens a key to another task; the pod's own keyrings are made with no
"user" bits but the search its sessions' join needs.

This module owns the init's half, which runs in a PID namespace's init (or the forked child of
a boundary without one): a single-threaded process with every capability in the host's user
namespace, on the owner's launch path (os, sys and linux only). In order, around the view
(`around_view`): `open_namespaces` before the mount namespace is unshared (the pod's namespace
files are reached inside the home's "pods" mount namespace, and checked by inode against the
plan), `join_before_view` (IPC, UTS, and the network for `--network none`), the view, then
`join_after_view` (the user namespace, which gives a full capability set inside it, so the
privileges are dropped after; the task's keyring as the session keyring; the key filter).
Every step succeeds or the command never starts.

The host's half (finding, making, describing and releasing pods: podhost.py, podmake.py) is
loaded only when called: `ensure`, `describe`, `release`, `release_home`. Never decides
whether a session gets a pod (handoff does).
"""

from __future__ import annotations

import errno
import os
import sys

from settled.boundary import linux

TYPE_CHECKING = False  # the owner's launch path imports this: no typing at run time
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Final

    from settled.boundary.isolation import IsolationPlan

NAMESPACES: Final = ("user", "ipc", "uts", "net")  # net: joined for --network none only

KEYCTL_GET_KEYRING_ID: Final = 0
KEYCTL_JOIN_SESSION_KEYRING: Final = 1
KEYCTL_CHOWN: Final = 4
KEYCTL_SETPERM: Final = 5
KEYCTL_DESCRIBE: Final = 6
KEYCTL_LINK: Final = 8
KEYCTL_READ: Final = 11
KEY_SPEC_USER_KEYRING: Final = -4
KEY_SPEC_USER_SESSION_KEYRING: Final = -5
KEY_POSSESSOR_BITS: Final = 0x3F000000  # the other three bytes: user, group, other
# The task's keyring: its possessors may view, read, write, search and link it, but not change
# its permissions; "user" may only search it, which joining it by name needs (a process joining
# does not possess it yet). Found by a command of another pod with the same uid, by serial, it
# gives nothing: searching it finds only keys with a "user" search bit, which no command can set.
KEYRING_PERM: Final = 0x1F080000
# The pod's user keyrings (uid 0's @u and @us): as the kernel makes them, less every "user" bit,
# which would let a same-uid process of another pod read, write or link them by serial (measured:
# one that did could link another pod's @u into its own session keyring and read its keys).
USER_KEYRING_PERM: Final = 0x1F000000


def keyring_name(task: str) -> str:
    return f"settled-pod:{task}"


class Joining:
    """What `open_namespaces` opened for the init: one descriptor per namespace of the pod, the
    keyring to join (its name, and the serial it had when the pod was made) and the key filter
    (made by the launcher: `pod["filter"]`)."""

    __slots__ = ("fds", "filter", "keyring", "serial")

    def __init__(
        self, fds: dict[str, int], keyring: str, serial: int, program: bytes | None
    ) -> None:
        self.fds, self.keyring, self.serial, self.filter = fds, keyring, serial, program

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def around_view(plan: IsolationPlan, build: Callable[[IsolationPlan], None]) -> None:
    """Build the view (`build(plan)`: mountview.enter) inside the task's pod when the plan
    names one: the pod's namespaces opened and IPC and UTS joined before, the user namespace
    and the keyring joined after (the view needs the host's user namespace: a new procfs of the
    PID namespace, mounts over the host's)."""
    pod = plan.pod
    if pod is None:
        build(plan)
        return
    joining = open_namespaces(pod)
    try:
        join_before_view(joining)
        build(plan)
        join_after_view(joining)
    finally:
        joining.close()


def open_namespaces(pod: dict[str, Any]) -> Joining:
    """Open the pod's namespace files, which exist only inside the home's pods mount namespace:
    enter it (pinned at `pod["pin"]`), open each and check it is the namespace the plan names
    (by inode), and come back through a descriptor of this process's own namespace opened
    first. The network namespace only when the plan's network is "none" (`pod["network"]`, set
    with the plan's by podhost.attach). Raises OSError naming what is not as the plan says (the
    command never starts)."""
    names = NAMESPACES if pod.get("network") in ("none", "proxy") else NAMESPACES[:3]
    if "net" in names and "net" not in pod:
        raise OSError(errno.ESTALE, f"pod {pod['hostname']} has no network namespace")
    own = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    fds: dict[str, int] = {}
    try:
        pods = os.open(pod["pin"], os.O_RDONLY | os.O_CLOEXEC)
        try:
            _expect(pods, pod["pods"], f"the pods namespace pinned at {pod['pin']}")
            linux.setns(pods, linux.CLONE_NEWNS)
        finally:
            os.close(pods)
        try:
            for name in names:
                path = f"{pod['dir']}/{name}"
                fds[name] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                _expect(fds[name], pod[name], f"{name} namespace of pod {pod['hostname']}")
        finally:
            linux.setns(own, linux.CLONE_NEWNS)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    finally:
        os.close(own)
    program = pod["filter"] if "filter" in pod else key_filter()
    return Joining(fds, pod["keyring"], pod["serial"], program)


def _expect(fd: int, inode: int, what: str) -> None:
    found = os.fstat(fd).st_ino
    if found != inode:
        raise OSError(errno.ESTALE, f"{what} is {found}, not {inode} as the plan names")


def join_before_view(joining: Joining) -> None:
    """The pod's IPC and UTS namespaces, and its network namespace when opened (their owner,
    the pod's user namespace, is a child of this process's: its capabilities hold there)."""
    linux.setns(joining.fds["ipc"], linux.CLONE_NEWIPC)
    linux.setns(joining.fds["uts"], linux.CLONE_NEWUTS)
    if "net" in joining.fds:
        linux.setns(joining.fds["net"], linux.CLONE_NEWNET)


def join_after_view(joining: Joining) -> None:
    """The pod's user namespace (every capability inside it, none outside: drop them after),
    then the task's keyring as this process's session keyring, then the key filter. Closes
    the descriptors."""
    try:
        linux.setns(joining.fds["user"], linux.CLONE_NEWUSER)
        _join_keyring(joining.keyring, joining.serial)
        if joining.filter is not None:
            linux.seccomp_filter(joining.filter)
    finally:
        joining.close()


def _join_keyring(name: str, serial: int) -> None:
    """Join the task's keyring by name (names are looked up in this user namespace, and only
    keyrings with the "user" search bit, which no command can set, are found). A command of the
    task may have revoked it, or unlinked it from where it is kept; joining then makes a new
    one, which is made the task's, so the task keeps one: its permissions set (which a keyring
    made the task's before refuses: no one may change them). Its links are made every time."""
    joined = linux.keyctl_name(KEYCTL_JOIN_SESSION_KEYRING, name)
    if joined != serial:
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            linux.keyctl(KEYCTL_SETPERM, joined, KEYRING_PERM)
        except PermissionError:
            pass  # one an earlier session made the task's
    _link(joined)  # again: a command may have unlinked either (a link made twice is one)


def make_task_keyring(name: str) -> int:
    """In the pod's first process: make the task's keyring (as its session keyring) and
    return its serial."""
    serial = linux.keyctl_name(KEYCTL_JOIN_SESSION_KEYRING, name)
    _adopt(serial)
    return serial


def _adopt(serial: int) -> None:
    """Make the session keyring `serial` the task's: its permissions, the user keyring linked
    in it (so the task's sessions possess the keys of their @u, as a login's session keyring
    does), and itself linked into the user session keyring, which lives as long as the user
    namespace: the keyring outlives every session."""
    linux.keyctl(KEYCTL_SETPERM, serial, KEYRING_PERM)
    _link(serial)


def _link(serial: int) -> None:
    linux.keyctl(KEYCTL_LINK, KEY_SPEC_USER_KEYRING, serial)
    linux.keyctl(KEYCTL_LINK, serial, KEY_SPEC_USER_SESSION_KEYRING)


# -- the key filter ---------------------------------------------------------------------------
# A classic BPF program over struct seccomp_data (nr at 0, arch at 4, args at 16 + 8 i; these
# architectures are little-endian, so an argument's low 32 bits are at its offset). keyctl's
# operation is an int and a permission mask a u32: the kernel reads only those low 32 bits.

_LD_W_ABS: Final = 0x20
_JEQ_K: Final = 0x15
_JSET_K: Final = 0x45
_RET_K: Final = 0x06
_ALLOW: Final = 0x7FFF0000
_REFUSE: Final = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO
_X32: Final = 0x40000000
# Per machine, each ABI its processes can call the kernel with: (AUDIT_ARCH_*, keyctl numbers).
_ABIS: Final = {
    "x86_64": ((0xC000003E, (250, _X32 | 250)), (0x40000003, (288,))),  # x86_64 and x32; i386
    "aarch64": ((0xC00000B7, (219,)), (0x40000028, (311,))),  # aarch64; arm (compat)
}
_FILTER: list[bytes | None] = []


def key_filter_missing() -> str | None:
    """Why no key filter is installed on this machine, or None."""
    machine = os.uname().machine
    if machine in _ABIS:
        return None
    return (
        f"no key filter for {machine} (x86_64 and aarch64 only): a command may open its keys to "
        "other tasks' commands of the same uid (KEYCTL_SETPERM)"
    )


def key_filter() -> bytes | None:
    """The seccomp program for this machine (None where there is none), made once."""
    if not _FILTER:
        abis = _ABIS.get(os.uname().machine)
        _FILTER.append(None if abis is None else _assemble(_key_program(abis)))
    return _FILTER[0]


def _key_program(abis: tuple[tuple[int, tuple[int, ...]], ...]) -> list[Any]:
    """Refused with EPERM: keyctl CHOWN, JOIN_SESSION_KEYRING, and SETPERM with any bit
    outside the possessor's byte. Everything else is allowed."""
    program: list[Any] = [(_LD_W_ABS, 0, 0, 4)]
    program += [(_JEQ_K, f"abi{i}", 0, arch) for i, (arch, _nrs) in enumerate(abis)]
    program.append((_RET_K, 0, 0, _ALLOW))
    for i, (_arch, numbers) in enumerate(abis):
        program += [f"abi{i}", (_LD_W_ABS, 0, 0, 0)]
        program += [(_JEQ_K, "keyctl", 0, number) for number in numbers]
        program.append((_RET_K, 0, 0, _ALLOW))
    non_possessor = 0xFFFFFFFF & ~KEY_POSSESSOR_BITS
    program += [
        "keyctl",
        (_LD_W_ABS, 0, 0, 16),
        (_JEQ_K, "refuse", 0, KEYCTL_CHOWN),
        (_JEQ_K, "refuse", 0, KEYCTL_JOIN_SESSION_KEYRING),
        (_JEQ_K, 0, "allow", KEYCTL_SETPERM),
        (_LD_W_ABS, 0, 0, 32),
        (_JSET_K, "refuse", 0, non_possessor),
        "allow",
        (_RET_K, 0, 0, _ALLOW),
        "refuse",
        (_RET_K, 0, 0, _REFUSE),
    ]
    return program


def _assemble(program: list[Any]) -> bytes:
    """struct sock_filter[] (u16 code, u8 jt, u8 jf, u32 k), jumps to labels made relative."""
    at: dict[str, int] = {}
    for item in program:
        if isinstance(item, str):
            at[item] = sum(1 for i in program[: program.index(item)] if not isinstance(i, str))
    out = bytearray()
    for index, (code, jt, jf, k) in enumerate(i for i in program if not isinstance(i, str)):
        jt = at[jt] - index - 1 if isinstance(jt, str) else jt
        jf = at[jf] - index - 1 if isinstance(jf, str) else jf
        out += code.to_bytes(2, sys.byteorder) + bytes((jt, jf)) + k.to_bytes(4, sys.byteorder)
    return bytes(out)


# -- the host's half (podhost.py), loaded only when called -----------------------------------


def ensure(home: str, task: str) -> dict[str, Any]:
    """The task's pod, made once and then found: plain values for `IsolationPlan.pod`."""
    from settled.boundary import podhost

    return podhost.ensure(home, task)


def release(home: str, task: str) -> None:
    """Let go of the task's pod (its namespaces end once no process is in them). Idempotent."""
    from settled.boundary import podhost

    podhost.release(home, task)


def describe(home: str, task: str) -> dict[str, Any] | None:
    """What the task's pod holds now (its IPC objects, keys, hostname), or None without one."""
    from settled.boundary import podhost

    return podhost.describe(home, task)


def release_home(home: str) -> None:
    """Let go of every pod of the home and of its pods namespace. Idempotent."""
    from settled.boundary import podhost

    podhost.release_home(home)
