"""The processes the soak starts, armed or not, and the sweep that ends whatever is left.

Owns: running a `settled` CLI process (armed with a fault point or not), a `settled serve`
process on a free port (`Server`), whether a process died at the point it was armed with, and
`sweep`: every process that carries this run's mark (`MARK_ENV` in its environment: lanes,
servers, CLI processes, owners, zygotes, the journal, and every command, which gets the mark in
its explicit environment) is ended, SIGTERM first.

Must never: touch a process without this run's mark, or wait without a bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

MARK_ENV = "SETTLED_SOAK_MARK"
KEY_ENV = "SOAK_KEY"  # in a command's own environment: its logical key, to find what survives
TOKEN_ENV = "SETTLED_TOKEN"
CLI = [sys.executable, "-m", "settled.cli"]
CLI_TIMEOUT_S = 120.0
SERVER_START_S = 60.0
PR_SET_PDEATHSIG = 1


def fault_env(point: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SETTLED_FAULT", None)
    if point is not None:
        env["SETTLED_FAULT"] = f"{point}:crash"
    return env


def crashed_at(returncode: int | None, stderr: bytes, point: str) -> bool:
    """Whether the process died of the SIGKILL the fault point sends, saying it was there."""
    said = f"crash at fault point {point}".encode()
    return returncode == -signal.SIGKILL and said in stderr


def cli(home: str, *args: str, point: str | None = None) -> subprocess.CompletedProcess[bytes]:
    """`settled ARGS` on the soak's home, armed to crash at `point` if given."""
    env = {**fault_env(point), "SETTLED_HOME": home}
    return subprocess.run(
        [*CLI, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=CLI_TIMEOUT_S,
    )


class Server:
    """`settled serve --port 0` on the soak's home, its stderr in a file (uvicorn logs every
    request there; a pipe nobody reads would stop it). `url` once it listens."""

    def __init__(self, home: str, token: str, log: str, point: str | None = None) -> None:
        self.log, self.point = log, point
        env = {**fault_env(point), "SETTLED_HOME": home, TOKEN_ENV: token}
        with open(log, "wb") as sink:
            self.process = subprocess.Popen(
                [*CLI, "serve", "--port", "0"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
                preexec_fn=_ends_with_parent,
            )
        self.url = self._listening(home)

    def said(self) -> bytes:
        with open(self.log, "rb") as handle:
            return handle.read()

    def _listening(self, home: str) -> str:
        give_up = time.monotonic() + SERVER_START_S
        pause = 0.005
        while time.monotonic() < give_up:
            for line in self.said().splitlines():
                if b"listening on http://" in line:
                    return line.split(b"listening on ")[1].split()[0].decode()
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"settled serve exited {self.process.returncode}: {self.said()[-2000:]!r}"
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)
        self.stop()
        raise RuntimeError(f"settled serve did not listen within {SERVER_START_S:.0f} s")

    def crashed(self) -> bool:
        """Whether it died at its fault point (waits for it to end, bounded)."""
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return False
        return self.point is not None and crashed_at(code, self.said(), self.point)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)


def _ends_with_parent() -> None:
    """In the server's child before exec: SIGTERM it if its starter dies, even by SIGKILL
    (PR_SET_PDEATHSIG), so a soak killed outright leaves no server serving its home."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def marked(mark: str) -> list[int]:
    """Pids of every process whose environment carries `MARK_ENV=mark` (not this one)."""
    return carrying(MARK_ENV, mark)


def carrying(name: str, value: str) -> list[int]:
    """Pids of every process (but this one) whose environment has `name=value`; a zombie's
    environment is empty, so a dead process waiting to be reaped is not among them."""
    needle = f"\0{name}={value}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = b"\0" + handle.read() + b"\0"
        except OSError:
            continue  # gone meanwhile
        if needle in environ:
            found.append(int(entry))
    return found


def sweep(mark: str, grace_s: float = 5.0) -> dict[str, list[int]]:
    """End every marked process: SIGTERM, up to `grace_s` to exit, then SIGKILL. Returns
    the pids that ended on TERM and those that needed KILL."""
    termed = _signal_all(marked(mark), signal.SIGTERM)
    give_up = time.monotonic() + grace_s
    while (left := [p for p in marked(mark) if _alive(p)]) and time.monotonic() < give_up:
        time.sleep(0.05)
    killed = _signal_all(left, signal.SIGKILL)
    give_up = time.monotonic() + grace_s
    while [p for p in marked(mark) if _alive(p)] and time.monotonic() < give_up:
        time.sleep(0.05)
    return {"terminated": sorted(set(termed) - set(killed)), "killed": killed}


def _signal_all(pids: list[int], signum: int) -> list[int]:
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent.append(pid)
        except ProcessLookupError:
            pass
    return sent


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for its parent (PID 1 reaps late)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
