"""The home's warm launcher: one zygote per home that forks the owners of every CLI call, and
that leaves when idle, when stopped, when another settled asks, and never serves another uid."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import test_cli
from test_cli import CLI
from test_launcher import _alive, _forks_of, _gone_within, _within

from settled import where
from settled.owner import home_launcher
from settled.owner.home_launcher import LOCK_NAME, SOCKET_NAME

cli = test_cli.cli  # the fixtures, shared
task = test_cli.task


def _zygote_pid(run: Path) -> int:
    return int((run / LOCK_NAME).read_text())


def _zygote_after_a_call(cli: CLI, task: dict[str, Any]) -> tuple[Path, int]:
    """The home's run directory and the pid of the zygote one `settled run` started there."""
    run = cli.home / "run"
    assert cli.run("run", "--task", task["task"], "--", "true").returncode == 0
    return run, _zygote_pid(run)


def test_cli_calls_of_one_home_share_its_zygote_and_each_owner_outlives_it(
    cli: CLI, task: dict[str, Any]
) -> None:
    run = cli.home / "run"
    first = cli.run("run", "--task", task["task"], "--", "sh", "-c", "echo one")
    assert first.returncode == 0 and first.stdout == b"one\n", first.stderr
    zygote = _zygote_pid(run)
    assert _alive(zygote)
    second = cli.json("exec", "--task", task["task"], "--", "sleep 0.5; echo two")
    assert _zygote_pid(run) == zygote  # the same zygote forked the second owner
    assert home_launcher.stop(str(run))  # the zygote leaves; the owner it forked does not
    assert _gone_within(zygote, 5)
    receipt = cli.json("wait", second["session"])
    assert receipt["exit"]["code"] == 0
    assert cli.run("logs", second["session"]).stdout == b"two\n"


def test_a_killed_zygote_is_replaced_by_the_next_call(cli: CLI, task: dict[str, Any]) -> None:
    run, old = _zygote_after_a_call(cli, task)
    os.kill(old, signal.SIGKILL)
    assert _gone_within(old, 5)  # its socket stays behind, unanswered
    again = cli.run("run", "--task", task["task"], "--", "sh", "-c", "echo again")
    assert again.returncode == 0 and again.stdout == b"again\n", again.stderr
    assert _zygote_pid(run) != old and _alive(_zygote_pid(run))


def test_the_cli_can_still_start_a_fresh_owner(cli: CLI, task: dict[str, Any]) -> None:
    done = cli.run("run", "--task", task["task"], "--", "true", env={"SETTLED_LAUNCHER": "fresh"})
    assert done.returncode == 0, done.stderr
    assert not (cli.home / "run" / SOCKET_NAME).exists()


def test_the_zygote_leaves_when_idle(tmp_path: Path) -> None:
    run = tmp_path / "run"
    home_launcher.start(str(run), idle_s=0.3)
    zygote = _zygote_pid(run)
    assert _alive(zygote)
    assert _gone_within(zygote, 10)
    assert not (run / SOCKET_NAME).exists()


def test_a_caller_of_another_settled_makes_it_leave_without_a_fork(tmp_path: Path) -> None:
    run = tmp_path / "run"
    home_launcher.start(str(run))
    zygote = _zygote_pid(run)
    ready_r, ready_w = os.pipe()
    try:
        answer = home_launcher._ask(str(run), {"identity": "0.0 /elsewhere 1"}, [ready_w])
    finally:
        os.close(ready_w)
    assert answer == b"stop\n"
    assert _gone_within(zygote, 5)
    assert os.read(ready_r, 16) == b""  # the pipe it was handed was closed, never used
    os.close(ready_r)


