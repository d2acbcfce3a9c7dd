"""The placer: the child an owner forks ahead of its orders, so that its command starts inside
the session's v1 cgroups without a migration on the launch path.

Why: moving a process into a cgroup waits for an RCU grace period (~8 ms here when no
migration happened lately; back to back ~0.2 ms), and clone3's CLONE_INTO_CGROUP places only in
cgroup v2, while a v1 cgroup is inherited from the process that clones. So the owner forks this
small child while it is still single-threaded, before its orders arrive (while its launcher
claims, or while a zygote's spare waits for a request): the placer makes the owner's v1 cgroups
(`settled/owner-<pid>-<start>`, limits.py) and joins them, paying the grace period there. At
launch the owner hands it what the command's first process needs (argv, env, cwd, the plan, its
boundary, the limits) with the descriptors (stdio, the error and status pipes, the gate) over a
socketpair (marshal + SCM_RIGHTS). The placer writes the limits, clones the init (or the
command) with clone3(CLONE_PARENT | CLONE_NEWPID | CLONE_INTO_CGROUP=<session v2 cgroup>), so
the child is the owner's (its waitpid and pidfd work there) and sits in the session's v2 cgroup
and the placer's v1 ones, sends back its pidfd and exits. The owner reaps it and only then opens
the gate the child waits on before the command starts (a zombie placer still counts in the
session's pids.max). So the owner is never the clone3 caller: it starts its threads before its
command, and no thread or process after (owner/launch.py).

The fork path (SETTLED_SPAWN=fork, a kernel without clone3) has no placer: the owner makes the
v1 cgroups and the forked child joins them itself, paying the migration on the launch path.

Must never: hold a descriptor of the owner's but its socket before its launch, outlive its
owner (PR_SET_PDEATHSIG), or start the command when its placement or limits failed (it replies
`limits:errno:why`, and the session is never started). Imported on the owner's launch path:
os, sys, marshal and the builtin `_socket` only.
"""

from __future__ import annotations

import marshal
import os
import sys

from settled import faults
from settled.boundary import limits, linux, procfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.boundary.base import Boundary
    from settled.boundary.spawn import Launch

_socket = sys.modules.get("_socket") or __import__("_socket")

SIGKILL = 9
_MAX_FDS = 8
_INT = 4  # bytes of one descriptor in SCM_RIGHTS
GATE_OPEN = b"g"
_MAX_FD = (1 << 31) - 1


def _fd_bytes(fds: list[int]) -> bytes:
    return b"".join(fd.to_bytes(_INT, sys.byteorder, signed=True) for fd in fds)


