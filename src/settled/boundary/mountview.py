"""The command's view of the filesystem: a private mount namespace built from an IsolationPlan.

Runs in the forked child (or in a PID namespace's init, so that /proc is that namespace's), after
the child joined its cgroup and before anything of the command runs. Steps, in order, each one
raising OSError if the kernel refuses it (the command then never starts, and the receipt says
at which step):

1. new mount and cgroup namespaces (the cgroup namespace is rooted at the session's cgroup, so
   no process inside can name a cgroup above it), every mount made private;
2. pins: each ancestor of a hidden path bound onto itself, outermost first, so it is a mount
   point in this namespace and cannot be renamed or removed (otherwise `mv` of a parent would
   move the home out from under its mount and let a later session see it, or plant a forged
   home at the old path);
3. the host read-only, every mount at once, and the writable paths (the workspace, /tmp, ...)
   bound back onto themselves and made writable again, but for settled's own code and
   interpreter where a writable path holds them (bound read-only again);
4. hidden directories covered by an empty read-only tmpfs (the workspace, if one holds it, bound
   back at its own path from a descriptor opened before the cover; every other directory gets a
   bind of one such cover, not a tmpfs of its own), hidden files by /dev/null;
5. /proc: a new procfs of the PID namespace when there is one; /proc/sys and the kernel's other
   writable knobs read-only, and the files that leak kernel memory or keys masked;
6. /sys read-only, every submount included (the cgroup hierarchies with it);
7. /dev: a fresh tmpfs with null, zero, full, random, urandom and tty, a new devpts instance and
   a /dev/shm: no block device, so no way to the raw disk under the hidden home.

Never runs in the owner itself, and never decides what to hide (isolation.py does).
"""

from __future__ import annotations

import os

from settled.boundary import linux
from settled.boundary.isolation import _is_within  # the planner's own test of "inside"

TYPE_CHECKING = False  # the owner's launch path imports this: no typing at run time
if TYPE_CHECKING:
    from typing import Final

    from settled.boundary.isolation import IsolationPlan

_COVER_FLAGS: Final = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
_PROC_READ_ONLY: Final = ("sys", "sysrq-trigger", "irq", "bus", "fs")
_PROC_MASKED: Final = ("kcore", "keys", "timer_list", "sched_debug", "acpi")
_DEVICES: Final = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8),
                   ("urandom", 1, 9), ("tty", 5, 0))  # fmt: skip


def enter(plan: IsolationPlan) -> None:
    """Build the command's view in a new mount namespace; every step or none."""
    flags = linux.CLONE_NEWNS | (linux.CLONE_NEWCGROUP if plan.cgroup_namespace else 0)
    linux.unshare(flags)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    exposed = _open_path(plan.expose) if plan.expose else None
    try:
        for path in plan.pins:
            _bind_onto_itself(path)
        if plan.readonly_host:
            linux.make_readonly("/", recursive=True)
            for path in plan.writable:
                _bind_onto_itself(path)
                linux.make_writable(path, recursive=True)
            for path in plan.protect:  # settled's own code, where a writable path holds it
                _bind_onto_itself(path)
                linux.make_readonly(path, recursive=True)
        empty: str | None = None  # the first cover that holds no workspace: bound over the rest
        for path in plan.hide_dirs:
            if plan.expose is not None and _is_within(plan.expose, path):
                _cover_dir(path, plan.expose, exposed, writable=plan.readonly_host)
            elif empty is None:
                _cover_dir(path, None, None, writable=False)
                empty = path
            else:
                _cover_again(empty, path)
        for path in plan.hide_files:
            _cover_file(path)
    finally:
        if exposed is not None:
            os.close(exposed)
    _private_proc(plan.private_proc)
    if plan.readonly_sys:
        linux.make_readonly("/sys", recursive=True)
    if plan.minimal_dev:
        _minimal_dev()


def _bind_onto_itself(path: str) -> None:
    """A mount point of its own (with everything mounted below it): one that cannot be renamed,
    and whose flags can then be set apart from its parent's."""
    linux.mount(path, path, None, linux.MS_BIND | linux.MS_REC)


def _open_path(path: str) -> int:
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _cover_dir(path: str, expose: str | None, exposed: int | None, *, writable: bool) -> None:
    """An empty tmpfs over `path`; the workspace it holds (if any) bound back in (and made
    writable again on a read-only host), then the tmpfs made read-only, so nothing can be
    created in place of what it hides."""
    linux.mount("tmpfs", path, "tmpfs", _COVER_FLAGS, "size=16k,nr_inodes=64,mode=0555")
    inside = expose is not None and expose.startswith(path.rstrip("/") + "/")
    if inside and expose is not None and exposed is not None:
        os.makedirs(expose, mode=0o555, exist_ok=True)
        linux.mount(f"/proc/self/fd/{exposed}", expose, None, linux.MS_BIND | linux.MS_REC)
        if writable:
            linux.make_writable(expose, recursive=True)
    linux.mount(None, path, None, linux.MS_REMOUNT | linux.MS_RDONLY | _COVER_FLAGS)


def _cover_again(cover: str, path: str) -> None:
    """The cover already made at `cover` (an empty read-only tmpfs holding no workspace) bound
    over `path`: a bind copies its mount's flags, read-only included, and makes no new
    filesystem. A tmpfs of its own for each of a home's hundreds of other workspaces cost ~26 us
    more each, and as much again when the namespace went away."""
    linux.mount(cover, path, None, linux.MS_BIND)


def _cover_file(path: str) -> None:
    linux.mount(os.devnull, path, None, linux.MS_BIND)
    linux.mount(None, path, None, linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY)


def _private_proc(new_instance: bool) -> None:
    if new_instance:
        linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    for name in _PROC_READ_ONLY:
        path = f"/proc/{name}"
        if os.path.exists(path):
            _bind_onto_itself(path)
            linux.make_readonly(path, recursive=True)
    for name in _PROC_MASKED:
        path = f"/proc/{name}"
        if os.path.isdir(path):
            linux.mount("tmpfs", path, "tmpfs", linux.MS_RDONLY | _COVER_FLAGS, "size=4k")
        elif os.path.exists(path):
            linux.mount(os.devnull, path, None, linux.MS_BIND)


def _minimal_dev() -> None:
    linux.mount("tmpfs", "/dev", "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "size=64k,mode=755")
    for name, major, minor in _DEVICES:
        path = f"/dev/{name}"
        os.mknod(path, 0o20666, os.makedev(major, minor))
        os.chmod(path, 0o666)  # mknod's mode is cut by the umask
    os.mkdir("/dev/pts", 0o755)
    linux.mount(
        "devpts", "/dev/pts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=620",
    )  # fmt: skip
    os.symlink("pts/ptmx", "/dev/ptmx")
    os.mkdir("/dev/shm", 0o1777)
    linux.mount("tmpfs", "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=1777")
    for index, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{index}", f"/dev/{name}")
    os.symlink("/proc/self/fd", "/dev/fd")
