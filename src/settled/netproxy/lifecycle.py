"""Starting the home's proxy daemon once, and the two calls a session's life makes of it.

`serve` (the launcher, before a `--network proxy` session is claimed): the daemon makes the
task's listener unless it exists and opens the session's ledger, starting the daemon first if
none answers (serialized by a start lock, so one daemon per home). `stop` for tests and a
home's end. The seal is the owner's, through `wire.seal`.

Must never: start a second daemon for a home that has one, or say a session is served that the
daemon refused.
"""

from __future__ import annotations

import os
import time

from settled.daemons import lock_free, start_lock
from settled.errors import SettledError
from settled.netproxy import wire
from settled.netproxy.wire import IDLE_EXIT_S, LOG_NAME
from settled.where import run_dir

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class ProxyUnavailable(SettledError):
    """The proxy could not serve a session: it could not start, or refused (the why)."""


def serve(home: str, task: str, session: str, allow: tuple[str, ...], timeout: float = 30.0) -> str:
    """The session's ledger path, once the daemon serves it. ProxyUnavailable naming why not."""
    run = run_dir(home)
    body = {"op": "serve", "task": task, "session": session, "allow": list(allow)}
    deadline = time.monotonic() + timeout
    while True:
        left = max(deadline - time.monotonic(), 0.05)
        reply = wire.request(wire.socket_path(run), body, left)
        if reply is not None and reply.get("ok") is True:
            return str(reply["ledger"])
        if reply is not None:
            raise ProxyUnavailable(f"the proxy cannot serve task {task}: {reply.get('error')}")
        if time.monotonic() > deadline:
            raise ProxyUnavailable(
                f"the proxy did not answer within {timeout:g} s; see {os.path.join(run, LOG_NAME)}"
            )
        _start(run, home, deadline)


def stop(home: str, timeout: float = 5.0) -> None:
    """Stop the home's daemon, if one answers, and wait until it let its lock go."""
    run = run_dir(home)
    if not wire.send_stop(run, timeout):
        return
    lock = wire.socket_path(run) + wire.LOCK_SUFFIX
    give_up = time.monotonic() + timeout
    while not lock_free(lock):
        if time.monotonic() > give_up:
            raise ProxyUnavailable(f"the proxy acknowledged stop but still holds {lock}")
        time.sleep(0.005)


def _start(run: str, home: str, deadline: float) -> None:
    os.makedirs(run, mode=0o700, exist_ok=True)
    with start_lock(os.path.join(run, "netproxy.start"), deadline, ProxyUnavailable):
        if wire.request(wire.socket_path(run), {"op": "ping"}, 0.5) is not None:
            return
        if not lock_free(wire.socket_path(run) + wire.LOCK_SUFFIX):
            time.sleep(0.01)  # a daemon holds its lock: slow to answer, or exiting
            return
        report = _spawn(run, home, max(deadline - time.monotonic(), 0.5))
        if report.get("state") == "locked":
            time.sleep(0.01)  # a daemon is exiting, or about to answer
        elif report.get("state") != "ready":
            raise ProxyUnavailable(
                f"the proxy did not start: {report.get('error')}; see {os.path.join(run, LOG_NAME)}"
            )


def _spawn(run: str, home: str, timeout: float) -> dict[str, Any]:
    import subprocess

    from settled.helper_process import NoReport, python_command, read_report, start_helper

    argv = python_command("settled.netproxy.daemon:main", ("settled", "h11"), home)
    process, ready_r = start_helper(
        lambda ready_w: [*argv, repr(IDLE_EXIT_S), str(ready_w)],
        os.path.join(run, LOG_NAME),
        cwd="/",
    )
    try:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return {"state": "error", "error": f"the proxy did not fork within {timeout:g} s"}
        try:
            report = read_report(ready_r, time.monotonic() + timeout)
        except (NoReport, ValueError) as exc:
            return {"state": "error", "error": f"no report ({exc!r})"}
        return report if isinstance(report, dict) else {"state": "error", "error": "bad report"}
    finally:
        os.close(ready_r)
