"""The owner's signal handling: so that no signal kills it by its default action. TERM, INT
and HUP become a cancel; USR1 means "look at the store now". A fresh owner is claimed for while
its interpreter starts, so its launcher starts it with these signals blocked (`HANDLED`):
one sent meanwhile waits, and is handled once the handlers are in and unblock it.

On the owner's launch path, so it uses the builtin `_signal` (loaded with every interpreter)
rather than `signal`, whose enum import costs 1.5-3.5 ms here. Must never do more in a handler
than note the reason: the supervise loop acts on it (its wake-up pipe is `wake_r`).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

_signal = sys.modules.get("_signal") or __import__("_signal")
STOP_SIGNALS = {_signal.SIGTERM: "SIGTERM", _signal.SIGINT: "SIGINT", _signal.SIGHUP: "SIGHUP"}
HANDLED: tuple[int, ...] = (*STOP_SIGNALS, _signal.SIGUSR1)


def _look(_signum: int, _frame: FrameType | None) -> None:
    """USR1: nothing to do here; the wake-up pipe makes the loop look at the store."""


class OwnerSignals:
    """Installed before the owner is claimed for: TERM/INT/HUP become a cancel, USR1 a look."""

    def __init__(self) -> None:
        self.wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stop_reason: str | None = None
        _signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            _signal.signal(sig, self._on_stop)
        _signal.signal(_signal.SIGUSR1, _look)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, HANDLED)  # what waited is handled now

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        name = STOP_SIGNALS.get(signum, f"signal {signum}")
        self.stop_reason = self.stop_reason or f"owner received {name}"

    def drain(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
