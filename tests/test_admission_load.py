"""Admission under a retry storm: duplicates of one key in one process, a caller killed between
its admission and the claim, and a burst of callers at the home's launcher.

Real Runtimes, real owners and real processes; a caller killed between the admission and the
claim is a real SIGKILL of a real process.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from settled.owner import home_launcher, launcher
from settled.records import TaskRecord
from settled.runtime import Runtime

CALLER = textwrap.dedent(
    """
    import os, signal, sys
    from settled.runtime import Runtime

    home, task, key = sys.argv[1:4]
    rt = Runtime(home)
    def killed(self, session):  # the caller dies after the admission, before any claim
        os.kill(os.getpid(), signal.SIGKILL)
    Runtime._launch = killed
    rt.exec(task, shell="echo ran >> launched", key=key)
    """
)


def test_a_caller_killed_between_admission_and_claim_ran_nothing(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL after the admission's commit, before the claim: the admission is there for every
    other process (committed and fsynced), no owner was claimed and nothing ran; a retry gets
    that same session, never a second one, and recovery settles it once its launcher is
    overdue."""
    done = subprocess.run(
        [sys.executable, "-c", CALLER, rt.home, task.task, "k1"],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    with Runtime(rt.home) as other:
        found = other.store.find_session(task.task, "k1")
        assert found is not None and found.state == "admitted" and found.owner is None
    retry = rt.exec(task.task, shell="echo ran >> launched", key="k1")
    assert retry.reused and retry.session == found.session
    assert not Path(task.workspace, "launched").exists()
    monkeypatch.setattr(launcher, "READY_TIMEOUT_S", 0.0)  # its launcher is long dead
    rt.recover(task.task)
    settled = rt.store.get_session(found.session)
    assert settled.state == "settled" and settled.receipt is not None
    assert not Path(task.workspace, "launched").exists()


def test_duplicates_in_one_process_launch_once(rt: Runtime, task: TaskRecord) -> None:
    """Duplicates of one key fired together from threads of one process, each with its own
    Runtime: one admits and launches, the others wait for its answer and reuse its session;
    the command ran once."""
    threads = 8
    barrier = threading.Barrier(threads)
    answers: list[Any] = [None] * threads

    def admit(i: int) -> None:
        with Runtime(rt.home) as mine:
            barrier.wait(10)
            try:
                answers[i] = mine.exec(task.task, shell="echo $$ >> launched", key="dup")
            except BaseException as exc:  # reported by the assertion below
                answers[i] = exc

    pool = [threading.Thread(target=admit, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(60)
    assert all(not isinstance(a, BaseException) and a is not None for a in answers), answers
    assert len({a.session for a in answers}) == 1
    assert sorted(a.reused for a in answers) == [False] + [True] * (threads - 1)
    view = rt.wait(answers[0].session, timeout=30)
    assert view["receipt"]["exit"]["code"] == 0
    assert len(Path(task.workspace, "launched").read_text().splitlines()) == 1


def test_a_caller_waits_for_room_in_the_home_launchers_backlog(tmp_path: Path) -> None:
    """A burst of callers fills the home zygote's listen backlog: the next one waits in its
    connect until the zygote accepts, and gets its answer, instead of failing with EAGAIN."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp_path / home_launcher.SOCKET_NAME))
    listener.listen(0)  # room for one pending connection
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    filler.connect(str(tmp_path / home_launcher.SOCKET_NAME))  # the backlog is now full
    answer: list[object] = []

    def ask() -> None:
        try:
            answer.append(home_launcher._ask(str(tmp_path), {"op": "probe"}, []))
        except OSError as exc:
            answer.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    asker.join(0.2)  # it is waiting in connect, not failed
    assert not answer, answer
    with listener, filler:
        listener.settimeout(10)
        listener.accept()[0].close()  # the filler's connection (first come): room for one
        conn, _ = listener.accept()  # the asker's, once its connect went through
        with conn:
            conn.settimeout(10)
            assert b"probe" in conn.recv(1 << 16)
            conn.send(b"ok\n")
        asker.join(10)
    assert answer == [b"ok\n"]
