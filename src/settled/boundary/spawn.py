"""fork + exec of the command, with the child placed inside its boundary before it runs.

Why not subprocess: between fork and exec the child must be inside its cgroup (or be init of a
PID namespace), build its isolated view, close every descriptor but 0-2, give up its privileges,
and report a failure at any of those steps as a fact rather than an exit code; and the owner must
never reap with a blanket wait. This is the only place settled forks a command.

Two ways into a cgroup. `clone3(CLONE_INTO_CGROUP)` makes the child inside it (and, for a PID
namespace, as the namespace's init: CLONE_NEWPID), so it never runs an instruction outside and
no process migration is paid (a migration waits for an RCU grace period: ~15 ms here). Where the
kernel (< 5.7) or Python cannot, or `SETTLED_SPAWN=fork` asks for it, the child is forked and
writes its own pid into `cgroup.procs` before anything else, as settled always did; the receipt's
timings say which (`spawn_via`).

Stages, in order, as a SpawnFailed names them: boundary, isolation, stdio, privileges, chdir,
exec. The view is built before the privileges are dropped (it needs them), the cwd is entered
after (as the uid the command runs as).

Imported on the owner's launch path: os, sys and errno only (the builtin `_signal`, not `signal`,
whose enum import costs 1.5-3.5 ms here).
"""

from __future__ import annotations

import errno as errno_mod
import os
import sys

from settled.boundary.isolation import IsolationPlan

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from settled.boundary.placer import Placer

# The builtin behind `signal`, loaded with every interpreter (it has no stub, hence ModuleType).
_signal = sys.modules.get("_signal") or __import__("_signal")

_RESET_SIGNALS = tuple(
    getattr(_signal, name)
    for name in (
        "SIGPIPE", "SIGXFSZ", "SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCHLD",
        "SIGQUIT",
    )
)  # fmt: skip

SPAWN_ENV = "SETTLED_SPAWN"  # "fork": never clone3 (tests run both ways)
# A fresh owner's copy of its launcher's probe ("" : clone3 works, else why not): the probe is a
# clone3 the kernel refuses only after copying most of the process, ~0.5 ms of the launch path.
PROBED_ENV = "SETTLED_OWNER_CLONE3"


class SpawnFailed(OSError):
    """The command never ran: exec (or chdir, or joining the boundary) failed in the child."""

    def __init__(self, stage: str, err: int, detail: str) -> None:
        super().__init__(err, f"{stage} failed: {os.strerror(err)} ({detail})")
        self.stage, self.detail = stage, detail


class ChildIO:
    __slots__ = ("stderr", "stdin", "stdout")

    def __init__(self, stdin: int, stdout: int, stderr: int) -> None:
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr


class Launch:
    """What the child needs to become the command: no more is passed, nothing else inherited.

    `placer`: the owner's placer (placer.py), which clones the child instead of the owner;
    `join`: v1 cgroups a forked child joins itself first (the fork path; none with a placer);
    `gate`: in the child, a pipe it waits on before the command starts (the placer's: the
    owner opens it once it reaped the placer, whose zombie still counts in pids.max)."""

    __slots__ = ("argv", "cwd", "env", "gate", "io", "isolation", "join", "placer")

    def __init__(
        self,
        argv: list[str],
        cwd: str,
        env: Mapping[str, str],
        io: ChildIO,
        isolation: IsolationPlan | None = None,
    ) -> None:
        self.argv, self.cwd, self.env, self.io = argv, cwd, env, io
        self.isolation = isolation or IsolationPlan("none", no_new_privs=False)
        self.placer: Placer | None = None
        self.join: list[str] = []
        self.gate = -1


_MAX_FD = (1 << 31) - 1
_CLONE3: list[str | None] = []  # the probe's answer, once per process


def clone3_missing() -> str | None:
    """Why the command will not be started with clone3 (the fork-and-join path then), or None.
    Probed once per process: an owner's boundary setup and its spawn must agree."""
    if not _CLONE3:
        told = os.environ.get(PROBED_ENV)
        if os.environ.get(SPAWN_ENV) == "fork":
            _CLONE3.append(f"{SPAWN_ENV}=fork asked for fork and join")
        elif told is not None:  # a fresh owner: its launcher's answer, on this same kernel
            _CLONE3.append(told or None)
        else:
            try:
                from settled.boundary import linux
            except ImportError as exc:  # a Python built without ctypes
                _CLONE3.append(f"this Python cannot call clone3: {exc}")
            else:
                _CLONE3.append(linux.clone3_missing())
    return _CLONE3[0]


def spawn_via(cgroup: str | None, new_pid_namespace: bool) -> str:
    """How a child of this boundary is started: "clone3" or "fork"."""
    if (cgroup is not None or new_pid_namespace) and clone3_missing() is None:
        return "clone3"
    return "fork"


