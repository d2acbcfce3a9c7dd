"""PID-namespace boundary: the command runs under a tiny init that is pid 1 of a new namespace.

Evidence: that init reaped by the owner. When a namespace's init dies the kernel SIGKILLs every
other member and waits for them before init's exit completes, so a reaped init is an empty
namespace. The init is a fork of the owner (no exec): it starts the command, reports the command's
wait status over a pipe, reaps orphans until ECHILD and exits. As pid 1 it ignores TERM from
outside, so the owner signals members directly and KILLs the init to finish. Needs CAP_SYS_ADMIN.

The init is made by clone3 with CLONE_NEWPID where the kernel has it (spawn.py), so the owner
itself never unshares a PID namespace and may start threads after the command runs; otherwise
the owner unshares for its children in `setup` (and must then start its threads before).
"""

from __future__ import annotations

import os

from settled.boundary import linux, procfs, unavailable
from settled.boundary.base import Boundary, Evidence
from settled.boundary.spawn import (
    child_prepare,
    fail_to_parent,
    fork_into,
    placement_failed,
    program_path,
    read_spawn_error,
    reset_child_signals,
    spawn_via,
    take_on_command,
)

TYPE_CHECKING = False  # on the owner's launch path: no typing, signal or contextlib imports
if TYPE_CHECKING:
    from collections.abc import Callable

    from settled.boundary.spawn import Launch

CAP_SYS_ADMIN = 21
SIGKILL = 9  # signal.SIGKILL on every Linux architecture
_KILLED_WITH_NAMESPACE = SIGKILL  # wait status of a command killed with its namespace


def has_cap_sys_admin() -> bool:
    return bool(procfs.effective_capabilities() >> CAP_SYS_ADMIN & 1)


def unshare_pid_namespace() -> None:
    try:
        linux.unshare(linux.CLONE_NEWPID)
    except OSError as exc:
        raise unavailable(f"pidns: {exc.strerror}") from None


def threads_refused() -> bool:
    """Whether this process unshared its PID namespace for its children (``setup`` where the
    init cannot be cloned): the kernel then refuses it any new thread, so what it opens from
    then on (its store) must not start one. Read from /proc: the namespace its children get
    is not its own, or is not made yet (no child since the unshare, or a kernel before 4.12,
    where the answer errs on the side of no threads)."""
    try:
        own = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc/self/ns: nothing unshared that this process can see
        return False
    try:
        return own != os.readlink("/proc/self/ns/pid_for_children")
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _run_init(
    launch: Launch, errpipe: int, status: int, prepare: Callable[[], None] | None
) -> None:
    """Body of pid 1. Never returns. A blanket wait is right here: every child is init's own.

    Init joins the boundary and builds the isolated view itself, so that every process of the
    namespace shares them and /proc is this namespace's; it is made non-dumpable, so nothing
    inside can read its memory, environment or descriptors through /proc/1. Then it takes on
    the command's stdio, descriptors, privileges and cwd itself and posix_spawns it (a vfork:
    no copy of this interpreter, ~1-4 ms less than a fork here), so the command inherits
    exactly what a forked child would have set up for its exec; init then lets go of the
    command's pipes and waits. It needs no privilege after that: it waits, reaps and reports."""
    at = ["boundary"]
    try:
        reset_child_signals()
        if prepare is not None:
            prepare()
        at[0] = "isolation"
        if launch.isolation.mount_namespace:
            # init's alone, loaded by a placer ahead, else here: before the view, after which
            # nothing of the host (settled's code included) can be read
            from settled.boundary import mountview, podns, privileges  # noqa: F401

            podns.around_view(launch.isolation, mountview.enter)
        linux.prctl(linux.PR_SET_DUMPABLE, 0)
        take_on_command(launch, errpipe, status, at)
        env = dict(launch.env)
        main = os.posix_spawn(program_path(launch.argv[0], env), launch.argv, env)
        linux.prctl(linux.PR_SET_DUMPABLE, 0)  # again: a uid change may reset it
    except BaseException as exc:
        fail_to_parent(errpipe, at[0], exc, launch.argv[0] if at[0] == "exec" else launch.cwd)
        os._exit(127)
    try:
        null = os.open(os.devnull, os.O_RDWR)  # init keeps nothing of the command's
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        os.close(errpipe)  # the owner reads EOF: the command runs
        while True:
            try:
                pid, wait_status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid == main:
                os.write(status, b"%d\n" % wait_status)
    except BaseException:  # init must never return into the owner's code
        pass
    finally:
        os._exit(0)


def run_init(launch: Launch, errpipe: int, status: int, prepare: Callable[[], None] | None) -> None:
    """Become pid 1 (never returns): named settled-init (a placer's clone would show as
    settled-placer), then `_run_init`."""
    try:
        with open("/proc/self/comm", "wb") as handle:
            handle.write(b"settled-init")
    except OSError:
        pass
    _run_init(launch, errpipe, status, prepare)


