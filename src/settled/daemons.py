"""What a home's daemons (the journal, the proxy) share about their start: the lock a live
daemon holds for its life, the start lock that lets one caller start one, and the one report
a starting daemon writes on its readiness pipe.

Must never: decide whether a daemon should run (each daemon's lifecycle does), or wait past
the deadline it was given.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def lock_free(path: str) -> bool:
    """Whether no process holds the flock of `path` (a missing file: none does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def start_lock(path: str, deadline: float, refuse: Callable[[str], Exception]) -> Iterator[None]:
    """Hold `path`'s flock while starting a daemon; `refuse(why)` is raised when it cannot be
    opened or another caller holds it past the monotonic `deadline`."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise refuse(f"cannot open the start lock {path}: {exc}") from exc
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise refuse(f"another caller holds {path} for too long") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)


class ReadyReport:
    """A daemon's one report to its starter (a JSON line on `fd`, then the pipe closed): the
    first call writes, the later ones do nothing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, fields: dict[str, Any]) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.fd, (json.dumps(fields) + "\n").encode())
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
