"""fork + exec of the command, with the child placed inside its boundary before it execs.

Why not subprocess: the child must join a cgroup (or become init of a PID namespace) between fork
and exec, report exec failures as facts rather than exit codes, and the owner must never reap with
a blanket wait. This is the only place settled forks a command.
"""

from __future__ import annotations

import errno as errno_mod
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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


def reset_child_signals() -> None:
    """Undo what the Python owner set: SIG_IGN for SIGPIPE survives exec, handlers and masks."""
    signal.set_wakeup_fd(-1)
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def exec_in_child(
    argv: list[str],
    cwd: str,
    env: Mapping[str, str],
    io: ChildIO,
    errpipe: int,
    prepare: Callable[[], None] | None,
) -> None:
    """Runs in the forked child; never returns. Failures go to errpipe as 'stage:errno:detail'."""
    stage = "boundary"
    try:
        reset_child_signals()
        if prepare is not None:
            prepare()
        stage = "stdio"
        os.dup2(io.stdin, 0)
        os.dup2(io.stdout, 1)
        os.dup2(io.stderr, 2)
        stage = "chdir"
        os.chdir(cwd)
        stage = "exec"
        os.execvpe(argv[0], argv, dict(env))
    except OSError as exc:
        message = f"{stage}:{exc.errno or errno_mod.EIO}:{argv[0] if stage == 'exec' else cwd}"
        os.write(errpipe, message.encode("utf-8", "replace")[:4000])
    except BaseException as exc:  # the child must never return into the owner
        os.write(errpipe, f"{stage}:{errno_mod.EIO}:{exc!r}".encode()[:4000])
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


def fork_exec(
    argv: list[str],
    cwd: str,
    env: Mapping[str, str],
    io: ChildIO,
    prepare: Callable[[], None] | None = None,
) -> int:
    """Start the command as a direct child; returns its pid or raises SpawnFailed (child reaped)."""
    errpipe_r, errpipe_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(errpipe_r)
        exec_in_child(argv, cwd, env, io, errpipe_w, prepare)
    os.close(errpipe_w)
    failure = read_spawn_error(errpipe_r)
    if failure is not None:
        os.waitpid(pid, 0)
        raise failure
    return pid
