"""What both zygotes share: what they import before any fork, how one forks a detached owner
with its caller's environment, and the caller's half of a launch through either.

A zygote (`zygote.py`, a Runtime's own; `home_launcher.py`, the home's) imports everything an
owner runs once, then forks one per request; the fork detaches (setsid, a second fork, so it
outlives the zygote), takes the caller's environment and umask, and runs the session only on
the orders of the caller that claimed it (handoff.py).

A spare: after each request a zygote forks the next owner ahead of need (`Spare`): detached
already, its store opened once no request came for a moment, it waits for a request on a
socket only the zygote holds, so the next caller's owner says its pid without waiting for a
fork (~1.7 ms) or a first store open in a fresh copy of the heap (~1.2 ms of page faults).
A home bound to PostgreSQL or S3: what its owners need beyond the embedded home's is imported
once, in the zygote, before the spare that follows its first request (remote_imports.py).
Must never: import after the fork, run a command without the caller's orders, or outlive its
zygote (a spare that reads EOF exits).
"""

from __future__ import annotations

import contextlib
import marshal
import os
import time
from collections.abc import Callable

from settled import faults
from settled.helper_process import ReportReader
from settled.home import make_session_dir
from settled.owner import receipt_wake
from settled.owner.handoff import hand_over, prepare
from settled.owner.launcher import READY_TIMEOUT_S
from settled.owner.remote_imports import Remote
from settled.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

MAX_REQUEST = 1 << 20
ZYGOTE_MODULES = ("settled", "blake3")


def preload() -> None:
    """Import, once and before any fork, everything an owner runs: each fork then has it."""
    import ctypes  # noqa: F401 - pidns and subreaper owners need it; import it once, here
    import encodings.ascii  # noqa: F401 - a codec looked up by name is imported at first use
    import gc

    import settled.owner.launch  # the owner's launch path, likewise
    import settled.owner.main  # imported once, before any fork
    import settled.owner.session  # what the owner loads once its command runs
    import settled.workspace.journal.wire  # noqa: F401 - the barrier's wire, likewise
    from settled import boundary, oomguard, store
    from settled.boundary import limits, linux, spawn
    from settled.boundary import walls as _walls  # noqa: F401 - the receipt's resources

    store.load_implementation()  # the store the owner opens, likewise
    boundary.preload()  # the boundary it makes, likewise
    limits.controllers()  # where each limit is enforced: probed once here, for every fork
    limits.defaults()  # the host's defaults, likewise
    oomguard.protect_self()  # the zygote, and so every owner it forks, where it can

    linux.capget()  # libc loaded once here, not in every owner that isolates its command
    spawn.clone3_missing()  # probed once here (ctypes' PyDLL handle with it)
    # Last: the collector of every fork never walks what was loaded here, so it never writes
    # to (and makes the kernel copy) the pages of the shared heap. Those objects live as long
    # as the process anyway; only garbage this very call made would now never be collected.
    gc.freeze()


def fork_owner(request: dict[str, Any], fds: list[int], sockets: tuple[socket.socket, ...]) -> None:
    """Fork the owner `request` asks for, handing it `fds` (its ready and orders pipes); the
    child closes `sockets` (the zygote's own), detaches and becomes the owner. The spare, if
    one waits for this home, becomes it instead (no fork on the caller's path)."""
    Remote.note(request)  # its imports are made after the caller has its answer (Refill)
    if Spare.take(request, fds):
        return
    from settled.owner.main import run_session  # preloaded: no import after the fork

    def become() -> int:
        _detach()
        return _become_owner(request, fds, run_session)

    _STUBS.add(fork_child(become, fds, sockets))
    # The stub is not waited for: it forks the real owner and exits at once, but under load it
    # waits for a CPU first, and the zygote serves one caller at a time (200 queued behind
    # each other's scheduling). It is reaped at the next fork or when the zygote ends; what
    # the caller learns of the owner comes over the ready pipe, as before (EOF if it failed).


_STUBS: set[int] = set()  # the owners' stubs this zygote forked and has not reaped
PRIME_AFTER_S = 0.01  # a spare opens its store once it waited this long for a request
PRIME_MIN_FILES = 256  # and only under a descriptor limit this high: it holds the store's


