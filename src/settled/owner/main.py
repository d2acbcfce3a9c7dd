"""Entry point of the session owner process: its signal handlers, its pid said, its orders.

An owner is started by a launcher (launcher.py: a fresh `python -I -S`, spawned in its own
session, whose pid the launcher knows at once; zygote.py: a fork of a pre-imported one, which
says its pid on the readiness pipe). The launcher claims the session for that pid (CAS with its
start time, boot id and a lease) and records the boundary in the same write, then sends the
orders (handoff.py); an owner that gets none runs nothing. A fresh owner is claimed for while
its interpreter starts; meanwhile it loads its launch path (launch.py), which starts the
command the moment the orders come.

Up to its pid, this imports os, sys, time, marshal and three small settled modules (the fault
points, the report encoder, the signals), nothing else.
Exit status is for the log only: the receipt in the store is the answer.
"""

from __future__ import annotations

import marshal
import os
import sys
import time

from settled import faults
from settled.helper_process import json_text
from settled.owner.signals import OwnerSignals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.owner.launch import Launching
    from settled.records import SessionRecord
    from settled.store import Store

OWNER_HOME_ENV = "SETTLED_OWNER_HOME"
ORDERS_VERSION = 1  # handoff.ORDERS_VERSION: the launcher's side


class Ready:
    """The launcher's readiness pipe: the owner's pid first, then one line once the command
    runs (or cannot). Written without json (helper_process.json_text). Closed once the receipt is
    written, not before: the launcher wakes its waiters on that (receipt_wake.py)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            os.set_inheritable(fd, False)

    def say(self, **fields: Any) -> None:
        if self.fd is None:
            return
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            os.write(self.fd, (json_text(fields) + "\n").encode())
        except OSError:  # the launcher went away; the session goes on
            pass

    def send(self, **fields: Any) -> None:
        """The last report: the pipe is closed after it."""
        self.say(**fields)
        self.close()

    def close(self) -> None:
        """End the pipe. After "running" this says the receipt is written (or the owner is
        failing): the launcher keeps its end to wake a waiter then (receipt_wake.py)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_orders(fd: int) -> dict[str, Any] | None:
    """The launcher's orders, or None at EOF with none (no claim was made for this process)."""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    if not chunks:
        return None
    given: dict[str, Any] = marshal.loads(b"".join(chunks))
    if given.get("v") != ORDERS_VERSION:
        raise ValueError(f"orders of version {given.get('v')!r}, this owner reads v1")
    return given


def main(argv: list[str] | None = None) -> int:
    """argv: SESSION READY_FD ORDERS_FD; the home comes in SETTLED_OWNER_HOME, so that it is
    not on the command line, which /proc shows to everyone (a PID namespace's init is a fork
    of this process). The launcher spawned it in a session of its own and reaps it."""
    session, ready_text, orders_text = (argv if argv is not None else sys.argv[1:])[:3]
    home = os.environ.pop(OWNER_HOME_ENV)
    return run_session(home, session, int(ready_text), int(orders_text))


def run_session(
    home: str, session: str, ready_fd: int | None, orders_fd: int, store: Store | None = None
) -> int:
    """The owner of `session`, once detached. Its first report is its pid, which the launcher
    claims the session for before it sends the orders. `store`: the home's, opened ahead (a
    zygote's spare, forking.py); the owner closes it."""
    faults.point("owner.before_ready")  # a death here leaves its session claimed by no one
    os.chdir("/")
    signals = OwnerSignals()  # a TERM from now on (or blocked until now) is a cancel
    ready = Ready(ready_fd)
    said_at = time.time()
    ready.say(owner_pid=os.getpid(), at=said_at)
    launching: Launching | None = None
    record: SessionRecord | None = None
    try:
        from settled.owner.ahead import Ahead

        ahead = Ahead.take()  # the placer first: a copy of this small process (ahead.py)
        from settled.owner.launch import Launching  # loads while the launcher claims

        # a spare's store is open: the session's record (its spec, key and digest, fixed at
        # admission) is read now, while the launcher claims, not after the command started
        record = _read_ahead(store, session)
        given = read_orders(orders_fd)
        if given is not None:
            given["timings"] |= {"owner_at": said_at, "orders_at": time.time()}
        if given is None:
            ahead.close()
            return 0  # no claim was made for this process: nothing ran, nothing to say
        if given["session"] != session:
            raise ValueError(f"orders for session {given['session']}, not {session}")
        launching = Launching(home, given, signals, ready, ahead, store, record)
        store = None  # the launch's to close from here
        return launching.run()
    except BaseException as exc:
        ready.send(error=f"owner failed: {exc!r}")
        if launching is not None and not isinstance(exc, SystemExit | KeyboardInterrupt):
            launching.say_last_words(f"the owner failed: {exc!r}")
        raise
    finally:
        if launching is not None:
            launching.close()
        if store is not None:
            store.close()


def _read_ahead(store: Store | None, session: str) -> SessionRecord | None:
    """The session's record from a store opened ahead, or None: the owner reads it again after
    its orders, and says there what is wrong (this process is not claimed for yet)."""
    if store is None:
        return None
    try:
        return store.get_session(session)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
