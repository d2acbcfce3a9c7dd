"""The command's view of the filesystem: an allow-list built from nothing, from an IsolationPlan.

Runs in the forked child (or in a PID namespace's init, so that /proc is that namespace's), after
the child joined its cgroup and before anything of the command runs. Steps, in order, each one
raising OSError if the kernel refuses it (the command then never starts, and the receipt says
`not_started` at stage `isolation`, naming the path):

(Before step 1 and after the last, podns.around_view joins the task's pod: its IPC and UTS
namespaces before the view, its user namespace and keyring after, when the plan has a pod.)

1. new mount and cgroup namespaces (the cgroup namespace is rooted at the session's cgroup, so
   no process inside can name a cgroup above it), every mount made private;
2. an O_PATH descriptor of every host path the view binds, opened in the new namespace (so it
   names that namespace's mounts): those under /dev before the new root hides them there, the
   others one at a time as they are bound; every bind is made from `/proc/self/fd/N`;
3. an empty tmpfs, the new root, mounted at /dev (in this namespace only), and the plan's view
   built in it entry by entry, outermost first (viewplan.py says what and why): system roots
   and grants bound at their own paths (read-only ones made so, submounts included, by one
   mount_setattr each), symlinked roots made as the same symlinks, the pod's directories, a new
   procfs with its knobs read-only, a minimal /dev (null, zero, full, random, urandom, tty, a
   new devpts, the std* and fd links; no block device, so no way to the raw disk), /sys
   read-only with the cgroup hierarchies, then what must stay covered inside a root (an empty
   read-only tmpfs, bound again over every further directory that holds nothing; /dev/null
   over a file), the directories between a cover and its read-write root bound onto
   themselves (a mount point cannot be renamed), and settled's own code bound read-only
   where a read-write root holds it;
4. `pivot_root` into it and the old root detached (`pivot_root(".", ".")` then
   `umount2(".", MNT_DETACH)`: no directory for it is needed, and nothing of the host is left
   in the namespace but what was bound), then the new root made read-only.

The workspace's source, when its entry carries the identity recorded at `task new`, is opened
without following a symlink and must be that directory (device and inode), else the launch is
refused naming it: a path replaced since (a symlink, another directory) is never bound.

Below the first mount of the view above it, every target is looked up one component at a
time from a descriptor, never following a symlink, and missing directories are made as it goes
(above it, in the new root's own tmpfs, there are only directories this build made): the pod's
directories and the workspace are the command's to fill, and a symlink it left there must not
steer a mount (or a mkdir) anywhere else. A mount point made inside a pod directory (the
workspace under /tmp or under $HOME, whose pod directories are bound first) stays there as an
empty directory. At most a few descriptors are open at a time: the init holds its owner's, and
may run under a low RLIMIT_NOFILE. Never runs in the owner itself, and never decides what the
view holds (viewplan.py does).
"""

from __future__ import annotations

import os
import stat

from settled.boundary import linux, viewplan

TYPE_CHECKING = False  # the owner's launch path imports this: no typing at run time
if TYPE_CHECKING:
    from typing import Any, Final

    from settled.boundary.isolation import IsolationPlan

# Where the new root is made, in the new mount namespace only: the host's /dev there, which no
# bind source lies under (the view makes its own /dev; /dev/null, the one source there, and any
# other, are opened before it is hidden), so the build holds almost no descriptor at a time.
STAGING: Final = "/dev"
_ROOT_OPTIONS: Final = "mode=0755,size=64k,nr_inodes=4096"
_COVER_FLAGS: Final = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
_DIR: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ANY: Final = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_DEVICES: Final = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8),
                   ("urandom", 1, 9), ("tty", 5, 0))  # fmt: skip


def enter(plan: IsolationPlan) -> None:
    """Build the command's view in a new mount namespace; every step or none."""
    flags = linux.CLONE_NEWNS | (linux.CLONE_NEWCGROUP if plan.cgroup_namespace else 0)
    linux.unshare(flags)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    mask = os.umask(0)  # every mode below is meant as written
    builder = _Builder(plan)
    try:
        builder.open_sources()
        builder.build()
        builder.pivot()
    finally:
        builder.close()
        os.umask(mask)