def _room_to_prime() -> bool:
    """Whether the owner's descriptor limit leaves room for a store opened ahead: under a
    tight one, the descriptors it holds while its command is started could be the ones the
    boundary needs (the command would then never start)."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft == resource.RLIM_INFINITY or soft >= PRIME_MIN_FILES


def _detach() -> None:
    """In a zygote's child: a session of its own, then a second fork whose stub exits at once,
    so the owner outlives the zygote, nobody's child but init's."""
    os.setsid()
    if os.fork() != 0:
        os._exit(0)


REFILL_AFTER_S = 0.05  # a spare is forked this long after the request it follows (see Refill)


class Refill:
    """When the zygote forks its next spare: not at once after a request, but REFILL_AFTER_S
    later, unless another request came first (which is then served, forked on its path if no
    spare waits, and the refill waits again). A spare is a fork of the whole zygote, and its
    placer another: on two CPUs, forked at once they took the CPU the launch they followed
    still needed (its placer's clone, its command's view: exec to running p50 ~+1 ms warm);
    an agent's calls come one at a time, far more than 50 ms apart, so the next one still
    finds its spare waiting. A burst of calls is served by forks, and refills once it ends."""

    def __init__(self) -> None:
        self.home: str | None = None
        self.due = 0.0

    def after(self, home: str) -> None:
        """A request for `home` was served: its spare is due REFILL_AFTER_S from now."""
        self.home, self.due = home, time.monotonic() + REFILL_AFTER_S

    def timeout_ms(self, idle_ms: float) -> float:
        """How long the zygote may wait for its next request: until the refill is due."""
        if self.home is None:
            return idle_ms
        return max(0.0, min(idle_ms, (self.due - time.monotonic()) * 1000.0))

    def run_if_due(self, sockets: tuple[socket.socket, ...]) -> bool:
        """Fork the spare when it is due (True: one was due, and is forked or could not be)."""
        if self.home is None or time.monotonic() < self.due:
            return False
        home, self.home = self.home, None
        Remote.prepare()  # before the spare's fork, so that it has them too
        Spare.refill(home, sockets)
        return True


class Spare:
    """The next owner, forked before it is asked for: one per zygote, for the home of the
    request before (its store opened there while it waits), waiting on a socketpair whose other
    end only the zygote holds. `take` hands it a request; `refill` forks the next once the
    caller has its answer (a zygote that cannot simply has none: owners are forked on request);
    `end` closes the zygote's end, and the spare, reading EOF, exits having run nothing. A
    spare's store was opened before its request, as an owner's is opened before a long command
    ends: the home it serves is the one its request names, or it is let go."""

    current: Spare | None = None

    def __init__(self, home: str, sock: socket.socket) -> None:
        self.home, self.sock = home, sock

    @classmethod
    def take(cls, request: dict[str, Any], fds: list[int]) -> bool:
        """Hand `request` and `fds` to the spare (the zygote closes its copies); False when
        none waits for this home or it is gone (the caller forks the owner itself)."""
        import socket  # preloaded in a zygote; the caller's side of a launch never loads it

        spare, cls.current = cls.current, None
        if spare is None:
            return False
        try:
            if spare.home != request["home"]:
                return False
            socket.send_fds(spare.sock, [marshal.dumps(request)], fds)
        except OSError:  # it died: the request goes to a fork of its own
            return False
        finally:
            spare.sock.close()
        for fd in fds:
            os.close(fd)
        return True

    @classmethod
    def refill(cls, home: str, sockets: tuple[socket.socket, ...]) -> None:
        """Fork the next spare for `home` (after the last one was taken or ended); the child
        closes `sockets`, the zygote's own."""
        import socket

        if cls.current is not None:
            return
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError:  # no descriptor to spare: the next owner is forked on request
            return

        def become() -> int:
            ours.close()
            _detach()
            return _serve_as_spare(home, theirs)

        try:
            _STUBS.add(fork_child(become, [], sockets))
        except OSError:  # no process to spare (EAGAIN, ENOMEM): likewise
            ours.close()
            return
        finally:
            theirs.close()
        cls.current = Spare(home, ours)

    @classmethod
    def end(cls, timeout: float = 2.0) -> None:
        """Let the spare go and wait (bounded) until it has: when the zygote leaves, no spare
        of it is left behind. Its end of the pair closes only when it exits."""
        import socket

        spare, cls.current = cls.current, None
        if spare is None:
            return
        with spare.sock, contextlib.suppress(OSError):
            spare.sock.shutdown(socket.SHUT_WR)
            spare.sock.settimeout(timeout)
            spare.sock.recv(1)  # b"": the spare's end closed, at its exit


