"""Commands for settled's own helper processes (owners, the zygote, journals), and their reports.

Each runs as a fresh `python -I -S` (about 10 ms to start, against ~47 ms for a default
interpreter with site packages) with only the import roots it needs put on sys.path by hand.
Never imports anything heavy: the launchers call it on the admission path.

A helper reports readiness as one JSON line on a pipe. `read_report` waits for it with poll(),
never select(): a launcher in a process with more than 1,024 descriptors open (a busy server)
gets a pipe numbered past FD_SETSIZE, which select() refuses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


class HelperUnavailable(RuntimeError):
    pass


def import_roots(*modules: str) -> list[str]:
    """The sys.path entries that hold these modules (a package's parent, a module's folder)."""
    roots: list[str] = []
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise HelperUnavailable(f"cannot locate module {module!r}: pip install it")
        origin = os.path.dirname(spec.origin)
        root = os.path.dirname(origin) if spec.submodule_search_locations else origin
        if root not in roots:
            roots.append(root)
    return roots


def python_command(target: str, modules: tuple[str, ...], *args: str) -> list[str]:
    """`python -I -S -c …` that puts `modules` on sys.path and calls `target(argv)`,
    where target is "package.module:function"; its return value is the exit status."""
    module, _, function = target.partition(":")
    boot = (
        "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
        f"from {module} import {function}; sys.exit({function}(sys.argv[2:]))"
    )
    return [sys.executable, "-I", "-S", "-c", boot, json.dumps(import_roots(*modules)), *args]


def start_helper(
    command: Callable[[int], list[str]],
    log: str,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a helper detached from the caller (its own session, stdin /dev/null, stdout and
    stderr appended to `log`), handing it the write end of a readiness pipe as `command(fd)`.
    Returns the first process (the caller waits for it) and the pipe's read end (the caller
    reads the report with `read_report` and closes it)."""
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    try:
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            process = subprocess.Popen(
                command(ready_w),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                pass_fds=(ready_w,),
                start_new_session=True,
                close_fds=True,
                cwd=cwd,
            )
        finally:
            os.close(log_fd)
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return process, ready_r


class NoReport(Exception):
    """The helper did not report: `timeout` (the deadline passed) or `eof` (it exited first)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def read_report(fd: int, give_up: float) -> Any:
    """The first line a helper writes on `fd`, parsed as JSON, by the monotonic `give_up`.
    Raises NoReport; a line that is not JSON raises ValueError."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    data = b""
    while b"\n" not in data:
        remaining = give_up - time.monotonic()
        if remaining <= 0:
            raise NoReport("timeout")
        if not poller.poll(remaining * 1000.0):
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            raise NoReport("eof")
        data += chunk
    return json.loads(data.partition(b"\n")[0])