def _fail(exc: OSError, path: str, what: str) -> OSError:
    """The same error, naming the view's path (what the receipt's detail shows)."""
    code = exc.errno or 5
    return OSError(code, f"{what} {path}: {os.strerror(code)}")


class _Builder:
    """One view being built: the descriptors of its sources, and what it made so far."""

    __slots__ = ("deferred", "empty", "holders", "made", "paths", "plan", "sources")

    def __init__(self, plan: IsolationPlan) -> None:
        self.plan = plan
        self.sources: dict[str, int] = {}
        self.empty = -1  # the first cover that holds nothing: bound again over the others
        self.deferred: list[str] = []  # covers that hold a bind: read-only once it is made
        self.paths: set[str] = set()  # where the view mounts or links something
        self.made = {"", "/"}  # the root's own directories made so far (both name the root)
        self.holders: set[str] | None = None  # every directory above an entry

    def open_sources(self) -> None:
        """The sources the new root will hide (those under STAGING, where it is mounted), opened
        before it is. Every other one is opened when it is bound and closed once it is: an
        owner's init may run under a low RLIMIT_NOFILE, and it holds the owner's descriptors."""
        for made in self.plan.view:
            source = made.get("source")
            if source is None or made["mode"] == "symlink" or source in self.sources:
                continue
            if viewplan.is_within(source, STAGING):
                self.sources[source] = self._open(source, made.get("identity"))

    def source(self, path: str, identity: str | None = None) -> tuple[int, bool]:
        """A descriptor of the bind source `path`, and whether the caller closes it."""
        fd = self.sources.get(path, -1)
        if fd >= 0:
            return fd, False
        if path == os.devnull:  # every file cover binds it: kept
            self.sources[path] = self._open(path)
            return self.sources[path], False
        return self._open(path, identity), True

    @staticmethod
    def _open(path: str, identity: str | None = None) -> int:
        """`identity` ("dev:ino", the workspace's recorded at `task new`): the source is opened
        without following a symlink and must be that directory, else the launch is refused
        naming it (the workspace was replaced since)."""
        try:
            if identity is None:
                return os.open(path, os.O_PATH | os.O_CLOEXEC)
            fd = os.open(path, _DIR)
        except OSError as exc:
            raise _fail(exc, path, "open") from None
        st = os.fstat(fd)
        if f"{st.st_dev}:{st.st_ino}" != identity:
            os.close(fd)
            raise OSError(
                116,  # ESTALE
                f"the workspace {path} is not the directory bound at task new (device:inode "
                f"{identity}), found another directory {st.st_dev}:{st.st_ino}",
            )
        return fd

    def close(self) -> None:
        for fd in (*self.sources.values(), self.empty):
            if fd >= 0:
                os.close(fd)
        self.sources.clear()
        self.empty = -1

    def build(self) -> None:
        linux.mount("tmpfs", STAGING, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, _ROOT_OPTIONS)
        steps: Any = self.plan.view
        if self.plan.pins:
            pins = (viewplan.entry(p, "pin", "rw") for p in self.plan.pins)
            steps = viewplan.build_order((*steps, *pins))
        self.paths = {made["path"] for made in steps}
        for made in steps:
            self.make(made)
        for path in self.deferred:
            dirfd, name, _where, opened = self.locate(path, leaf=True, create=False)
            try:
                linux.make_readonly(name, recursive=False, dir_fd=dirfd)
            finally:
                _close(opened)

    def make(self, made: dict[str, str]) -> None:
        kind, mode, path = made["kind"], made["mode"], made["path"]
        try:
            if kind == "cover":
                self.cover(made)
            elif mode == "symlink":
                dirfd, name, _where, opened = self.locate(path, leaf=None, create=True, last=False)
                try:
                    os.symlink(made["source"], name, dir_fd=dirfd)
                finally:
                    _close(opened)
            elif kind == "proc" and path == "/proc":
                flags = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
                self.mount_new(path, "proc", flags)
            elif kind == "dev" and path == "/dev":
                self.minimal_dev()
            elif kind == "dev":  # /dev/shm without a pod: a tmpfs of this session's
                flags = linux.MS_NOSUID | linux.MS_NODEV
                self.mount_new(path, "tmpfs", flags, "mode=1777")
            elif kind in ("proc", "pin"):  # bound onto itself: read-only, or a mount point
                self.bind(path, -1, readonly=kind == "proc")
            elif "source" in made:
                source, owned = self.source(made["source"], made.get("identity"))
                try:
                    self.bind(path, source, readonly=mode == "ro")
                finally:
                    if owned:
                        os.close(source)
            else:  # a directory of the root (an empty /run)
                _close(self.locate(path, leaf=True, create=True)[3])
        except OSError as exc:
            if exc.strerror and path in exc.strerror:
                raise
            raise _fail(exc, path, f"view: {kind}") from None

    def locate(
        self, path: str, *, leaf: bool | None, create: bool, last: bool = True
    ) -> tuple[int, str, str, tuple[int, ...]]:
        """Where `path` is in the new root: (dirfd, name) to reach it with an *at call, `where`
        to mount on, and the descriptors opened for it (the caller closes them). Missing
        directories are made when `create` (and the last component as a directory, or as an
        empty file when `leaf` is False; `leaf` None: a directory or a file, not a symlink);
        with `last` false only its directory is looked up.

        Below the first mount (or link) of the view above it, each component is looked up from
        a descriptor without following a symlink (O_NOFOLLOW, and mounts on /proc/self/fd/N):
        what lies there (a pod directory, the workspace, a grant) may be the command's. Above
        it there are only directories this build made in its own tmpfs, named by path."""
        holder = self._holder(path)
        if holder is None:
            where = STAGING + path if path != "/" else STAGING
            if create:
                self._make_fresh(path, leaf if last else None)
            return linux.AT_FDCWD, where, where, ()
        parent = os.open(STAGING + holder if holder != "/" else STAGING, _DIR)
        names = path[len(holder) + 1 :].split("/") if holder != "/" else path[1:].split("/")
        try:
            for name in names[:-1]:
                step = self._step(parent, name, True, create)
                os.close(parent)
                parent = step
            target = self._step(parent, names[-1], leaf, create) if last else -1
        except BaseException:
            os.close(parent)
            raise
        if target < 0:
            return parent, names[-1], "", (parent,)
        return parent, names[-1], f"/proc/self/fd/{target}", (parent, target)

    def _holder(self, path: str) -> str | None:
        """The outermost entry of the view strictly above `path`, or None."""
        if "/" in self.paths and path != "/":
            return "/"
        cut = path.find("/", 1)
        while cut > 0:
            if path[:cut] in self.paths:
                return path[:cut]
            cut = path.find("/", cut + 1)
        return None

    def _make_fresh(self, path: str, leaf: bool | None) -> None:
        """The root's own directories above `path` that are missing, and `path` itself."""
        missing: list[str] = []
        parent = path[: path.rfind("/")]
        while parent not in self.made:
            missing.append(parent)
            parent = parent[: parent.rfind("/")]
        for directory in reversed(missing):
            os.mkdir(STAGING + directory, 0o755)
            self.made.add(directory)
        if leaf is None or path in self.made:
            return
        if leaf:
            os.mkdir(STAGING + path, 0o755)
            self.made.add(path)
        else:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(STAGING + path, flags, 0o444))

    def _step(self, parent: int, name: str, directory: bool | None, create: bool) -> int:
        """Open `name` in `parent` without following a symlink, making it first if it is
        missing and `create` says so."""
        flags = _DIR if directory else _ANY
        try:
            fd = os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            if directory is False:
                made = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                os.close(os.open(name, made, 0o444, dir_fd=parent))
            else:
                os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, flags, dir_fd=parent)
        if not directory and stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(40, f"{os.strerror(40)}: {name} is a symlink")  # ELOOP
        return fd

    def bind(self, path: str, source: int, *, readonly: bool) -> None:
        """`source` (a descriptor; -1: the path itself) bound at `path` with everything mounted
        below it, then made read-only (submounts too) if asked."""
        leaf = None if source < 0 else stat.S_ISDIR(os.fstat(source).st_mode)
        dirfd, name, where, opened = self.locate(path, leaf=leaf, create=source >= 0)
        try:
            origin = f"/proc/self/fd/{source}" if source >= 0 else where
            linux.mount(origin, where, None, linux.MS_BIND | linux.MS_REC)
            if readonly:
                linux.make_readonly(name, recursive=True, dir_fd=dirfd)
        finally:
            _close(opened)

    def mount_new(self, path: str, fstype: str, flags: int, data: str | None = None) -> None:
        """A new filesystem at `path`."""
        _dirfd, _name, where, opened = self.locate(path, leaf=True, create=True)
        try:
            linux.mount(fstype, where, fstype, flags, data)
        finally:
            _close(opened)

    def open_new(self, path: str) -> int:
        """A descriptor of what is now mounted at `path` (the caller closes it)."""
        dirfd, name, _where, opened = self.locate(path, leaf=None, create=False, last=False)
        try:
            return os.open(name, _DIR, dir_fd=dirfd)
        finally:
            _close(opened)

    def cover(self, made: dict[str, str]) -> None:
        path = made["path"]
        if "source" in made:  # a file: /dev/null over it, read-only
            dirfd, name, where, opened = self.locate(path, leaf=False, create=False)
            try:
                origin = f"/proc/self/fd/{self.source(made['source'])[0]}"
                linux.mount(origin, where, None, linux.MS_BIND)
                linux.make_readonly(name, recursive=False, dir_fd=dirfd)
            finally:
                _close(opened)
        elif path in self._holders():  # a bind lands inside it: read-only once that is made
            self.deferred.append(path)
            self.mount_new(path, "tmpfs", _COVER_FLAGS, "size=16k,nr_inodes=64,mode=0755")
        elif self.empty < 0:
            flags = _COVER_FLAGS | linux.MS_RDONLY
            self.mount_new(path, "tmpfs", flags, "size=4k,nr_inodes=16,mode=0555")
            self.empty = self.open_new(path)
        else:  # a bind of the first empty cover: no filesystem of its own (~26 us less each)
            _dirfd, _name, where, opened = self.locate(path, leaf=True, create=False)
            try:
                linux.mount(f"/proc/self/fd/{self.empty}", where, None, linux.MS_BIND)
            finally:
                _close(opened)

    def _holders(self) -> set[str]:
        if self.holders is None:
            self.holders = {
                path[:cut] for path in self.paths for cut in range(1, len(path)) if path[cut] == "/"
            }
        return self.holders

    def minimal_dev(self) -> None:
        flags = linux.MS_NOSUID | linux.MS_NOEXEC
        self.mount_new("/dev", "tmpfs", flags, "size=64k,mode=755")
        dev = self.open_new("/dev")
        try:
            for name, major, minor in _DEVICES:
                os.mknod(name, stat.S_IFCHR | 0o666, os.makedev(major, minor), dir_fd=dev)
            os.mkdir("pts", 0o755, dir_fd=dev)  # made here: a directory, no link
            linux.mount(
                "devpts", f"/proc/self/fd/{dev}/pts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
                "newinstance,ptmxmode=0666,mode=620",
            )  # fmt: skip
            os.symlink("pts/ptmx", "ptmx", dir_fd=dev)
            for index, name in enumerate(("stdin", "stdout", "stderr")):
                os.symlink(f"/proc/self/fd/{index}", name, dir_fd=dev)
            os.symlink("/proc/self/fd", "fd", dir_fd=dev)
        finally:
            os.close(dev)

    def pivot(self) -> None:
        """Into the new root; the old one detached; the new root read-only (unless a grant of
        the whole host is the root, whose mode is its own)."""
        os.chdir(STAGING)  # the new root (or the grant of the whole host bound on it)
        linux.pivot_root(".", ".")
        linux.umount2(".", linux.MNT_DETACH)
        os.chdir("/")
        if "/" not in self.paths:
            linux.make_readonly("/", recursive=False)


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)
