"""The mechanics of pods (podhost.py keeps the records and decides when): the helper child that
does the work, entering a pods namespace and coming back, making a pods namespace, making a
task's namespaces and keyring, reading what a pod holds (`contents`), and clearing what a task
left in the pods namespace.

Every function here but `in_helper` runs in a single-threaded process (the helper), because
setns into a mount namespace and unshare of a user namespace need one, and the caller may run
threads. A user namespace's full identity maps can only be written from the parent namespace,
by another process: the pod's first process unshares and waits while the helper writes them.
Must never leave the helper in another mount namespace than its own on return, nor a first
process alive (it dies with the helper: PR_SET_PDEATHSIG). About 400 lines: everything here
runs in the helper's single-threaded process, and reads as one piece.
"""

from __future__ import annotations

import contextlib
import errno
import marshal
import os
import select
import sys
import time
from collections.abc import Callable, Iterator

from settled.boundary import linux, podnet, podns

TYPE_CHECKING = False  # the launcher imports this on every admission: no typing
if TYPE_CHECKING:
    from typing import Any

HELPER_TIMEOUT_S = 30.0
IDENTITY_MAP = "0 0 4294967295\n"  # every id to itself
SIGKILL = 9


class PodUnavailable(OSError):
    """A pod could not be made or found; the message says why, in one line."""


