"""The workers the home's zygote forks to run the CLI's verbs (cli/worker.py), each with
its caller's connection: a worker that ends without sending its exit code (a crash, a signal)
has the way it ended told to its caller by the zygote, its parent, which alone can know it.

Why: a verb run in the caller's own process that dies by SIGKILL ends that process by SIGKILL;
the caller's shell, a test or a supervisor sees exactly that. Run in a worker, only the worker's
parent learns its status, so the zygote keeps each worker's pidfd and the caller's end of the
connection until the worker is reaped, and sends `killed N` or `ended N`. Must never: reap a
child it did not fork, keep a caller's connection past its worker's end, or leave a worker
unreaped when the zygote ends (it waits for each one, and tells its caller).
"""

from __future__ import annotations

import contextlib
import os
import select

from settled.owner.forking import fork_child

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable


def _capacity() -> int:
    """Each live worker holds two of the zygote's descriptors (its pidfd and the caller's
    connection): at most a quarter of RLIMIT_NOFILE of them, and never more than 256 calls."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, min(256, soft // 8))


class VerbWorkers:
    """The live workers: pidfd -> the caller's connection. Polled with the listener."""

    def __init__(self, poller: select.poll) -> None:
        self._poller = poller
        self._live: dict[int, socket.socket] = {}
        self.capacity = _capacity()

    def __bool__(self) -> bool:
        return bool(self._live)

    def full(self) -> bool:
        """No room for another: its caller runs its call itself, as with no zygote."""
        return len(self._live) >= self.capacity

    def held(self) -> tuple[socket.socket, ...]:
        """What every child the zygote forks must close: the callers' connections it keeps."""
        return tuple(self._live.values())

    def start(
        self, become: Callable[[], int], fds: list[int], conn: socket.socket,
        close_in_child: tuple[socket.socket, ...],
    ) -> None:  # fmt: skip
        """Fork a worker running `become()`; keep `conn` (a duplicate: the caller's end stays
        open for the worker and for this report) and the worker's pidfd until it ends."""
        kept = conn.dup()
        pid = fork_child(become, fds, (*close_in_child, *self.held(), kept))
        handle = os.pidfd_open(pid)
        self._live[handle] = kept
        self._poller.register(handle, select.POLLIN)

    def owns(self, fd: int) -> bool:
        return fd in self._live

    def ended(self, handle: int) -> None:
        """Reap the worker behind `handle`; tell its caller how it ended unless it exited 0
        (after its own `exit N`, which the caller has read)."""
        conn = self._live.pop(handle)
        self._poller.unregister(handle)
        try:
            status = os.waitid(os.P_PIDFD, handle, os.WEXITED)
        finally:
            os.close(handle)
        with conn:
            if status is None or (status.si_code == os.CLD_EXITED and status.si_status == 0):
                return
            killed = status.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            word = b"killed" if killed else b"ended"
            with contextlib.suppress(OSError):  # its caller is gone: nobody to tell
                conn.sendall(b"%s %d" % (word, status.si_status))

    def finish(self) -> None:
        """Wait for every live worker and tell its caller: the zygote is leaving."""
        for handle in list(self._live):
            self.ended(handle)
