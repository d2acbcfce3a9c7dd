"""Starting and stopping a workspace's journal daemon.

Owns the run directory's layout (socket, state file, log), the start lock that serializes
concurrent `ensure_running` calls so only one daemon is ever started, the spawn of `python -I -S`
that forks the daemon and reports readiness on a pipe, and `stop`, which waits until the stopped
daemon has released its lock.

Must never: start a second daemon for a run directory that has one, serve one run directory for
two workspaces, or return from `stop` while the journal still holds its lock (it raises instead).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from settled.isolated import (
    HelperUnavailable,
    NoReport,
    python_command,
    read_report,
    start_helper,
)
from settled.workspace.journal.client import ping, send_stop
from settled.workspace.journal.errors import JournalUnavailable

SOCKET_NAME, STATE_NAME, LOG_NAME = "journal.sock", "journal.state", "journal.log"


def stop(socket_path: str, timeout: float = 5.0) -> None:
    """Stop the journal on `socket_path` and wait until it has released its lock."""
    if not send_stop(socket_path, timeout):
        return  # nobody answers: nothing to stop
    lock_path = socket_path + ".lock"
    give_up = time.monotonic() + timeout
    while not _lock_free(lock_path):
        if time.monotonic() > give_up:
            raise JournalUnavailable(
                f"the journal on {socket_path} acknowledged stop but still holds {lock_path} "
                f"after {timeout:g} s (pid {_lock_owner(lock_path)})"
            )
        time.sleep(0.002)


def _lock_free(lock_path: str) -> bool:
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _lock_owner(lock_path: str) -> str:
    try:
        with open(lock_path) as handle:
            return handle.read().strip() or "unknown"
    except OSError:
        return "unknown"


def ensure_running(
    root: str, run_dir: str, *, idle_exit_s: float = 600.0, timeout: float = 5.0
) -> str:
    """Start the journal of `root` detached unless one answers; return its socket path.
    Concurrent callers are serialized by a start lock, so only one daemon is ever started."""
    root, run_dir = os.path.realpath(root), os.path.abspath(run_dir)
    socket_path = os.path.join(run_dir, SOCKET_NAME)
    if _answers(socket_path, root, 0.5):
        return socket_path
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    log_path = os.path.join(run_dir, LOG_NAME)
    deadline = time.monotonic() + timeout
    with _start_lock(os.path.join(run_dir, "journal.start"), deadline):
        while True:
            remaining = deadline - time.monotonic()
            if _answers(socket_path, root, min(0.5, max(remaining, 0.05))):
                return socket_path
            if remaining <= 0:
                raise JournalUnavailable(
                    f"no journal for {root} answered on {socket_path} within {timeout:g} s "
                    f"(lock held by pid {_lock_owner(socket_path + '.lock')}); see {log_path}"
                )
            report = _spawn(root, run_dir, idle_exit_s, remaining)
            if report.get("state") == "locked":
                time.sleep(0.01)  # a journal holds the lock: it answers soon, or is exiting
            elif report.get("state") != "ready":
                raise JournalUnavailable(
                    f"the journal for {root} did not start: {report.get('error')}; see {log_path}"
                )


def _answers(socket_path: str, root: str, timeout: float) -> bool:
    reply = ping(socket_path, timeout)
    if reply is None:
        return False
    if reply.get("root") != root:
        raise JournalUnavailable(
            f"{socket_path} serves the journal of {reply.get('root')!r}, not {root!r}: "
            "use one run directory per workspace"
        )
    return True


@contextlib.contextmanager
def _start_lock(path: str, deadline: float) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise JournalUnavailable(
                        f"another caller holds {path} (starting the journal) for too long"
                    ) from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)


def _spawn(root: str, run_dir: str, idle_exit_s: float, timeout: float) -> dict[str, Any]:
    """Start `python -I -S` (about 10 ms) that forks the daemon and exits; read its report."""
    try:
        argv = python_command(
            "settled.workspace.journal.daemon:main",
            ("settled", "inotify_simple"),
            root,
            os.path.join(run_dir, SOCKET_NAME),
            os.path.join(run_dir, STATE_NAME),
        )
    except HelperUnavailable as exc:
        raise JournalUnavailable(f"cannot start the journal: {exc}") from exc
    process, ready_r = start_helper(
        lambda ready_w: [*argv, repr(float(idle_exit_s)), str(ready_w)],
        os.path.join(run_dir, LOG_NAME),
        cwd="/",
    )
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
    try:
        report = read_report(fd, give_up)
    except NoReport as exc:
        if exc.why == "timeout":
            return {"state": "error", "error": "the journal did not report in time"}
        return {"state": "error", "error": "the journal exited before it reported"}
    except ValueError:
        report = None
    return report if isinstance(report, dict) else {"state": "error", "error": "bad report"}