def in_helper(work: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    """Run `work()` in a forked child (single-threaded, whatever threads this process runs) and
    return what it returned (marshal), or {"error": why}. The child dies with its parent."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's lines are covered through the tests it serves
        os.close(read_end)
        try:
            linux.prctl(linux.PR_SET_PDEATHSIG, SIGKILL)
            try:
                value = work()
            except OSError as exc:
                where = f": {exc.filename}" if exc.filename else ""
                value = {"error": f"{exc.strerror or exc}{where}"}
            except BaseException as exc:
                value = {"error": repr(exc)}
            os.write(write_end, marshal.dumps(value))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = _read_until_eof(read_end, time.monotonic() + HELPER_TIMEOUT_S)
    except TimeoutError:
        os.kill(pid, SIGKILL)
        return {"error": f"{what} took over {HELPER_TIMEOUT_S:.0f} s"}
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    if not data:
        return {"error": f"{what}: the helper died before it answered"}
    value = marshal.loads(data)
    return value if isinstance(value, dict) else {"error": f"{what}: bad answer {value!r}"}


def _read_until_eof(fd: int, deadline: float) -> bytes:
    """poll, not select: the caller may hold more than 1024 descriptors (FD_SETSIZE)."""
    chunks: list[bytes] = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


@contextlib.contextmanager
def inside(pin: str) -> Iterator[None]:
    """This (single-threaded) process inside the mount namespace pinned at `pin`, then back
    in its own."""
    own = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        pods = os.open(pin, os.O_RDONLY | os.O_CLOEXEC)
        try:
            linux.setns(pods, linux.CLONE_NEWNS)
        finally:
            os.close(pods)
        try:
            yield
        finally:
            linux.setns(own, linux.CLONE_NEWNS)
    finally:
        os.close(own)


_NSFS_DEV: list[int] = []


def nsfs_dev() -> int:
    """The device of namespace files: a path with it is an nsfs mount (or a /proc ns link)."""
    if not _NSFS_DEV:
        _NSFS_DEV.append(os.stat("/proc/self/ns/mnt").st_dev)
    return _NSFS_DEV[0]


def pinned(pin: str) -> int | None:
    """The inode of the namespace bound at `pin`, or None when none is (the file is missing,
    or is a plain file: after a reboot, or a release)."""
    try:
        found = os.stat(pin)
    except FileNotFoundError:
        return None
    return found.st_ino if found.st_dev == nsfs_dev() else None


def private_mount(directory: str) -> None:
    """`directory` a mount of its own, private: a mount namespace's file may be bound only on a
    mount that propagates to no peer. Bound onto itself unless it already is a mount point."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if not mount_point(directory):
        linux.mount(directory, directory, None, linux.MS_BIND)
    linux.mount(None, directory, None, linux.MS_PRIVATE)


def unmount_private(directory: str) -> None:
    while mount_point(directory):
        linux.umount2(directory, linux.MNT_DETACH)


def mount_point(path: str) -> bool:
    """Whether `path` is a mount point in this mount namespace (a bind of a directory onto
    itself included, which os.path.ismount cannot tell)."""
    wanted = os.path.realpath(path)
    with open("/proc/self/mountinfo", "rb") as handle:
        for line in handle:
            point = line.split(b" ", 5)[4]
            if _unescape(point) == wanted:
                return True
    return False


def _unescape(field: bytes) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    if b"\\" in field:
        for code in (b"\\040", b"\\011", b"\\012", b"\\134"):
            field = field.replace(code, bytes((int(code[1:], 8),)))
    return os.fsdecode(field)


def unpin(pin: str) -> None:
    while pinned(pin) is not None:  # mounts may be stacked there
        linux.umount2(pin, linux.MNT_DETACH)


def new_pods_namespace(root: str, pin: str) -> int:
    """unshare a mount namespace whose root is a fresh tmpfs (mounted on the empty directory
    `root`, then pivot_root) with a procfs, the host's mounts it copied detached, so that it
    keeps no host filesystem busy; then, back in the host's, bind it at `pin`. Its inode."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    if not os.path.exists(pin):
        os.close(os.open(pin, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    own = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        linux.unshare(linux.CLONE_NEWNS)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
        flags = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
        linux.mount("tmpfs", root, "tmpfs", flags, "size=1m,mode=0700")
        os.mkdir(os.path.join(root, "old"), 0o700)
        os.mkdir(os.path.join(root, "proc"), 0o555)
        linux.pivot_root(root, os.path.join(root, "old"))
        os.chdir("/")
        linux.mount("proc", "/proc", "proc", flags)
        linux.umount2("/old", linux.MNT_DETACH)
        os.rmdir("/old")
        pods = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        try:
            linux.setns(own, linux.CLONE_NEWNS)
            linux.mount(f"/proc/self/fd/{pods}", pin, None, linux.MS_BIND)
            return os.fstat(pods).st_ino
        finally:
            os.close(pods)
    finally:
        os.close(own)


@contextlib.contextmanager
def helper(body: Callable[[int, int], None]) -> Iterator[tuple[int, int, int]]:
    """A forked helper that runs `body(what it reads, where it writes)` and never returns
    (it ends at EOF on what it reads): yields (its pid, the end this process writes to it,
    the end this process reads from it); both ends close at the end, and it is reaped."""
    to_child_r, to_child_w = os.pipe2(os.O_CLOEXEC)
    to_parent_r, to_parent_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - covered through the pods it makes and extends
        os.close(to_child_w)
        os.close(to_parent_r)
        body(to_child_r, to_parent_w)
        os._exit(1)  # a body returns only by mistake
    os.close(to_child_r)
    os.close(to_parent_w)
    try:
        yield pid, to_child_w, to_parent_r
    finally:
        os.close(to_child_w)  # EOF: the helper exits
        os.close(to_parent_r)
        os.waitpid(pid, 0)


def make_pod(pin: str, task: str) -> dict[str, Any]:
    """The pod's first process makes its namespaces and keyring; this one writes its identity
    maps, then binds its namespace files at /<task>/{user,ipc,uts,net} inside the pods namespace
    pinned at `pin` (what a crash left there first unmounted). Returns the directory, each
    namespace's inode and the keyring's serial."""
    directory = f"/{task}"
    with helper(lambda given, told: _first_process(task, given, told)) as (pid, tell, hear):
        expect_line(hear, "unshared")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as handle:
                handle.write(IDENTITY_MAP)
        os.write(tell, b"mapped\n")
        serial = int(expect_line(hear, "made").split()[1])
        fds = {
            n: os.open(f"/proc/{pid}/ns/{n}", os.O_RDONLY | os.O_CLOEXEC) for n in podns.NAMESPACES
        }
        try:
            inodes = bind_namespaces(pin, directory, fds, fresh=True)
        finally:
            for fd in fds.values():
                os.close(fd)
    # the first process exited at EOF: the mounts hold its namespaces
    return {"dir": directory, **inodes, "serial": serial}


def bind_namespaces(pin: str, directory: str, fds: dict[str, int], fresh: bool) -> dict[str, int]:
    """Inside the pods namespace pinned at `pin`, bind each namespace (a descriptor of it, by
    its name) at `<directory>/<name>`, the directory made anew when `fresh` (what a crash left
    there first unmounted). Their inodes."""
    inodes = {name: os.fstat(fd).st_ino for name, fd in fds.items()}
    with inside(pin):
        if fresh:
            clear(directory)
            os.mkdir(directory, 0o700)
        for name, fd in fds.items():
            target = f"{directory}/{name}"
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o400))
            linux.mount(f"/proc/self/fd/{fd}", target, None, linux.MS_BIND)
            if os.stat(target).st_ino != inodes[name]:
                raise PodUnavailable(errno.EIO, f"{target}: the bind did not take")
    return inodes


def expect_line(fd: int, word: str) -> str:
    line = read_line(fd)
    if not line.startswith(word):
        said = line[6:] if line.startswith("error ") else f"it said {line!r}"
        raise PodUnavailable(errno.EIO, f"the pod's first process failed: {said}")
    return line


def read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip() or "nothing (it died)"


def _first_process(task: str, from_parent: int, to_parent: int) -> None:
    """The pod's first process (never returns): a user namespace, then (once the helper wrote
    its maps) IPC, UTS and network namespaces owned by it, the hostname, the loopback up
    (podnet.py), and the task's keyring, made as
    its session keyring (podns.make_task_keyring); the namespace's user keyrings then lose
    their "user" bits."""
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, SIGKILL)
        linux.unshare(linux.CLONE_NEWUSER)
        os.write(to_parent, b"unshared\n")
        if read_line(from_parent) != "mapped":
            os._exit(1)
        linux.unshare(linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | linux.CLONE_NEWNET)
        linux.sethostname(task)
        podnet.loopback_up()
        serial = podns.make_task_keyring(podns.keyring_name(task))
        for keyring in (podns.KEY_SPEC_USER_KEYRING, podns.KEY_SPEC_USER_SESSION_KEYRING):
            linux.keyctl(podns.KEYCTL_SETPERM, keyring, podns.USER_KEYRING_PERM)
        os.write(to_parent, b"made %d\n" % serial)
        read_line(from_parent)  # EOF: the helper has bound the namespaces
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(to_parent, f"error {exc}\n".encode("utf-8", "replace"))
    finally:
        os._exit(0)


def clear(directory: str) -> None:
    """Inside the pods namespace: unmount and remove what `directory` holds (a half-made pod,
    or a released one). Idempotent."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        path = f"{directory}/{name}"
        while os.stat(path).st_dev == nsfs_dev():
            linux.umount2(path, linux.MNT_DETACH)
        os.unlink(path)
    os.rmdir(directory)


