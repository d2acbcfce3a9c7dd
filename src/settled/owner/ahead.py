"""What an owner makes before its orders: the output pipes, /dev/null, its OOM protection, and
its placer, forked first thing (or by a zygote's spare before its request), while this process
is single-threaded.

The placer (boundary/placer.py) then joins the session's v1 cgroups and loads what its clone
runs (the init, the view, the pod's joins), on the other CPU, while the owner loads its own
launch path and reads its orders. Forked before those imports, it is a copy of a small process
(a fork of the loaded owner cost ~1.2 ms on the launch path); the owner never loads the
clone's modules at all.

Must never: fork the placer from a process that runs another thread.
"""

from __future__ import annotations

import os

from settled import oomguard
from settled.boundary import linux, spawn
from settled.boundary.placer import Placer

PIPE_SIZE = 1 << 20  # each output pipe: what the command may write before the drain starts


def placeable() -> bool:
    """Whether the command will be started through a placer: where clone3 (with
    CLONE_INTO_CGROUP) is there and not refused by SETTLED_SPAWN=fork. Probed once per
    process, with spawn's own answer: the probe is a clone3 that the kernel refuses only
    after copying most of this process (~0.5 ms here)."""
    return spawn.clone3_missing() is None


class Ahead:
    """What the launch needs that its orders do not decide, made while the launcher claims (or
    by a zygote's spare before its request: `current`): the output pipes, /dev/null for a
    command without stdin, libc, the clone3 probe, this owner's OOM protection, and the
    placer, forked while this process is single-threaded, with the command's ends of those
    pipes, so that it joins the session's v1 cgroups meanwhile (boundary/placer.py)."""

    current: Ahead | None = None  # a spare's, made before its request

    def __init__(self) -> None:
        self.pipes = output_pipes()
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        linux.capget()  # loads libc before any clone: the child only calls
        self.placer: Placer | None = None
        self.placer_failed: str | None = None  # why there is none where clone3 would need one
        if placeable():
            stdio = {"stdin": self.devnull, "stdout": self.pipes["stdout_w"],
                     "stderr": self.pipes["stderr_w"]}  # fmt: skip
            try:
                self.placer = Placer.fork(stdio)
            except OSError as exc:  # EAGAIN, ENOMEM: the session is refused, at launch
                self.placer_failed = f"could not fork the placer: {exc}"
        self.oom = oomguard.protect_self()

    @classmethod
    def take(cls) -> Ahead:
        """The spare's, made ahead, else one made now."""
        ahead, cls.current = cls.current, None
        return ahead if ahead is not None else cls()

    def close(self) -> None:
        for fd in (*self.pipes.values(), self.devnull):
            if fd >= 0:
                os.close(fd)
        self.pipes, self.devnull = {}, -1
        if self.placer is not None:  # never placed anything: it exits; its cgroups go
            placer, self.placer = self.placer, None
            placer.remove()


def output_pipes() -> dict[str, int]:
    """stdout and stderr pipes, each enlarged so the command can write while the owner is
    still loading its drain: {name: read end, name_w: write end}."""
    fds: dict[str, int] = {}
    for name in ("stdout", "stderr"):
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            linux.fcntl(read_end, linux.F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:  # above /proc/sys/fs/pipe-max-size for this user: keep the default
            pass
        fds[name], fds[f"{name}_w"] = read_end, write_end
    return fds
