"""Followers woken by events: a stored byte or the owner's exit ends a follower's pause, not a
polling interval. Real owners, real commands, real inotify; no timing is asserted.

How a test shows a wake-up is an event and not a poll: it makes every pause an hour long
(`LOOK_EVERY_S`, `WAKE_BOUND_S`, or `pause(3600)`), so only an event can end it before the
test's own bounded wait (and pytest's timeout) gives up.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import COMMAND_PYTHON

from settled import relay as relay_module
from settled import sessions as sessions_module
from settled.home import session_dir
from settled.log.watch import LogWatch
from settled.records import TaskRecord
from settled.relay import Relay
from settled.runtime import Runtime, logreads
from settled.sessions import EARLY_LOOK_S, POLL_S, SessionWatch

HOUR = 3600.0
# Writes one byte, then waits for the test to create `gate` in the workspace, then one more.
GATED = (
    "import os, sys, time\n"
    "os.write(1, b'x')\n"
    "while not os.path.exists('gate'):\n"
    "    time.sleep(0.01)\n"
    "os.write(2, b'e')\n"
    "os.write(1, b'y')\n"
)


def _gated(rt: Runtime, task: TaskRecord, key: str) -> str:
    return rt.exec(task.task, argv=[COMMAND_PYTHON, "-c", GATED], key=key).session


def _open_gate(task: TaskRecord) -> None:
    Path(task.workspace, "gate").write_bytes(b"")


# -- the watch ---------------------------------------------------------------------------------


def test_a_log_watch_arms_once_its_directory_exists_and_a_write_makes_it_readable(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "sessions" / "s_1"
    watch = LogWatch(str(directory))
    try:
        assert watch.arm() == (None, False)  # not made yet: poll, and try again next time
        directory.mkdir(parents=True)
        fd, fresh = watch.arm()
        assert fd is not None and fresh
        assert watch.arm() == (fd, False)
        assert select.select([fd], [], [], 0)[0] == []
        with open(directory / "stdout.log", "ab") as log:
            log.write(b"a")
        assert select.select([fd], [], [], 30)[0] == [fd]
        watch.clear()
        assert select.select([fd], [], [], 0)[0] == []  # cleared: the next byte wakes again
        with open(directory / "stdout.log", "ab") as log:
            log.write(b"b")
        assert select.select([fd], [], [], 30)[0] == [fd]
    finally:
        watch.close()


# -- the pause ---------------------------------------------------------------------------------


def test_a_pause_of_an_hour_ends_when_the_command_stores_a_byte(
    rt: Runtime, task: TaskRecord
) -> None:
    session = _gated(rt, task, "byte")
    got = b""
    with rt.pauses(session) as pause:
        while b"x" not in got:
            got += rt.read(session, "stdout", len(got))
            if b"x" not in got:
                pause(HOUR)  # the first call arms the watch and returns: no byte is missed
        assert rt.session_status(session)["state"] != "settled"  # the command still waits
        _open_gate(task)
        while rt.final_cursor(session, "stdout") is None:
            pause(HOUR)  # a byte or the owner's exit ends it
    assert rt.read(session, "stdout") == b"xy"
    assert rt.wait(session, timeout=30)["receipt"]["exit"]["code"] == 0


def test_a_pause_of_an_hour_ends_when_the_owner_exits(rt: Runtime, task: TaskRecord) -> None:
    session = rt.exec(task.task, argv=["true"], key="quiet").session
    with rt.pauses(session) as pause:
        while rt.final_cursor(session, "stdout") is None:
            pause(HOUR)
    assert rt.wait(session, timeout=30)["receipt"]["exit"]["code"] == 0


class _Owners:
    """A liveness whose owner never exits; it records how long each pause may last."""

    def __init__(self) -> None:
        self.waits: list[tuple[float, int | None]] = []

    def exit_handle(self, owner: Any) -> int:
        return 7

    def await_exit(self, handle: int | None, seconds: float, also: int | None = None) -> bool:
        self.waits.append((seconds, also))
        return False

    def close_handle(self, handle: int) -> None:
        pass


class _Store:
    def get_session(self, session: str) -> Any:
        return SimpleNamespace(owner=SimpleNamespace(pid=1, start_time=1))


class _Wake:
    def __init__(self, answers: list[tuple[int | None, bool]]) -> None:
        self.answers = answers
        self.cleared = 0

    def arm(self) -> tuple[int | None, bool]:
        return self.answers.pop(0)

    def clear(self) -> None:
        self.cleared += 1


def test_a_young_sessions_pause_arms_no_watch_and_still_wakes_on_the_exit() -> None:
    """Closing an inotify instance can wait for an RCU grace period (8-20 ms here): a follower
    arms the log's watch only once the session outlived ARM_AFTER_S. Until then each pause
    sleeps on the owner's exit handle (the exit wakes it at once) for EARLY_LOOK_S at most."""
    owners = _Owners()
    watch = SessionWatch(_Store(), owners)  # type: ignore[arg-type]
    wake = _Wake([])  # an arm() would pop from an empty list
    with watch.pauses("s_0123456789abcdef", wake=wake) as pause:
        pause(HOUR)
        pause(HOUR)
    assert owners.waits == [(EARLY_LOOK_S, None), (EARLY_LOOK_S, None)]


