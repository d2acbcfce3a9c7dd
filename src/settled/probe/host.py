"""What the probe reads of this machine: marked processes, a pid's identity, the machine's facts.

Owns the marker every command of a probe carries in its environment
(`PROBE_MARK=<token>:<question>`) and the `/proc` scans that find what a command left running,
so an answer can say "the descendant was alive after the call" from the kernel's own table,
whatever the runtime under test reported.
Must never: signal a process that does not carry this run's marker, or one whose identity (start
time, boot id) is not the one it was asked about: a pid can be reused.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import signal
import sys
import time
from dataclasses import dataclass

MARK_ENV = "PROBE_MARK"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class Proc:
    """A live process of this machine: its pid and command line, as `ps` would show them."""

    pid: int
    cmdline: str

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "cmdline": self.cmdline}


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:  # gone meanwhile, or a kernel thread
        return None


def start_time(pid: int) -> int | None:
    """The pid's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if
    no such process runs, or it is a zombie (it can no longer execute anything)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # the name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` runs (not a zombie), and is the process that started at `started`."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def boot_id() -> str:
    return (_read(BOOT_ID) or b"").decode().strip()


def cmdline(pid: int) -> str:
    raw = _read(f"/proc/{pid}/cmdline") or b""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def machine() -> dict[str, object]:
    """Where the probe ran: enough for a reader to know what the numbers were measured on."""
    uname = os.uname()
    return {
        "host": uname.nodename,
        "os": f"{uname.sysname} {uname.release}",
        "arch": uname.machine,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "executable": sys.executable,
    }


class Sweep:
    """This run's marker and the processes that carry it. Every command a probe starts gets
    `env()`; `left(question)` lists what of that question still runs; `end()` kills whatever
    of this run still runs and says which, so nothing outlives the probe unreported."""

    def __init__(self) -> None:
        self.token = f"settled-probe-{os.getpid()}-{secrets.token_hex(4)}"

    def mark(self, question: str) -> str:
        return f"{self.token}:{question}"

    def env(self, question: str) -> dict[str, str]:
        return {MARK_ENV: self.mark(question)}

    def left(self, question: str | None = None) -> list[Proc]:
        """Live processes (zombies excluded) whose environment carries the marker of
        `question` (None: of any question of this run)."""
        needle = f"{MARK_ENV}={self.mark(question) if question else self.token}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            environ = _read(f"/proc/{entry}/environ")
            if environ is None or not _carries(environ, needle, question is None):
                continue
            if start_time(int(entry)) is not None:
                found.append(Proc(int(entry), cmdline(int(entry))))
        return found

    def end(self, question: str | None = None, timeout: float = 10.0) -> list[Proc]:
        """SIGKILL every live process carrying the marker (of `question`, else of the run)
        until none is left or `timeout` passes; returns what was killed."""
        killed: dict[int, Proc] = {}
        give_up = time.monotonic() + timeout
        while (procs := self.left(question)) and time.monotonic() < give_up:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.setdefault(proc.pid, proc)
            time.sleep(0.02)
        return list(killed.values())


def await_running(sweep: Sweep, question: str, cmdline: str, timeout: float) -> bool:
    """Until a process of `question` runs `cmdline` (the command is mid-run); whether one did
    within `timeout`."""
    give_up = time.monotonic() + timeout
    while not any(proc.cmdline == cmdline for proc in sweep.left(question)):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.01)
    return True


def _carries(environ: bytes, needle: bytes, prefix: bool) -> bool:
    """Whether one variable of the NUL-separated environment is the marker: exactly (one
    question's), or starting with it (any question of the run)."""
    for variable in environ.split(b"\0"):
        if variable == needle or (prefix and variable.startswith(needle + b":")):
            return True
    return False


def kill_if(pid: int, started: int | None) -> bool:
    """SIGKILL `pid` only while it is the process that started at `started`; whether sent."""
    if not alive(pid, started):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        return True
    return False


def wait_gone(pid: int, started: int | None, timeout: float) -> bool:
    """Poll until the process is gone (or a zombie); whether it went within `timeout`."""
    give_up = time.monotonic() + timeout
    while alive(pid, started):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.01)
    return True