class PidnsBoundary(Boundary):
    kind = "pidns"

    def __init__(self, task: str, session: str) -> None:
        super().__init__(task, session)
        self.init_pid: int | None = None
        self._status_r: int | None = None
        self._init_status: int | None = None

    def run_child(self, launch: Launch, errpipe: int, status: int, placed: bool) -> None:
        """Pid 1's life, in the process cloned into the namespace (never returns)."""
        run_init(launch, errpipe, status, child_prepare(self.prepare_child, launch, placed))

    def placed_child(self) -> dict[str, bool]:
        return {"init": True, "setpgid": False}

    @property
    def ref(self) -> str | None:
        if self.init_pid is None:
            return None
        return f"pidns:init={self.init_pid}:start={procfs.start_time(self.init_pid)}"

    def setup(self) -> None:
        """Only where the init cannot be cloned into its namespace: unshare it for this
        process's children (after which the kernel refuses this process any new thread)."""
        if not has_cap_sys_admin():
            raise unavailable("pidns: needs CAP_SYS_ADMIN, which this process lacks")
        if spawn_via(self.birth_cgroup(), new_pid_namespace=True) == "fork":
            unshare_pid_namespace()

    def start(self, launch: Launch) -> int:
        if launch.placer is not None:  # the placer clones init (placer.py), as our child
            pid, errpipe_r, status_r = launch.placer.start()  # cloned ahead, at its gate
            self.init_pid, self._pidfd, self._status_r = pid, os.pidfd_open(pid), status_r
            return self._started(read_spawn_error(errpipe_r))
        errpipe_r, errpipe_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        cgroup = self.birth_cgroup()
        try:
            pid, pidfd, placed = fork_into(cgroup, new_pid_namespace=True)
        except OSError as exc:
            for fd in (errpipe_r, errpipe_w, status_r, status_w):
                os.close(fd)
            raise placement_failed(exc, cgroup) from None
        if pid == 0:
            os.close(errpipe_r)
            os.close(status_r)
            self.run_child(launch, errpipe_w, status_w, placed)
        os.close(errpipe_w)
        os.close(status_w)
        self.init_pid = pid
        self._pidfd = pidfd if pidfd >= 0 else os.pidfd_open(pid)
        self._status_r = status_r
        return self._started(read_spawn_error(errpipe_r))

    def _started(self, failure: Exception | None) -> int:
        """Init's pid once its command runs; `failure` (its report) raised once init is reaped."""
        assert self.init_pid is not None
        if failure is not None:
            self._init_status = os.waitpid(self.init_pid, 0)[1]  # init exits: no command
            raise failure
        kids = procfs.children(self.init_pid)
        self.main_pid = kids[0] if kids else None
        return self.init_pid

    def exit_fd(self) -> int:
        assert self._status_r is not None
        return self._status_r

    def empty_fd(self) -> int | None:
        """The init's pidfd: readable once init exited, and the kernel lets init's exit finish
        only after every other member of its namespace is gone."""
        return self._pidfd if self._init_status is None else None

    def collect_main(self) -> int | None:
        if self._main_status is None and self._status_r is not None:
            os.set_blocking(self._status_r, False)
            try:
                data = os.read(self._status_r, 64)
            except BlockingIOError:
                return None
            if data:
                self._main_status = int(data.split(b"\n", 1)[0])
            elif self._reap_init():
                self._main_status = int(_KILLED_WITH_NAMESPACE)
        return self._main_status

    def _reap_init(self) -> bool:
        if self._init_status is None and self.init_pid is not None:
            pid, status = os.waitpid(self.init_pid, os.WNOHANG)
            if pid == self.init_pid:
                self._init_status = status
        return self._init_status is not None

    def members(self) -> list[int]:
        if self.init_pid is None or self._init_status is not None:
            return []
        return procfs.live_descendants(self.init_pid)

    def kill_all(self) -> None:
        if self.init_pid is not None and self._init_status is None:
            try:  # noqa: SIM105 - contextlib stays off the owner's launch path
                os.kill(self.init_pid, SIGKILL)
            except ProcessLookupError:
                pass

    def is_empty(self) -> bool:
        return self._reap_init()

    def evidence(self) -> Evidence:
        proven = self._reap_init()
        observed: dict[str, object] = {"init_pid": self.init_pid, "init_status": self._init_status}
        text = (
            f"init {self.init_pid} of the PID namespace reaped; the kernel kills every member "
            "before init's exit completes"
            if proven
            else None
        )
        return Evidence(self.kind, proven, text, observed)

    def teardown(self) -> None:
        super().teardown()
        if self._status_r is not None:
            os.close(self._status_r)
            self._status_r = None