def test_a_pause_looks_again_when_its_watch_starts_and_polls_when_there_is_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sessions_module, "ARM_AFTER_S", 0.0)  # past the young session's time
    owners = _Owners()
    watch = SessionWatch(_Store(), owners)  # type: ignore[arg-type]
    wake = _Wake([(5, True), (5, False), (None, False)])
    with watch.pauses("s_0123456789abcdef", wake=wake) as pause:
        pause(HOUR)  # the watch starts now: back to the caller without sleeping
        pause(HOUR)  # watched: the hour, ended by the log or the exit
        pause(HOUR)  # no watch to be had: a poll
    assert owners.waits == [(HOUR, 5), (POLL_S, None)]
    assert wake.cleared == 1


# -- the followers -----------------------------------------------------------------------------


def test_follow_yields_a_byte_while_the_command_runs_with_hour_long_pauses(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logreads, "WAKE_BOUND_S", HOUR)
    session = _gated(rt, task, "follow")
    stream = rt.follow(session, "stdout", 0, timeout=60)
    assert next(iter(stream)) == b"x"
    _open_gate(task)
    assert b"".join(stream) == b"y"


def test_a_merged_follow_yields_in_order_while_the_command_runs_with_hour_long_pauses(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logreads, "WAKE_BOUND_S", HOUR)
    session = _gated(rt, task, "merged")
    chunks = rt.follow_merged(session, 0, timeout=60)
    first = next(iter(chunks))
    assert (first.stream, first.data) == ("stdout", b"x")
    _open_gate(task)
    rest = list(chunks)
    assert sorted((c.stream, c.data) for c in rest) == [("stderr", b"e"), ("stdout", b"y")]
    final = rt.read_merged(session)  # what was served live is the settled view's prefix
    # Byte by byte: the settled view joins a stream's consecutive bytes into one chunk (the
    # index records a run per stream switch), and the owner may read `y` before `e` when both
    # wait in their pipes at one look, so live `x`, `y` are the settled `xy`.
    assert _bytewise(final) == _bytewise([first, *rest])


def _bytewise(chunks: list[Any]) -> list[tuple[str, int]]:
    return [(chunk.stream, byte) for chunk in chunks for byte in chunk.data]


class _Sink:
    def __init__(self, wanted: bytes) -> None:
        self.data = b""
        self.wanted = wanted
        self.seen = threading.Event()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        if self.wanted in self.data:
            self.seen.set()
        return len(chunk)

    def flush(self) -> None:
        pass


def test_the_relay_shows_a_byte_while_the_command_runs_with_hour_long_pauses(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_module, "LOOK_EVERY_S", HOUR)
    session = _gated(rt, task, "relay")
    sinks = {"stdout": _Sink(b"x"), "stderr": _Sink(b"e")}
    relay = Relay(session)
    short: list[dict[str, tuple[int, int]]] = []

    def relaying() -> None:  # with a Runtime of its own, as `settled run` in its process
        with Runtime(rt.home) as own:
            short.append(relay.run(own, sinks))  # type: ignore[arg-type]

    thread = threading.Thread(target=relaying)
    thread.start()
    try:
        assert sinks["stdout"].seen.wait(60), "the relay never showed the first byte"
        assert thread.is_alive()  # it shows output while the command runs
    finally:
        _open_gate(task)
        thread.join(60)
    assert not thread.is_alive() and short == [{}]
    assert (sinks["stdout"].data, sinks["stderr"].data) == (b"xy", b"e")
    assert relay.cursors == {"stdout": 2, "stderr": 1}


PROBE = (
    "import atexit, json, sys\n"
    "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
    "from settled.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_logs_follow_in_a_new_process_shows_a_byte_while_the_command_runs_and_loads_no_ctypes_util(
    rt: Runtime, task: TaskRecord
) -> None:
    session = _gated(rt, task, "cli")
    env = {**os.environ, "SETTLED_HOME": rt.home}
    cli = subprocess.Popen(
        [sys.executable, "-c", PROBE, "logs", session, "--stream", "stdout", "--follow"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert cli.stdout is not None
        assert cli.stdout.read(1) == b"x"  # while the command waits at its gate
        time.sleep(sessions_module.ARM_AFTER_S * 4)  # a follow that lasts: it arms the watch
        _open_gate(task)
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0 and out == b"y", err.decode(errors="replace")
    loaded = set(json.loads(err.decode().strip().splitlines()[-1]))
    assert "ctypes" in loaded  # it watched the log
    assert not loaded & {"ctypes.util", "inotify_simple", "subprocess"}, sorted(loaded)
    assert os.path.isdir(session_dir(rt.home, session))