def contents(pin: str, pod: dict[str, Any], scratch: str) -> dict[str, Any]:
    """In the helper: what `pod` (as podhost records it) holds: its SysV IPC objects and POSIX
    message queues (its IPC namespace joined; the queues listed on an mqueue filesystem mounted
    on the empty directory `scratch` in a mount namespace of the helper's own), its hostname,
    its network namespace's interfaces (None for a pod made before pods had one), and
    its keys (in its user namespace, its keyring joined as the helper's session keyring). Leaves
    the helper inside the pod: it exits after."""
    directory, keyring, serial = pod["dir"], pod["keyring"], pod["serial"]
    names = [n for n in podns.NAMESPACES if n in pod]  # a pod made before pods had "net"
    with inside(pin):
        fds = {n: os.open(f"{directory}/{n}", os.O_RDONLY | os.O_CLOEXEC) for n in names}
    linux.setns(fds["ipc"], linux.CLONE_NEWIPC)
    linux.setns(fds["uts"], linux.CLONE_NEWUTS)
    held: dict[str, Any] = {
        "hostname": os.uname().nodename,
        "sysv": _sysv(),
        "posix": _mqueues(scratch),
        "network": None,
    }
    if "net" in fds:
        linux.setns(fds["net"], linux.CLONE_NEWNET)
        held["network"] = {"interfaces": podnet.interfaces()}
    linux.setns(fds["user"], linux.CLONE_NEWUSER)
    joined = linux.keyctl_name(podns.KEYCTL_JOIN_SESSION_KEYRING, keyring)
    kept = joined == serial or _permissions(joined) == podns.KEYRING_PERM
    user = linux.keyctl(podns.KEYCTL_GET_KEYRING_ID, podns.KEY_SPEC_USER_KEYRING, 0)
    held["keys"] = {
        "keyring": _key_names(joined, user) if kept else None,  # None: revoked by its task
        "user_keyring": _key_names(user, user),
    }
    return held