def fork_into(
    cgroup: str | None, new_pid_namespace: bool, *, parent: bool = False
) -> tuple[int, int, bool]:
    """(pid, pidfd or -1, placed); pid is 0 in the child. `placed`: the kernel started the
    child inside `cgroup` (and, asked, as init of a new PID namespace); otherwise it is a plain
    fork, which must join `cgroup` itself before anything else (and whose owner unshared the
    PID namespace beforehand). `parent` (the placer's, which exists only where clone3 does):
    clone3 with CLONE_PARENT, so the child is the caller's parent's. Raises OSError (ENODEV:
    the cgroup was removed meanwhile)."""
    if not parent and spawn_via(cgroup, new_pid_namespace) == "fork":
        return os.fork(), -1, False
    if len(os.listdir("/proc/self/task")) > 1:
        # The child of a raw clone3 is a copy of this thread alone, with every lock another
        # thread held copied held (no fork handler runs): the owner clones before it starts
        # any thread, and this guards that order loudly.
        raise RuntimeError("clone3 with more than one thread running: the owner's order broke")
    from settled.boundary import linux

    flags = (
        (linux.CLONE_INTO_CGROUP if cgroup is not None else 0)
        | (linux.CLONE_NEWPID if new_pid_namespace else 0)
        | (linux.CLONE_PARENT if parent else 0)
    )
    directory = -1 if cgroup is None else os.open(cgroup, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pid, pidfd = linux.clone3(flags, directory)
    finally:
        if directory >= 0:
            os.close(directory)
    return pid, pidfd, True


def sealed_stdin(data_path: str) -> int:
    """The stored stdin as a sealed memfd: the command reads the bytes but cannot reopen the
    stored copy through /proc/self/fd/0 and change it for the next session that uses it."""
    from settled.boundary import linux

    fd = os.memfd_create("settled-stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(data_path, "rb") as source:
            while chunk := source.read(1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        seals = linux.F_SEAL_SEAL | linux.F_SEAL_SHRINK | linux.F_SEAL_GROW | linux.F_SEAL_WRITE
        linux.fcntl(fd, linux.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def join_cgroup(cgroup: str) -> None:
    """In a forked child: move itself into `cgroup` ("0" names the writing process)."""
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as handle:
        handle.write("0")


def child_prepare(
    prepare: Callable[[bool], None], launch: Launch, placed: bool
) -> Callable[[], None]:
    """What the child does first: its boundary's `prepare(placed)`, then joining the v1
    cgroups of its limits where no placer started it inside them (the fork path, which
    pays their migration here, on the launch path), then making itself (and so the command)
    the OOM killer's first choice, before its view makes /proc read-only."""

    def first() -> None:
        prepare(placed)
        for path in launch.join:  # a single thread moves without cgroup.procs' global lock
            with open(os.path.join(path, "tasks"), "w") as handle:
                handle.write("0")
        _become_oom_victim()

    return first


COMMAND_OOM_SCORE_ADJ = b"1000"  # the kernel's first choice under memory pressure


def _pass_gate(launch: Launch) -> None:
    """Wait until the owner opens the gate (it reaped the placer); EOF without it: the owner
    gave up or died, and the command must not start."""
    gate, launch.gate = launch.gate, -1
    try:
        opened = os.read(gate, 1)
    finally:
        os.close(gate)
    if opened != b"g":
        raise OSError(errno_mod.ECANCELED, "the owner did not open the placer's gate")


def _become_oom_victim() -> None:
    """The command (and, inherited, all it starts) is what the kernel kills first: 1000 is
    always allowed to raise to; holding CAP_SYS_RESOURCE here also makes it its floor. In a
    PID namespace's init, which the command inherits it from (init itself is expendable: the
    kernel ends the namespace with it, and the receipt says so)."""
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, COMMAND_OOM_SCORE_ADJ)
    finally:
        os.close(fd)


def reset_child_signals() -> None:
    """Undo what the Python owner set: SIG_IGN for SIGPIPE survives exec, handlers and masks."""
    _signal.set_wakeup_fd(-1)
    for sig in _RESET_SIGNALS:
        _signal.signal(sig, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())


def fail_to_parent(errpipe: int, stage: str, exc: BaseException, detail: str) -> None:
    """Report a failed stage as 'stage:errno:detail' (the parent raises SpawnFailed from it)."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno else errno_mod.EIO
    text = detail if isinstance(exc, OSError) else f"{detail}: {exc!r}"
    if isinstance(exc, OSError) and stage not in ("exec", "chdir"):
        text = f"{exc.strerror or exc}"
    os.write(errpipe, f"{stage}:{code}:{text}".encode("utf-8", "replace")[:4000])


def exec_in_child(
    launch: Launch,
    errpipe: int,
    prepare: Callable[[], None] | None,
) -> None:
    """Runs in the forked (or cloned) child; never returns."""
    at = ["boundary"]
    try:
        reset_child_signals()
        if prepare is not None:
            prepare()
        at[0] = "isolation"
        if launch.isolation.mount_namespace:
            # the child's own modules, loaded by a placer ahead, else here: before the view,
            # after which nothing of the host (settled's code included) can be read
            from settled.boundary import mountview, podns, privileges  # noqa: F401

            podns.around_view(launch.isolation, mountview.enter)
        take_on_command(launch, errpipe, -1, at)
        execvpe(launch.argv[0], launch.argv, dict(launch.env))
    except BaseException as exc:  # the child must never return into the owner
        fail_to_parent(errpipe, at[0], exc, launch.argv[0] if at[0] == "exec" else launch.cwd)
    finally:
        os._exit(127)


def take_on_command(launch: Launch, errpipe: int, keep: int, at: list[str]) -> None:
    """Make this process what the command starts as: its stdio on 0-2 and no other descriptor
    (but `errpipe` and `keep`, both close-on-exec), its privileges, its cwd. Run by the child
    about to exec, or by a PID namespace's init about to posix_spawn it (which then inherits
    all of it). `at[0]` names the stage reached, for a failure's report; "exec" at the end."""
    at[0] = "limits"
    if launch.gate >= 0:
        _pass_gate(launch)
    at[0] = "stdio"
    os.dup2(launch.io.stdin, 0)
    os.dup2(launch.io.stdout, 1)
    os.dup2(launch.io.stderr, 2)
    low, high = sorted((errpipe, keep if keep >= 0 else errpipe))
    os.closerange(3, low)  # nothing of the owner's reaches the command
    os.closerange(low + 1, high)
    os.closerange(high + 1, _MAX_FD)
    at[0] = "privileges"
    from settled.boundary import privileges  # loaded before the view was built (above)

    privileges.drop(launch.isolation)
    at[0] = "chdir"
    os.chdir(launch.cwd)
    at[0] = "exec"


def program_path(file: str, env: Mapping[str, str]) -> str:
    """The file execvpe would run for `file` with the command's PATH: for posix_spawn, which
    does not search. A file found but not executable is refused as exec would refuse it."""
    if os.path.dirname(file):
        return file
    refused: OSError | None = None
    for directory in (env.get("PATH") or os.defpath).split(os.pathsep):
        candidate = os.path.join(directory, file)
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            refused = refused or PermissionError(
                errno_mod.EACCES, os.strerror(errno_mod.EACCES), candidate
            )
    raise refused or FileNotFoundError(errno_mod.ENOENT, os.strerror(errno_mod.ENOENT), file)


def execvpe(file: str, argv: list[str], env: dict[str, str]) -> None:
    """os.execvpe without its `import warnings` (an import in the child, on the launch path):
    the same search of the command's PATH, the same error kept (the first that is not
    "no such file")."""
    if os.path.dirname(file):
        os.execve(file, argv, env)
    first: OSError | None = None
    last: OSError = FileNotFoundError(errno_mod.ENOENT, os.strerror(errno_mod.ENOENT), file)
    for directory in (env.get("PATH") or os.defpath).split(os.pathsep):
        try:
            os.execve(os.path.join(directory, file), argv, env)
        except (FileNotFoundError, NotADirectoryError) as exc:
            last = exc
        except OSError as exc:
            last = exc
            first = first or exc
    raise first or last


def read_spawn_error(errpipe_r: int) -> SpawnFailed | None:
    """Read the child's report until EOF: EOF with no bytes means exec succeeded."""
    chunks = []
    while True:
        chunk = os.read(errpipe_r, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(errpipe_r)
    if not chunks:
        return None
    stage, err, detail = b"".join(chunks).decode("utf-8", "replace").split(":", 2)
    return SpawnFailed(stage, int(err), detail)


def placement_failed(exc: OSError, cgroup: str | None) -> SpawnFailed:
    """clone3 refused: the command never existed (ENODEV: its cgroup was removed meanwhile)."""
    where = f"clone3 into {cgroup}" if cgroup is not None else "clone3 of a PID namespace"
    return SpawnFailed("boundary", exc.errno or errno_mod.EIO, where)


def fork_exec(
    launch: Launch, prepare: Callable[[bool], None] | None = None, cgroup: str | None = None
) -> tuple[int, int]:
    """Start the command as a direct child inside `cgroup` (if any): (pid, pidfd), or raises
    SpawnFailed (the child reaped). `prepare(placed)` runs in the child first."""
    errpipe_r, errpipe_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid, pidfd, placed = fork_into(cgroup, new_pid_namespace=False)
    except OSError as exc:
        os.close(errpipe_r)
        os.close(errpipe_w)
        raise placement_failed(exc, cgroup) from None
    if pid == 0:
        os.close(errpipe_r)
        first = child_prepare(prepare or (lambda _placed: None), launch, placed)
        exec_in_child(launch, errpipe_w, first)
    os.close(errpipe_w)
    return await_exec(pid, pidfd, errpipe_r)


def await_exec(pid: int, pidfd: int, errpipe_r: int) -> tuple[int, int]:
    """(pid, pidfd) once the child's exec succeeded; else it is reaped and SpawnFailed raised."""
    failure = read_spawn_error(errpipe_r)
    if failure is not None:
        os.waitpid(pid, 0)
        if pidfd >= 0:
            os.close(pidfd)
        raise failure
    return pid, pidfd if pidfd >= 0 else os.pidfd_open(pid)
