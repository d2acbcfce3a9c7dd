"""Starting the home's journal daemon, handing it tasks to watch, and stopping it.

Owns the run directory's layout (socket, per-task state, log), the start lock that serializes
concurrent starts so only one daemon is ever started per run directory, the spawn of
`python -I -S` that forks the daemon and reports readiness on a pipe, `ensure_watching` (a
task's workspace added to the running daemon: one request), `release`, and `stop`, which waits
until the stopped daemon has released its lock.

Must never: start a second daemon for a run directory that has one, report a task watched that
the daemon refused, or return from `stop` while the journal still holds its lock (it raises).
"""

from __future__ import annotations

import contextlib
import os
import time

from settled.daemons import lock_free, start_lock
from settled.workspace.journal import wire as client
from settled.workspace.journal.errors import JournalUnavailable
from settled.workspace.journal.wire import LOG_NAME, SOCKET_NAME, STATE_DIR

# Starting a daemon (isolated, subprocess) is imported where it happens: an exec that finds
# the journal running (every exec but a home's first) sends one request and loads neither.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

IDLE_EXIT_S = 60.0  # how long a daemon with no task watched and no client stays


def ensure_watching(
    task: str,
    root: str,
    run_dir: str,
    *,
    idle_exit_s: float = IDLE_EXIT_S,
    timeout: float = 30.0,
) -> str:
    """Make the run directory's journal watch `root` for `task`, starting the daemon unless
    one answers; return its socket path. Raises JournalUnavailable naming why it cannot."""
    root, run_dir = os.path.realpath(root), os.path.abspath(run_dir)
    socket_path = os.path.join(run_dir, SOCKET_NAME)
    deadline = time.monotonic() + timeout
    while True:
        reply = client.watch(socket_path, task, root, max(deadline - time.monotonic(), 0.05))
        if reply is not None and reply.get("ok") is True:
            return socket_path
        if reply is not None:
            raise JournalUnavailable(
                f"the journal cannot watch {root} for task {task}: {reply.get('error')}"
            )
        if time.monotonic() > deadline:
            raise JournalUnavailable(
                f"the journal on {socket_path} did not answer a watch of {root} for task "
                f"{task} within {timeout:g} s; see {os.path.join(run_dir, LOG_NAME)}"
            )
        ensure_running(run_dir, idle_exit_s=idle_exit_s, timeout=deadline - time.monotonic())


def release(socket_path: str, task: str, *, forget: bool = False) -> bool:
    """Stop watching `task` (`forget`: and drop its sequence state, for a creation undone).
    False if no journal answers (then none watches it)."""
    return client.release(socket_path, task, forget=forget)


def forget_state(run_dir: str, task: str) -> None:
    """Remove the task's state when no journal answers to forget it (a creation undone)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # no state: nothing to do
        os.unlink(os.path.join(os.path.abspath(run_dir), STATE_DIR, f"{task}.state"))


def stop(socket_path: str, timeout: float = 5.0) -> None:
    """Stop the journal on `socket_path` and wait until it has released its lock."""
    if not client.send_stop(socket_path, timeout):
        return  # nobody answers: nothing to stop
    lock_path = socket_path + ".lock"
    give_up = time.monotonic() + timeout
    while not lock_free(lock_path):
        if time.monotonic() > give_up:
            raise JournalUnavailable(
                f"the journal on {socket_path} acknowledged stop but still holds {lock_path} "
                f"after {timeout:g} s (pid {_lock_owner(lock_path)})"
            )
        time.sleep(0.002)


def _lock_owner(lock_path: str) -> str:
    try:
        with open(lock_path) as handle:
            return handle.read().strip() or "unknown"
    except OSError:
        return "unknown"


def ensure_running(run_dir: str, *, idle_exit_s: float = IDLE_EXIT_S, timeout: float = 5.0) -> str:
    """Start the run directory's journal detached unless one answers; return its socket path.
    Concurrent callers are serialized by a start lock, so only one daemon is ever started."""
    run_dir = os.path.abspath(run_dir)
    socket_path = os.path.join(run_dir, SOCKET_NAME)
    if _answers(socket_path, 0.5):
        return socket_path
    log_path = os.path.join(run_dir, LOG_NAME)
    try:
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise JournalUnavailable(
            f"cannot make the journal's run directory {run_dir}: {exc}"
        ) from exc
    deadline = time.monotonic() + max(timeout, 0.05)
    with start_lock(os.path.join(run_dir, "journal.start"), deadline, _unavailable):
        while True:
            remaining = deadline - time.monotonic()
            if _answers(socket_path, min(0.5, max(remaining, 0.05))):
                return socket_path
            if remaining <= 0:
                raise JournalUnavailable(
                    f"no journal answered on {socket_path} within {timeout:g} s "
                    f"(lock held by pid {_lock_owner(socket_path + '.lock')}); see {log_path}"
                )
            if not lock_free(socket_path + ".lock"):
                time.sleep(0.01)  # a journal holds its lock: slow to answer (a loaded host),
                continue  # or exiting; a second one would only find the lock held
            report = _spawn(run_dir, idle_exit_s, remaining)
            if report.get("state") == "locked":
                time.sleep(0.01)  # a journal holds the lock: it answers soon, or is exiting
            elif report.get("state") != "ready":
                raise JournalUnavailable(
                    f"the journal in {run_dir} did not start: {report.get('error')}; see {log_path}"
                )


def _answers(socket_path: str, timeout: float) -> bool:
    """Whether a journal answers on `socket_path`. One that answers it refuses this process
    (peers.py: another mount or PID namespace than its own, or a session's) is no reason to
    start another, which would only find the lock held: JournalUnavailable, naming why."""
    reply = client.request(socket_path, {"op": "ping"}, timeout)
    if reply is None:
        return False
    if reply.get("ok") is True:
        return True
    raise JournalUnavailable(f"the journal on {socket_path} answers: {reply.get('error')}")


def _spawn(run_dir: str, idle_exit_s: float, timeout: float) -> dict[str, Any]:
    """Start `python -I -S` (about 10 ms) that forks the daemon and exits; read its report."""
    import subprocess

    from settled.helper_process import HelperUnavailable, python_command, start_helper

    try:
        argv = python_command(
            "settled.workspace.journal.daemon:main", ("settled", "inotify_simple"), run_dir
        )
    except HelperUnavailable as exc:
        raise JournalUnavailable(f"cannot start the journal: {exc}") from exc
    try:
        process, ready_r = start_helper(
            lambda ready_w: [*argv, repr(float(idle_exit_s)), str(ready_w)],
            os.path.join(run_dir, LOG_NAME),
            cwd="/",
        )
    except OSError as exc:
        raise JournalUnavailable(f"cannot start the journal in {run_dir}: {exc}") from exc
    try:
        give_up = time.monotonic() + timeout
        try:
            process.wait(timeout)  # the first process only forks the daemon and exits
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return {"state": "error", "error": f"the journal did not fork within {timeout:g} s"}
        return _read_report(ready_r, give_up)
    finally:
        os.close(ready_r)


def _read_report(fd: int, give_up: float) -> dict[str, Any]:
    from settled.helper_process import NoReport, read_report

    try:
        report = read_report(fd, give_up)
    except NoReport as exc:
        if exc.why == "timeout":
            return {"state": "error", "error": "the journal did not report in time"}
        return {"state": "error", "error": "the journal exited before it reported"}
    except ValueError:
        report = None
    return report if isinstance(report, dict) else {"state": "error", "error": "bad report"}


def _unavailable(why: str) -> JournalUnavailable:
    return JournalUnavailable(f"the journal cannot start: {why}")