def _serve_as_spare(home: str, sock: socket.socket) -> int:
    """The spare's life: once no request came for PRIME_AFTER_S, make what its owner will
    need ahead (launch.Ahead: the pipes and the placer, which joins its cgroups meanwhile) and
    open the home's store; wait for a request, become its owner. Under a burst the next
    request is there at once, and its owner makes both after its pid, as a forked owner does:
    made first, they would stand between every queued caller and its owner's pid, and the
    placer's fork would take the CPU from the launch the zygote just served."""
    import select
    import socket

    from settled.owner.ahead import Ahead
    from settled.owner.main import run_session
    from settled.store import open_store

    store: Store | None = None
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(PRIME_AFTER_S * 1000.0):
        with contextlib.suppress(OSError):  # none: the owner makes its own once asked
            Ahead.current = Ahead()
        if _room_to_prime():
            try:
                store = open_store(home, threads=False)  # threads=False: it may yet unshare
            except Exception:  # the owner opens it again, and says what is wrong
                store = None
    try:
        message, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, 2)
    except OSError:
        message, fds = b"", []
    if not message:
        if store is not None:
            store.close()
        if Ahead.current is not None:
            Ahead.current.close()  # its placer placed nothing: it exits, its cgroups go
        return 0  # the zygote ended: nothing ran; its socket closes with this process
    sock.close()
    request: dict[str, Any] = marshal.loads(message)
    return _become_owner(request, fds, run_session, store)


def fork_child(
    become: Callable[[], int], fds: list[int], sockets: tuple[socket.socket, ...]
) -> int:
    """Fork a child that closes `sockets` (the zygote's own) and exits with `become()`; the
    zygote closes `fds`, which were the child's alone, and reaps the stubs that exited."""
    reap_stubs()
    spare = Spare.current
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sock in (*sockets, *([spare.sock] if spare is not None else [])):
                sock.close()
            code = become()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    reap_stubs()
    return pid


def reap_stubs(*, all_of_them: bool = False) -> None:
    """Reap the owners' stubs that exited (by pid: a face's workers are reaped by whoever
    forked them, verb_workers.py); `all_of_them`: wait for every one, as a zygote does before
    it ends."""
    for pid in list(_STUBS):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, 0 if all_of_them else os.WNOHANG)[0] == 0:
                continue  # still running
        _STUBS.discard(pid)


def _become_owner(
    request: dict[str, Any], fds: list[int], run: Any, store: Store | None = None
) -> int:
    """In the detached child: take the caller's environment and become the owner (with
    `store`, opened ahead by a spare for this home)."""
    os.environ.clear()
    os.environ.update(request["env"])
    faults.arm(os.environ.get("SETTLED_FAULT", ""))  # imported with the zygote's own
    os.umask(request["umask"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    ready_fd, orders_fd = fds
    code: int = run(request["home"], request["session"], ready_fd, orders_fd, store)
    return code


def launch_through(
    send: Callable[[dict[str, Any], list[int]], None], home: str, session: str, store: Store
) -> dict[str, Any]:
    """Ask a zygote (through `send`, which returns once it forked the owner) for the session's
    owner, then claim for it and hand it its orders, as for a fresh owner (handoff.py)."""
    log = os.path.join(make_session_dir(home, session), "owner.log")
    launched_at = time.time()
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    orders_r, orders_w = os.pipe2(os.O_CLOEXEC)
    umask = os.umask(0o022)
    os.umask(umask)
    request = {"home": home, "session": session, "env": dict(os.environ), "umask": umask,
               "log": log}  # fmt: skip
    try:
        try:
            send(request, [ready_w, orders_r])
        finally:
            os.close(ready_w)
            os.close(orders_r)
        try:
            prepared = prepare(store, home, session, launched_at)
        except BaseException:
            os.close(orders_w)  # the owner reads EOF: no orders, it runs nothing
            orders_w = -1
            raise
        owner_w, orders_w = orders_w, -1  # hand_over closes it
        report = hand_over(store, prepared, ReportReader(ready_r), owner_w, READY_TIMEOUT_S)
        ready_r = receipt_wake.kept_after(report, ready_r)
        return report
    finally:
        if orders_w >= 0:
            os.close(orders_w)
        if ready_r >= 0:
            os.close(ready_r)