def _sysv() -> dict[str, int]:
    """Counts and bytes of the SysV message queues, shared memory segments and semaphore sets
    of this process's IPC namespace (/proc/sysvipc reads the reader's)."""

    def rows(name: str) -> list[list[str]]:
        with open(f"/proc/sysvipc/{name}") as handle:
            return [line.split() for line in handle.read().splitlines()[1:] if line.strip()]

    queues, segments, semaphores = rows("msg"), rows("shm"), rows("sem")
    return {
        "message_queues": len(queues),
        "message_bytes": sum(int(row[3]) for row in queues),  # cbytes
        "shm_segments": len(segments),
        "shm_bytes": sum(int(row[3]) for row in segments),  # size
        "semaphore_sets": len(semaphores),
    }


def _mqueues(scratch: str) -> dict[str, Any]:
    """The POSIX message queues of this process's IPC namespace (an mqueue filesystem shows the
    mounter's), mounted on `scratch` in a private mount namespace of this helper's own."""
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.mount("mqueue", scratch, "mqueue", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    names = sorted(os.listdir(scratch))
    return {"message_queues": len(names), "names": names[:20]}


def _key_names(keyring: int, user: int) -> list[str]:
    """ "type:description" of each key a keyring holds (its possessor reads it), but the user
    keyring `user` (linked in the task's keyring)."""
    import ctypes  # this helper only: never on the owner's launch path

    size = 4096
    buffer = ctypes.create_string_buffer(size)
    count = min(linux.keyctl(podns.KEYCTL_READ, keyring, ctypes.addressof(buffer), size), size)
    raw = buffer.raw[:count]
    serials = [
        int.from_bytes(raw[i : i + 4], sys.byteorder, signed=True) for i in range(0, count, 4)
    ]
    names = []
    for serial in serials:
        if serial != user:
            with contextlib.suppress(OSError):
                kind, _uid, _gid, _perm, description = _key_description(serial).split(";", 4)
                names.append(f"{kind}:{description}")
    return names


def _permissions(serial: int) -> int:
    """A key's permission mask, from its description ("type;uid;gid;perm;description")."""
    return int(_key_description(serial).split(";")[3], 16)


def _key_description(serial: int) -> str:
    import ctypes

    buffer = ctypes.create_string_buffer(4096)
    size = linux.keyctl(podns.KEYCTL_DESCRIBE, serial, ctypes.addressof(buffer), 4096)
    return buffer.raw[: max(0, min(size, 4096) - 1)].decode("utf-8", "replace")
