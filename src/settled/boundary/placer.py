"""The placer: the child an owner forks ahead of its orders, so that its command starts inside
the session's v1 cgroups without a migration on the launch path, and so that the owner itself
never calls clone3 (it may then start its threads first: owner/launch.py).

Why: moving a process into a cgroup can wait for an RCU grace period (~8 ms when no migration
happened lately), and clone3's CLONE_INTO_CGROUP places only in cgroup v2, while a v1 cgroup is
inherited from the process that clones. So the owner forks this child while it is still
single-threaded, before its orders (while its launcher claims, or while a zygote's spare waits
for a request). The placer makes the owner's v1 cgroups (`settled/owner-<pid>-<start>`,
limits.py) and joins them, through `tasks`, paying any wait there. It inherits at its fork the
descriptors the command's first process needs (the output pipes' write ends, /dev/null, and its
own error, status and gate pipes), so nothing crosses a socket. The owner sends it the launch
(marshal, over a pipe) as soon as it has its orders and its boundary: the child's kind, the
plan, argv, env, cwd, the stored stdin, the limits, the umask. The placer writes the limits and
clones the init (or the command) with clone3(CLONE_PARENT | CLONE_NEWPID | CLONE_INTO_CGROUP=
<session v2 cgroup>), so the child is the owner's (its waitpid and pidfd work there) and sits in
the session's v2 cgroup and the placer's v1 ones; the child builds its view and waits at its
gate, while the owner reserves its logs and starts its threads. The placer lets go of the
child's descriptors (the owner's read of the error pipe ends with the child's exec alone),
leaves the session's pids cgroup (it would count in pids.max until reaped), replies with the
pid and exits. The owner opens the gate once its threads run (`start`: nothing between its
orders and its command but a write) and reaps the placer once its command runs; an owner that
starts nothing closes the gate, and the child exits without its command (`remove`).

The fork path (SETTLED_SPAWN=fork, a kernel without clone3) has no placer: the owner makes the
v1 cgroups and the forked child joins them itself, paying the migration on the launch path.

Must never: keep a descriptor of the owner's but its own, outlive its owner (PR_SET_PDEATHSIG),
or start the command when its placement or limits failed (it replies why, stage `limits`, and
the session is never started). Imported on the owner's launch path: os, sys and marshal only.
"""

from __future__ import annotations

import marshal
import os
import sys

from settled import faults
from settled.boundary import linux, procfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.boundary.spawn import Launch

_signal = sys.modules.get("_signal") or __import__("_signal")  # the builtin; see spawn.py
SIGKILL = 9
GATE_OPEN = b"g"
_MAX_FD = (1 << 31) - 1
_ENDED = "limits:5:the placer ended before it placed the command"