def _send(sock: Any, payload: bytes, fds: list[int]) -> None:
    data = len(payload).to_bytes(8, "little") + payload
    ancillary = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _fd_bytes(fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def _receive(sock: Any) -> tuple[bytes, list[int]]:
    """One message and its descriptors (close-on-exec); (b"", []) at EOF."""
    data, ancillary, _flags, _addr = sock.recvmsg(
        1 << 16, _socket.CMSG_SPACE(_INT * _MAX_FDS), _socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, raw in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(raw) - len(raw) % _INT
            fds += [
                int.from_bytes(raw[i : i + _INT], sys.byteorder, signed=True)
                for i in range(0, usable, _INT)
            ]
    if len(data) < 8:
        for fd in fds:
            os.close(fd)
        return b"", []
    size = int.from_bytes(data[:8], "little")
    chunks = [data[8:]]
    have = len(chunks[0])
    while have < size:
        more = sock.recv(min(1 << 20, size - have))
        if not more:
            break
        chunks.append(more)
        have += len(more)
    return b"".join(chunks), fds


class Placer:
    """The owner's side: the placer process, its socket, the limits it is to write."""

    current: Placer | None = None  # forked by a zygote's spare: the spare's owner adopts it

    def __init__(self, pid: int, sock: Any) -> None:
        self.pid, self.sock = pid, sock
        self.status: int | None = None
        self.limits: dict[str, Any] = {}  # by limit name, from the orders, before `place`
        self.made: dict[str, str] = {}  # {controller: v1 cgroup}, as the placer said it

    @classmethod
    def fork(cls) -> Placer:
        """Fork the placer of this process, which must be single-threaded (an owner before its
        orders, a spare before its request). OSError when no process can be forked."""
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        owner = os.getpid()
        try:
            pid = os.fork()
        except BaseException:
            ours.close()
            theirs.close()
            raise
        if pid == 0:  # pragma: no cover - the placer's life, in the child
            code = 1
            try:
                ours.close()
                _serve(theirs, owner)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours)

    @staticmethod
    def paths() -> dict[str, str]:
        """{controller: path} of the v1 cgroups the placer of this process makes."""
        return limits.v1_paths(limits.owner_dir(os.getpid(), procfs.start_time(os.getpid())))

    def place(
        self, boundary: Boundary, launch: Launch, errpipe_w: int, status_w: int
    ) -> tuple[int, int]:
        """Have the placer start `boundary`'s child for `launch`: (pid, pidfd) of that child,
        which is this process's. The placer is reaped, then the gate opened. Raises SpawnFailed
        (stage `limits` for the placement, `boundary` for the clone)."""
        from settled.boundary.spawn import SpawnFailed

        given = {
            "kind": boundary.kind,
            "task": boundary.task,
            "session": boundary.session,
            "hierarchy": boundary.hierarchy,
            "cgroup": boundary.birth_cgroup(),
            "argv": list(launch.argv),
            "cwd": launch.cwd,
            "env": dict(launch.env),
            "plan": launch.isolation.fields(),
            "limits": self.limits,
            "umask": _umask(),  # the owner's now (a spare's placer was forked before its own)
        }
        gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
        io = launch.io
        fds = [io.stdin, io.stdout, io.stderr, errpipe_w, gate_r]
        if status_w >= 0:
            fds.append(status_w)
        try:
            try:
                _send(self.sock, marshal.dumps(given), fds)
                reply, got = _receive(self.sock)
            except OSError as exc:
                why = f"limits:{exc.errno or 5}:the placer is gone ({exc})"
                reply, got = marshal.dumps({"error": why}), []
            finally:
                os.close(gate_r)
            self.close()  # reaped: its zombie no longer counts in pids.max
            answer: dict[str, Any] = marshal.loads(reply) if reply else {}
            self.made = answer.get("paths") or {}
            if answer.get("pid") is None or not got:
                for fd in got:
                    os.close(fd)
                text = answer.get("error") or (
                    f"limits:5:the placer ended before it placed the command ({self.status})"
                )
                stage, err, detail = text.split(":", 2)
                raise SpawnFailed(stage, int(err), detail)
            os.write(gate_w, GATE_OPEN)
            return int(answer["pid"]), got[0]
        finally:
            os.close(gate_w)

    def close(self) -> None:
        """End the placer (EOF on its socket: it exits) and reap it. Its cgroups stay for the
        owner to read and remove (`remove`)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.status is None:
            while True:
                try:
                    self.status = os.waitpid(self.pid, 0)[1]
                    break
                except InterruptedError:
                    continue
                except ChildProcessError:
                    self.status = -1
                    break

    def remove(self) -> list[str]:
        """After close: remove the cgroups it made (empty once the session's processes are
        dead); those that would not go are returned."""
        self.close()
        return limits.remove(list((self.made or self.paths()).values()), kill=True)


def _name_self(name: bytes) -> None:
    try:
        with open("/proc/self/comm", "wb") as handle:
            handle.write(name)
    except OSError:
        pass


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _serve(sock: Any, owner: int) -> None:
    """The placer's life: join, wait for the launch, place, reply. Returns only to exit."""
    from settled.boundary.spawn import reset_child_signals

    reset_child_signals()  # no handler, mask or wake-up descriptor of the owner's
    _name_self(b"settled-placer")  # what ps shows (a copy of its owner's command line)
    linux.prctl(linux.PR_SET_PDEATHSIG, SIGKILL)
    if os.getppid() != owner:  # it died before the line above: nothing to place for
        return
    keep = sock.fileno()
    os.closerange(3, keep)  # nothing of the owner's but its socket (and stdio: the owner log)
    os.closerange(keep + 1, _MAX_FD)
    failure: str | None = None
    paths = limits.v1_paths(limits.owner_dir(owner, procfs.start_time(owner)))
    try:
        limits.make(paths, limits.defaults()["ceiling"])
        limits.join(list(paths.values()))
    except OSError as exc:
        failure = f"limits:{exc.errno or 5}:placing the command in {exc.filename or paths}: {exc}"
    faults.point("placer.after_join")
    from settled import boundary as boundaries

    boundaries.preload()  # what the child runs, loaded while the launch is awaited
    message, fds = _receive(sock)
    if not message:
        return  # no launch: the owner ran nothing
    if failure is None:
        given: dict[str, Any] = marshal.loads(message)
        failure = _place(sock, given, fds, paths)
    for fd in fds:
        os.close(fd)
    if failure is not None:
        _send(sock, marshal.dumps({"error": failure, "paths": paths}), [])


def _place(sock: Any, given: dict[str, Any], fds: list[int], paths: dict[str, str]) -> str | None:
    """Write the limits, clone the child, send back its pid and pidfd; or why it failed."""
    from settled import boundary as boundaries
    from settled.boundary.isolation import IsolationPlan
    from settled.boundary.spawn import ChildIO, Launch, fork_into

    try:
        faults.point("placer.limits_write")
        limits.write_all(paths, "v1", given["limits"])
    except OSError as exc:
        return f"limits:{exc.errno or 5}:writing the limits: {exc}"
    os.umask(given["umask"])
    plan = IsolationPlan(**given["plan"])
    made = boundaries.make(given["kind"], given["task"], given["session"], plan, given["hierarchy"])
    stdin, stdout, stderr, errpipe, gate = fds[:5]
    status = fds[5] if len(fds) > 5 else -1
    launch = Launch(given["argv"], given["cwd"], given["env"], ChildIO(stdin, stdout, stderr), plan)
    launch.gate = gate
    cgroup = given["cgroup"]
    try:
        pid, pidfd, placed = fork_into(cgroup, made.kind in boundaries.PID_NAMESPACE_KINDS,
                                       parent=True)  # fmt: skip
    except OSError as exc:
        where = f"clone3 into {cgroup}" if cgroup is not None else "clone3"
        return f"boundary:{exc.errno or 5}:{where}: {exc.strerror}"
    if pid == 0:  # pragma: no cover - the owner's child now: init, or the command
        made.run_child(launch, errpipe, status, placed)
    try:
        _send(sock, marshal.dumps({"pid": pid, "paths": paths}), [pidfd])
    finally:
        os.close(pidfd)
    return None
