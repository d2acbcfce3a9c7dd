"""Starting a session owner, detached from whoever asked for it: the `Launcher` seam.

A `Launcher` turns an admitted session into a running owner and returns the owner's readiness
report. Two implement it: `FreshLauncher` here, and the zygote's `WarmLauncher`
(`owner/zygote.py`); a third (an owner started inside a remote sandbox) is a new module.

The owner is a fresh `python -I -S` (7-10 ms to start, against ~47 ms for a default
interpreter) with only settled and blake3 on its path. It forks once so the launcher reaps its
first process at once and never leaves a zombie; the real owner is re-parented away from the
caller and outlives the request, the CLI and any reader. While its interpreter starts, the
launcher prepares the session in the caller's process, then claims it for the owner's pid and
hands it its orders (handoff.py), so the owner imports nothing heavy before its command runs;
the readiness pipe reports when it does. Both launchers share that handover.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from settled.home import make_session_dir
from settled.isolated import ReportReader, import_roots, python_command, start_helper
from settled.owner.handoff import hand_over, prepare
from settled.store import Store

READY_TIMEOUT_S = 30.0
OWNER_MODULES = ("settled", "blake3")


class Launcher(Protocol):
    """Starts one detached owner per call; thread-safe, so one may serve many Runtimes."""

    def launch(self, home: str, session: str, store: Store) -> dict[str, Any]:
        """The owner's readiness report, or {"error": why} when it never reported. `store` is
        the caller's (its thread's): the launcher claims the session through it."""
        ...

    def close(self) -> None:
        """End what the launcher keeps (a zygote); owners it started run on."""
        ...


class FreshLauncher:
    """A fresh interpreter per owner: nothing kept, nothing to close."""

    def launch(self, home: str, session: str, store: Store) -> dict[str, Any]:
        return launch_owner(home, session, store)

    def close(self) -> None:
        return None


def owner_path() -> list[str]:
    return import_roots(*OWNER_MODULES)


def owner_command(session: str, ready_fd: int, orders_fd: int) -> list[str]:
    """The home travels in the environment (SETTLED_OWNER_HOME), never on the command line."""
    return python_command(
        "settled.owner.main:main", OWNER_MODULES, session, str(ready_fd), str(orders_fd)
    )


def launch_owner(home: str, session: str, store: Store) -> dict[str, Any]:
    """Start the owner's interpreter, prepare the session meanwhile, then hand it over."""
    directory = make_session_dir(home, session)
    orders_r, orders_w = os.pipe2(os.O_CLOEXEC)
    try:
        process, ready_r = start_helper(
            lambda ready_w: owner_command(session, ready_w, orders_r),
            os.path.join(directory, "owner.log"),
            env={**os.environ, "SETTLED_OWNER_HOME": home},
            pass_fds=(orders_r,),
        )
    except BaseException:
        os.close(orders_w)
        raise
    finally:
        os.close(orders_r)
    try:
        try:
            prepared = prepare(store, home, session)  # while the interpreter starts
        except BaseException:
            os.close(orders_w)  # the owner reads EOF: no orders, it runs nothing
            raise
        return hand_over(store, prepared, ReportReader(ready_r), orders_w, READY_TIMEOUT_S)
    finally:
        os.close(ready_r)
        process.wait()  # the first process only forks the real owner and exits