def _send(fd: int, value: Any) -> None:
    data = marshal.dumps(value)
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, have = [], 0
    while have < size:
        chunk = os.read(fd, min(size - have, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def _receive(fd: int) -> Any:
    """One message, or None at EOF (the other side closed or died)."""
    head = _read_exactly(fd, 8)
    body = _read_exactly(fd, int.from_bytes(head, "little")) if head is not None else None
    return None if body is None else marshal.loads(body)


class Placer:
    """The owner's side: the placer process and the pipes between them."""

    def __init__(self, pid: int, fds: dict[str, int]) -> None:
        # to_placer, from_placer; the child's errpipe_r and status_r; gate_w, its gate
        self.pid, self.fds = pid, fds
        self.status: int | None = None
        self.made: dict[str, str] = {}  # {controller: v1 cgroup}, as the placer said
        self.child: int | None = None  # the child it cloned, this process's, until started
        self.answer: dict[str, Any] | None = None

    @classmethod
    def fork(cls, stdio: dict[str, int]) -> Placer:
        """Fork the placer of this process, which must be single-threaded (an owner before its
        orders, a spare before its request). `stdio`: {"stdin", "stdout", "stderr"}, the
        command's ends, which it inherits. OSError when no process can be forked."""
        made: list[int] = []
        try:
            for _ in range(5):  # to the placer, from it, the error, status and gate pipes
                made += os.pipe2(os.O_CLOEXEC)
            to_r, to_w, from_r, from_w, err_r, err_w, status_r, status_w, gate_r, gate_w = made
            owner = os.getpid()
            pid = os.fork()
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        if pid == 0:  # pragma: no cover - the placer's life, in the child
            code = 1
            try:
                os.close(gate_w)  # the owner's alone: its close is the child's EOF
                child = {"messages": to_r, "replies": from_w, "errpipe": err_w,
                         "status": status_w, "gate": gate_r, **stdio}  # fmt: skip
                _serve(owner, child)
                code = 0
            finally:
                os._exit(code)
        for fd in (to_r, from_w, err_w, status_w, gate_r):
            os.close(fd)
        ours = {"to_placer": to_w, "from_placer": from_r, "errpipe_r": err_r,
                "status_r": status_r, "gate_w": gate_w}  # fmt: skip
        return cls(pid, ours)

    def prepare(
        self,
        child: dict[str, bool],
        cgroup: str | None,
        given: dict[str, Any],
        plan: dict[str, Any],
    ) -> None:
        """Send the launch as soon as the orders are in: the placer writes the limits and
        clones the child, which builds its view and waits at its gate while this owner
        makes its boundary, reserves its logs and starts its threads. `child` and `cgroup`:
        boundary.placement's answer for the orders; `given`: the orders; `plan`: the plan's
        fields. A placer that is gone is found out at `start`."""
        prepared = {
            "child": child,
            "cgroup": cgroup,
            "argv": list(given["argv"]),
            "cwd": given["cwd"],
            "env": dict(given["env"]),
            "stdin": given["stdin"],
            "plan": plan,
            "limits": dict(given.get("limits") or {}),
            "umask": _umask(),  # the owner's now (a spare's placer was forked before its own)
        }
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            _send(self.fds["to_placer"], prepared)
        except OSError:
            pass

    def _answer(self) -> dict[str, Any]:
        """The placer's one reply (read once): the child's pid, or why there is none."""
        if self.answer is None:
            self._close("to_placer")  # it reads nothing more: EOF ends one never prepared
            try:
                got = _receive(self.fds["from_placer"])
            except OSError as exc:
                got = {"error": f"limits:{exc.errno or 5}:the placer is gone ({exc})"}
            self.answer = got or {"error": _ENDED}
            self.made = self.answer.get("paths") or self.made
            self.child = self.answer.get("pid")
        return self.answer

    def start(self) -> tuple[int, int, int]:
        """Let the prepared child start its command: (its pid, errpipe_r, status_r); read the
        error pipe to its end next (the exec, or the child's failure). The placer left the
        session's pids cgroup before it replied, so the gate opens on a count of the session's
        own. SpawnFailed when there is no child (stage `limits` for the placement, `boundary`
        for the clone). A child that failed while building its view (stage `isolation`) may
        have closed its gate before the owner opens it: its report is on the error pipe."""
        from settled.boundary.spawn import SpawnFailed

        answer = self._answer()
        if self.child is None:
            stage, err, detail = str(answer["error"]).split(":", 2)
            raise SpawnFailed(stage, int(err), detail)
        pid, self.child = self.child, None
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            os.write(self.fds["gate_w"], GATE_OPEN)
        except BrokenPipeError:
            pass  # the child ended before its gate (its view was refused): its error pipe says why
        self._close("gate_w")
        return pid, self.fds.pop("errpipe_r"), self.fds.pop("status_r")

    def _close(self, name: str) -> None:
        fd = self.fds.pop(name, -1)
        if fd >= 0:
            os.close(fd)

    def close(self, *, wait: bool = True) -> None:
        """Reap the placer (it exits once it replied, or at EOF if never prepared); without
        `wait`, only if it has exited already (its exit unmaps a copy of this process: not
        on the launch path). Its cgroups stay for the owner to read and remove."""
        self._close("to_placer")
        self._close("from_placer")
        while self.status is None:
            try:
                pid, status = os.waitpid(self.pid, 0 if wait else os.WNOHANG)
            except InterruptedError:
                continue
            except ChildProcessError:
                pid, status = self.pid, -1
            if pid == 0:
                return  # still exiting: reaped by a later close
            self.status = status

    def remove(self, timeout: float = 10.0) -> list[str]:
        """Nothing is started: a child cloned meanwhile finds its gate closed (EOF), exits
        without its command and is reaped (killed if it has not ended within `timeout`); the
        placer is reaped and the cgroups it made removed. Those that would not go are
        returned."""
        self._close("gate_w")
        self._answer()
        if self.child is not None:
            _end(self.child, timeout)
            self.child = None
        self.close()
        for name in list(self.fds):
            self._close(name)
        from settled.boundary import limits

        return limits.remove(list((self.made or self.paths()).values()), kill=True)

    @staticmethod
    def paths() -> dict[str, str]:
        """{controller: path} of the v1 cgroups the placer of this process makes."""
        from settled.boundary import limits

        return limits.v1_paths(limits.owner_dir(os.getpid(), procfs.start_time(os.getpid())))


def _end(pid: int, timeout: float) -> None:
    """Reap this process's child `pid`, which is on its way out; SIGKILL it past `timeout`."""
    import select

    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        poller = select.poll()  # not select: a descriptor past FD_SETSIZE is legal here
        poller.register(handle, select.POLLIN)
        if not poller.poll(timeout * 1000):
            os.kill(pid, SIGKILL)
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    finally:
        os.close(handle)


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _name_self(name: bytes) -> None:
    try:
        with open("/proc/self/comm", "wb") as handle:
            handle.write(name)
    except OSError:
        pass


def _serve(owner: int, fds: dict[str, int]) -> None:
    """The placer's life: join, take the prepared launch, place it, reply. Returns to exit.
    The joins come first, before any import (spawn, the boundary kinds: loaded after)."""
    _signal.set_wakeup_fd(-1)  # a signal never writes into a descriptor of the owner's
    linux.prctl(linux.PR_SET_PDEATHSIG, SIGKILL)
    if os.getppid() != owner:  # it died before the line above: nothing to place for
        return
    low = 3
    for keep in sorted(fds.values()):  # nothing of the owner's but what was made for it
        os.closerange(low, keep)
        low = keep + 1
    os.closerange(low, _MAX_FD)
    from settled.boundary import limits  # here, not in the owner: its command needs it later

    paths = limits.v1_paths(limits.owner_dir(owner, procfs.start_time(owner)))
    failure: str | None = None
    try:
        limits.make(paths)
        limits.join(list(paths.values()))
    except OSError as exc:
        failure = f"limits:{exc.errno or 5}:placing the command in {exc.filename or paths}: {exc}"
    from settled.boundary.spawn import reset_child_signals

    reset_child_signals()  # no handler or mask of the owner's
    _name_self(b"settled-placer")  # what ps shows (a copy of its owner's command line)
    _load_the_childs_code()
    faults.point("placer.after_join")
    prepared = _receive(fds["messages"])
    if prepared is None:
        return  # no launch: the owner ran nothing
    pid = None
    if failure is None:
        try:
            launch = _ready(prepared, paths, fds)
        except OSError as exc:
            failure = f"limits:{exc.errno or 5}:readying the launch: {exc}"
        else:
            pid, failure = _clone(prepared["child"], launch, prepared["cgroup"], fds)
    for name in ("errpipe", "status", "gate", "stdin", "stdout", "stderr"):
        os.close(fds[name])  # the owner's read of the error pipe ends with the child's exec
    if pid is not None:
        _leave(paths.get("pids"))  # before the reply: the owner opens the gate on it
    reply = {"error": failure} if failure is not None else {"pid": pid}
    _send(fds["replies"], {**reply, "paths": paths})


def _leave(pids: str | None) -> None:
    """Out of the session's pids cgroup, into the ceiling above it, before the gate opens:
    the child's command then has the whole pids.max (this process still exists until its
    owner reaps it). Through `tasks`, as the join: this thread alone, without the global
    lock."""
    if pids is not None:  # the ceiling's: settled/ above the session's
        with open(os.path.join(os.path.dirname(pids), "tasks"), "w") as handle:
            handle.write("0")


def _ready(prepared: dict[str, Any], paths: dict[str, str], fds: dict[str, int]) -> Launch:
    """Write the limits and build the launch the child will need (every module it takes was
    loaded by the owner before the fork, but limits: nothing is imported twice)."""
    from settled.boundary import limits
    from settled.boundary.isolation import IsolationPlan
    from settled.boundary.spawn import ChildIO, Launch

    try:
        faults.point("placer.limits_write")
        limits.write_all(paths, "v1", prepared["limits"])
    except OSError as exc:
        raise OSError(exc.errno, f"writing the limits: {exc.strerror}", exc.filename) from None
    os.umask(prepared["umask"])
    plan = IsolationPlan(**prepared["plan"])
    if prepared["stdin"]:
        from settled.boundary.spawn import sealed_stdin

        os.close(fds["stdin"])
        fds["stdin"] = sealed_stdin(prepared["stdin"])
    stdin = fds["stdin"]
    io = ChildIO(stdin, fds["stdout"], fds["stderr"])
    launch = Launch(prepared["argv"], prepared["cwd"], prepared["env"], io, plan)
    launch.gate = fds["gate"]
    return launch


def _load_the_childs_code() -> None:
    """What its clone runs (the PID namespace's init, the view, the pod's joins, the
    privileges): loaded here while the owner loads its own launch path, on the other CPU, so
    that neither the owner nor the clone imports them on the launch's path. A fresh owner forks
    its placer before its own imports (owner/main.py), so this is most of what the placer
    does; a spare's was forked from a zygote that has them all."""
    import settled.boundary.mountview
    import settled.boundary.pidns
    import settled.boundary.podns
    import settled.boundary.privileges
    import settled.boundary.viewplan  # noqa: F401 - the view's rules, read by mountview


def _clone(
    child: dict[str, bool], launch: Launch, cgroup: str | None, fds: dict[str, int]
) -> tuple[int | None, str | None]:
    """Clone the child as the owner's: (its pid, None), or (None, why it could not). `child`:
    the boundary's placed_child(), what the clone does."""
    from settled.boundary.spawn import child_prepare, exec_in_child, fork_into

    try:
        pid, pidfd, _placed = fork_into(cgroup, child["init"], parent=True)
    except OSError as exc:
        where = f"clone3 into {cgroup}" if cgroup is not None else "clone3"
        return None, f"boundary:{exc.errno or 5}:{where}: {exc.strerror}"
    if pid == 0:  # pragma: no cover - the owner's child now: init, or the command
        setpgid = child["setpgid"]
        first = child_prepare(lambda _placed: os.setpgid(0, 0) if setpgid else None, launch, True)
        if child["init"]:
            from settled.boundary.pidns import run_init

            run_init(launch, fds["errpipe"], fds["status"], first)
        exec_in_child(launch, fds["errpipe"], first)
    os.close(pidfd)
    return pid, None
