"""fork + exec of the command, with the child placed inside its boundary before it execs.

Why not subprocess: between fork and exec the child must join a cgroup (or become init of a PID
namespace), build its isolated view, close every descriptor but 0-2, give up its privileges, and
report a failure at any of those steps as a fact rather than an exit code; and the owner must
never reap with a blanket wait. This is the only place settled forks a command.

Stages, in order, as a SpawnFailed names them: boundary, isolation, stdio, privileges, chdir,
exec. The view is built before the privileges are dropped (it needs them), the cwd is entered
after (as the uid the command runs as).
"""

from __future__ import annotations

import errno as errno_mod
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from settled.boundary import mountview, privileges
from settled.boundary.isolation import IsolationPlan

_RESET_SIGNALS = (
    signal.SIGPIPE,
    signal.SIGXFSZ,
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCHLD,
    signal.SIGQUIT,
)


class SpawnFailed(OSError):
    """The command never ran: exec (or chdir, or joining the boundary) failed in the child."""

    def __init__(self, stage: str, err: int, detail: str) -> None:
        super().__init__(err, f"{stage} failed: {os.strerror(err)} ({detail})")
        self.stage, self.detail = stage, detail


@dataclass(frozen=True)
class ChildIO:
    stdin: int
    stdout: int
    stderr: int


@dataclass(frozen=True)
class Launch:
    """What the child needs to become the command: no more is passed, nothing else inherited."""

    argv: list[str]
    cwd: str
    env: Mapping[str, str]
    io: ChildIO
    isolation: IsolationPlan = field(
        default_factory=lambda: IsolationPlan("none", no_new_privs=False)
    )


_MAX_FD = (1 << 31) - 1


def reset_child_signals() -> None:
    """Undo what the Python owner set: SIG_IGN for SIGPIPE survives exec, handlers and masks."""
    signal.set_wakeup_fd(-1)
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


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
    *,
    build_view: bool = True,
) -> None:
    """Runs in the forked child; never returns. `build_view` is False when a PID namespace's
    init built the view already and this child inherits it."""
    stage = "boundary"
    try:
        reset_child_signals()
        if prepare is not None:
            prepare()
        stage = "isolation"
        if build_view and launch.isolation.mount_namespace:
            mountview.enter(launch.isolation)
        stage = "stdio"
        os.dup2(launch.io.stdin, 0)
        os.dup2(launch.io.stdout, 1)
        os.dup2(launch.io.stderr, 2)
        os.closerange(3, errpipe)  # nothing of the owner's reaches the command
        os.closerange(errpipe + 1, _MAX_FD)
        stage = "privileges"
        privileges.drop(launch.isolation)
        stage = "chdir"
        os.chdir(launch.cwd)
        stage = "exec"
        os.execvpe(launch.argv[0], launch.argv, dict(launch.env))
    except BaseException as exc:  # the child must never return into the owner
        detail = launch.argv[0] if stage == "exec" else launch.cwd
        fail_to_parent(errpipe, stage, exc, detail)
    finally:
        os._exit(127)


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


def fork_exec(launch: Launch, prepare: Callable[[], None] | None = None) -> int:
    """Start the command as a direct child; returns its pid or raises SpawnFailed (child reaped)."""
    errpipe_r, errpipe_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(errpipe_r)
        exec_in_child(launch, errpipe_w, prepare)
    os.close(errpipe_w)
    failure = read_spawn_error(errpipe_r)
    if failure is not None:
        os.waitpid(pid, 0)
        raise failure
    return pid