def test_two_callers_racing_to_start_get_one_zygote(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = "import sys; from settled.owner import home_launcher as h; h.start(sys.argv[1])"
    racers = [subprocess.Popen([sys.executable, "-c", script, str(run)]) for _ in range(4)]
    for racer in racers:
        assert racer.wait(60) == 0
    zygote = _zygote_pid(run)
    zygotes = [pid for pid in _pids_with(b"settled.owner.home_launcher:main") if pid != zygote]
    assert zygotes == [] and _alive(zygote)
    assert home_launcher.stop(str(run))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_another_uid_gets_no_answer_and_no_owner() -> None:
    top = Path(tempfile.mkdtemp(prefix="settled-uid-"))  # pytest's tmp_path is 0700 above it
    try:
        _another_uid_is_refused(top / "run")
    finally:
        shutil.rmtree(top)


def _another_uid_is_refused(run: Path) -> None:
    home_launcher.start(str(run))
    zygote = _zygote_pid(run)
    probe = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.settimeout(5)\n"
        "try:\n    s.connect(sys.argv[1])\n"
        "except PermissionError:\n    print('refused'); sys.exit()\n"
        "try:\n    s.send(b'{\"op\": \"stop\"}'); print('answer', s.recv(16))\n"
        "except (BrokenPipeError, ConnectionResetError):\n    print('reset')\n"
    )
    sock = str(run / SOCKET_NAME)
    denied = subprocess.run([sys.executable, "-c", probe, sock], capture_output=True, timeout=30)
    assert denied.stdout == b"refused\n", denied.stderr  # the run directory keeps it out
    os.chmod(run.parent, 0o755)
    os.chmod(run, 0o755)
    os.chmod(sock, 0o666)  # opened up on purpose: the zygote itself must still refuse
    refused = subprocess.run([sys.executable, "-c", probe, sock], capture_output=True, timeout=30)
    assert refused.stdout in (b"answer b''\n", b"reset\n"), refused.stderr  # closed without a word
    assert _alive(zygote)  # and its "stop" was not obeyed
    assert home_launcher.stop(str(run))


def _pids_with(needle: bytes) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if needle in handle.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_the_run_directory_is_private(tmp_path: Path) -> None:
    run = tmp_path / "run"
    home_launcher.start(str(run))
    try:
        assert run.stat().st_mode & 0o777 == 0o700
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(run / SOCKET_NAME))  # its owner may
    finally:
        assert home_launcher.stop(str(run))


def test_an_edit_of_the_installed_settled_replaces_the_zygote(
    cli: CLI, task: dict[str, Any]
) -> None:
    run, old = _zygote_after_a_call(cli, task)
    module = Path(home_launcher.__file__).with_name("forking.py")
    before = module.stat()
    try:
        newest = where.newest_change(str(module.parent.parent))
        os.utime(module, ns=(before.st_atime_ns, newest + 10**9))  # the newest edit now
        again = cli.run("run", "--task", task["task"], "--", "sh", "-c", "echo new")
    finally:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert again.returncode == 0 and again.stdout == b"new\n", again.stderr
    assert _gone_within(old, 30), _state(old)  # it left rather than fork old code
    assert _zygote_pid(run) != old


def _state(pid: int) -> str:
    """What a process that should have left is doing, for the failure's message."""
    with (
        contextlib.suppress(OSError),
        open(f"/proc/{pid}/stat") as stat,
        open(f"/proc/{pid}/wchan") as wchan,
    ):
        return f"{stat.read()} wchan={wchan.read()}"
    return "gone"


def test_the_home_zygote_keeps_a_spare_owner_that_leaves_with_it(
    cli: CLI, task: dict[str, Any]
) -> None:
    run, zygote = _zygote_after_a_call(cli, task)
    line = Path(f"/proc/{zygote}/cmdline").read_bytes()  # its forks', once it is gone too
    # the spare, once `true`'s owner left
    assert _within(lambda: len(_forks_of(zygote)) == 1, 10), _forks_of(zygote)
    (spare,) = _forks_of(zygote)
    again = cli.json("exec", "--task", task["task"], "--", "echo again")
    receipt = cli.json("wait", again["session"])
    assert receipt["exit"]["code"] == 0 and receipt["owner"]["pid"] == spare  # no fork waited
    assert cli.run("logs", again["session"]).stdout == b"again\n"
    assert home_launcher.stop(str(run))
    assert _gone_within(zygote, 5)
    assert _forks_of(zygote, line) == []  # the zygote waited for its spare to leave
