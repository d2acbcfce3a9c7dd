"""Starting a session owner, detached from whoever asked for it: the `Launcher` seam.

A `Launcher` turns an admitted session into a running owner and returns the owner's readiness
report. Two implement it: `FreshLauncher` here, and the zygote's `WarmLauncher`
(`owner/zygote.py`); a third (an owner started inside a remote sandbox) is a new module.

The owner is a fresh `python -I -S` (10 ms to start, against ~47 ms for a default interpreter) with
only settled and blake3 on its path. It forks once so the launcher reaps its first process at
once and never leaves a zombie; the real owner is re-parented away from the caller and outlives
the request, the CLI and any reader. A readiness pipe reports when the command runs. Its imports
cost ~50 ms more here (bench/admission.py): a long-lived caller uses the zygote instead.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

from settled.home import make_session_dir
from settled.isolated import (
    NoReport,
    import_roots,
    python_command,
    read_report,
    start_helper,
)

READY_TIMEOUT_S = 30.0


class Launcher(Protocol):
    """Starts one detached owner per call; thread-safe, so one may serve many Runtimes."""

    def launch(self, home: str, session: str) -> dict[str, Any]:
        """The owner's readiness report, or {"error": why} when it never reported."""
        ...

    def close(self) -> None:
        """End what the launcher keeps (a zygote); owners it started run on."""
        ...


class FreshLauncher:
    """A fresh interpreter per owner: nothing kept, nothing to close."""

    def launch(self, home: str, session: str) -> dict[str, Any]:
        return launch_owner(home, session)

    def close(self) -> None:
        return None


def owner_path() -> list[str]:
    return import_roots("settled", "blake3")


def owner_command(session: str, ready_fd: int | str) -> list[str]:
    """The home travels in the environment (SETTLED_OWNER_HOME), never on the command line."""
    return python_command("settled.owner.main:main", ("settled", "blake3"), session, str(ready_fd))


def launch_owner(home: str, session: str, wait_ready: bool = True) -> dict[str, Any]:
    """Start the owner; with wait_ready, return its readiness report (or why there is none)."""
    directory = make_session_dir(home, session)
    process, ready_r = start_helper(
        lambda ready_w: owner_command(session, ready_w),
        os.path.join(directory, "owner.log"),
        env={**os.environ, "SETTLED_OWNER_HOME": home},
    )
    process.wait()  # the first process only forks the real owner and exits
    try:
        if not wait_ready:
            return {"state": "launched"}
        return _read_ready(ready_r, READY_TIMEOUT_S)
    finally:
        os.close(ready_r)


def _read_ready(fd: int, timeout: float) -> dict[str, Any]:
    try:
        report: dict[str, Any] = read_report(fd, time.monotonic() + timeout)
    except NoReport as exc:
        if exc.why == "timeout":
            return {"error": f"the owner did not report within {timeout:.0f} s"}
        return {"error": "the owner exited before it reported; see owner.log"}
    return report
