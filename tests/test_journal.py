"""The mutation journal: inotify as a hint that is never silently wrong.

Real inotify on tmp_path. The in-process `Journal` is pumped only by the test, so the test decides
what is queued when; the daemon tests go through the Unix socket like a session owner would, each
request naming its task (one daemon per run directory watches every task). Every daemon a test
starts is stopped by the `daemons` finalizer and verified gone (its pidfd reports the exit); any
journal process still serving a test's run directory fails the test.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import journal_pids

from settled.owner.launcher import owner_path
from settled.workspace.journal import daemon
from settled.workspace.journal import wire as wire_module
from settled.workspace.journal.daemon import serve
from settled.workspace.journal.errors import JournalUnavailable
from settled.workspace.journal.inotify import Journal, Watcher
from settled.workspace.journal.lifecycle import ensure_running, ensure_watching, stop
from settled.workspace.journal.wire import Watermark, ping, release
from settled.workspace.journal.wire import barrier as task_barrier
from settled.workspace.journal.wire import reset as task_reset

TASK = "t_test"


def barrier(socket_path: str, task: str = TASK, timeout: float = 2.0) -> Watermark | None:
    return task_barrier(socket_path, task, timeout)


def reset(socket_path: str, seq: int, task: str = TASK) -> Watermark | None:
    return task_reset(socket_path, task, seq)


def _exited(pidfd: int, timeout: float) -> bool:
    readable, _, _ = select.select([pidfd], [], [], timeout)
    return bool(readable)


class Daemons:
    def __init__(self) -> None:
        self.pidfds: dict[int, tuple[str, int]] = {}  # pid -> (socket, pidfd)
        self.run_dirs: list[Path] = []

    def start(self, root: Path, run_dir: Path, task: str = TASK, **options: Any) -> str:
        socket_path = ensure_watching(task, str(root), str(run_dir), **options)
        self.adopt(socket_path, run_dir)
        return socket_path

    def adopt(self, socket_path: str, run_dir: Path) -> int:
        if run_dir not in self.run_dirs:
            self.run_dirs.append(run_dir)
        info = ping(socket_path)
        assert info is not None, f"no journal answers on {socket_path}"
        pid = int(info["pid"])
        if pid not in self.pidfds:
            self.pidfds[pid] = (socket_path, os.pidfd_open(pid))
        return pid

    def pidfd(self, pid: int) -> int:
        return self.pidfds[pid][1]

    def finish(self) -> None:
        survivors = []
        for pid, (socket_path, pidfd) in self.pidfds.items():
            with contextlib.suppress(JournalUnavailable):
                stop(socket_path)
            if not _exited(pidfd, 5.0):
                survivors.append(pid)
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                _exited(pidfd, 5.0)
            os.close(pidfd)
        strays = []  # e.g. a journal that refused to start: it must be on its way out
        for pid in set().union(*(journal_pids(run_dir) for run_dir in self.run_dirs)):
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(pid)
                if not _exited(pidfd, 5.0):
                    strays.append(pid)
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
        assert not survivors, f"journals {survivors} survived stop"
        assert not strays, f"journal processes {sorted(strays)} were never accounted for"


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    tracker = Daemons()
    try:
        yield tracker
    finally:
        tracker.finish()


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def journal(ws: Path) -> Iterator[Journal]:
    with Journal(str(ws)) as core:
        yield core


def _settle(journal: Journal) -> Watermark:
    """A barrier whose changes the consumer has checkpointed."""
    mark = journal.barrier()
    journal.reset_dirty(mark.seq)
    return mark


def _sh(script: str, cwd: Path) -> None:
    subprocess.run(["sh", "-c", script], cwd=cwd, check=True)


# -- the in-process core ------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_write_is_counted_by_the_next_barrier(journal: Journal, ws: Path) -> None:
    before = journal.barrier()
    (ws / "f").write_text("x")
    created = journal.barrier()
    assert created.seq > before.seq and created.dirty_dirs == {"."} and created.trustworthy
    journal.reset_dirty(created.seq)
    with open(ws / "f", "a") as handle:
        handle.write("more")
    appended = journal.barrier()
    assert appended.seq > created.seq and appended.dirty_dirs == {"."}


@pytest.mark.timeout(10)
def test_a_file_in_a_brand_new_directory_is_counted_though_made_before_its_watch(
    journal: Journal, ws: Path
) -> None:
    before = _settle(journal)
    _sh("mkdir -p a/b && echo x > a/b/f", ws)  # all of it before the journal reads any event
    after = journal.barrier()
    assert after.seq > before.seq and {"a", "a/b"} <= after.dirty_dirs
    journal.reset_dirty(after.seq)
    (ws / "a" / "b" / "g").write_text("y")
    assert journal.barrier().dirty_dirs == {"a/b"}  # and the new directory is now watched


@pytest.mark.timeout(10)
def test_renames_of_files_in_and_out_are_counted(
    journal: Journal, ws: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "in.txt").write_text("x")
    base = _settle(journal)
    os.rename(outside / "in.txt", ws / "in.txt")
    moved_in = journal.barrier()
    assert moved_in.seq > base.seq and moved_in.dirty_dirs == {"."}
    journal.reset_dirty(moved_in.seq)
    os.rename(ws / "in.txt", outside / "out.txt")
    moved_out = journal.barrier()
    assert moved_out.seq > moved_in.seq and moved_out.dirty_dirs == {"."}


@pytest.mark.timeout(10)
def test_a_directory_moved_in_is_watched_and_one_moved_out_is_not(
    journal: Journal, ws: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "x").write_text("x")
    (ws / "e").mkdir()
    _settle(journal)
    os.rename(outside / "d", ws / "d")
    moved_in = _settle(journal)
    assert {".", "d"} <= moved_in.dirty_dirs
    (ws / "d" / "y").write_text("y")
    assert journal.barrier().dirty_dirs == {"d"}
    os.rename(ws / "e", outside / "e")
    moved_out = _settle(journal)
    (outside / "e" / "z").write_text("z")  # no longer part of the workspace
    after = journal.barrier()
    assert after.seq == moved_out.seq and after.dirty_dirs == frozenset() and after.trustworthy


@pytest.mark.timeout(10)
def test_a_directory_renamed_inside_the_workspace_reports_its_new_path(
    journal: Journal, ws: Path
) -> None:
    (ws / "p" / "sub").mkdir(parents=True)
    _settle(journal)
    os.rename(ws / "p", ws / "q")
    (ws / "q" / "sub" / "f").write_text("x")  # queued before the journal saw the rename
    after = journal.barrier()
    assert "q/sub" in after.dirty_dirs and "p/sub" not in after.dirty_dirs
    journal.reset_dirty(after.seq)
    (ws / "q" / "sub" / "g").write_text("y")
    assert journal.barrier().dirty_dirs == {"q/sub"}


@pytest.mark.timeout(10)
def test_deletes_are_counted(journal: Journal, ws: Path) -> None:
    (ws / "d").mkdir()
    (ws / "d" / "f").write_text("x")
    (ws / "g").write_text("y")
    base = _settle(journal)
    (ws / "d" / "f").unlink()
    file_gone = _settle(journal)
    assert file_gone.seq > base.seq and file_gone.dirty_dirs == {"d"}
    (ws / "d").rmdir()
    (ws / "g").unlink()
    dir_gone = journal.barrier()
    assert dir_gone.seq > file_gone.seq and "." in dir_gone.dirty_dirs and dir_gone.trustworthy
    journal.reset_dirty(dir_gone.seq)
    (ws / "d").mkdir()  # the same name again gets a fresh watch
    (ws / "d" / "h").write_text("z")
    assert "d" in journal.barrier().dirty_dirs


@pytest.mark.timeout(10)
def test_a_symlink_is_not_followed(ws: Path, tmp_path: Path) -> None:
    target = tmp_path / "outside" / "target"
    target.mkdir(parents=True)
    os.symlink(target, ws / "early")  # present when the journal starts
    with Journal(str(ws)) as journal:
        base = journal.barrier()
        os.symlink(target, ws / "late")  # made while it runs
        made = _settle(journal)
        assert made.seq > base.seq and made.dirty_dirs == {"."}
        (ws / "early" / "a").write_text("x")  # these land outside the workspace
        (ws / "late" / "b").write_text("y")
        after = journal.barrier()
        assert after.seq == made.seq and after.dirty_dirs == frozenset()
        assert after.trustworthy and after.lost_watches == frozenset()


@pytest.mark.timeout(10)
def test_no_watch_is_placed_through_a_symlinked_parent(
    journal: Journal, ws: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    (outside / "b").mkdir(parents=True)
    os.symlink(outside, ws / "a")  # a directory swapped for a symlink while the journal walks
    base = _settle(journal)
    journal._walk("a/b", count=True)  # as if an event had named a directory below it
    (outside / "b" / "f").write_text("x")
    after = journal.barrier()
    assert after.seq == base.seq and after.dirty_dirs == frozenset() and after.trustworthy


def _flood(ws: Path) -> None:
    """Queue more events than max_queued_events, whatever it is: writes alternate between two
    files, so no event is identical to the queue's tail and none coalesce (1 syscall each)."""
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if limit > 5_000_000:
        pytest.skip(f"max_queued_events is {limit}: too many events to overflow it quickly")
    fds = [os.open(ws / name, os.O_WRONLY | os.O_CREAT, 0o644) for name in ("ping", "pong")]
    try:
        for index in range(limit + 5000):
            os.pwrite(fds[index % 2], b"x", 0)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.timeout(60)
def test_an_overflow_is_never_silent(journal: Journal, ws: Path) -> None:
    before = _settle(journal)
    _flood(ws)  # the journal reads nothing meanwhile
    flooded = journal.barrier()
    assert flooded.seq > before.seq
    assert flooded.overflowed and not flooded.trustworthy
    assert any("IN_Q_OVERFLOW" in reason for reason in flooded.reasons)
    journal.reset_dirty(flooded.seq)  # the consumer did a full scan
    recovered = journal.barrier()
    assert not recovered.overflowed and recovered.trustworthy


@pytest.mark.timeout(60)
def test_directories_created_while_events_were_dropped_get_watched(
    journal: Journal, ws: Path
) -> None:
    _flood(ws)
    (ws / "late" / "deep").mkdir(parents=True)  # its events are dropped: the queue is full
    flooded = journal.barrier()
    assert flooded.overflowed
    journal.reset_dirty(flooded.seq)
    (ws / "late" / "deep" / "x").write_text("x")
    after = journal.barrier()
    assert after.dirty_dirs == {"late/deep"} and after.trustworthy


class _RefusingInotify:
    """Fault injection: add_watch fails with ENOSPC (max_user_watches) for one directory name."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner, self.name, self.refuse = inner, name, True

    def add_watch(self, path: str, mask: int) -> int:
        target = os.readlink(path) if path.startswith("/proc/self/fd/") else path
        if self.refuse and os.path.basename(target) == self.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return int(self.inner.add_watch(path, mask))

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.inner, attribute)


@pytest.mark.timeout(10)
def test_a_watch_that_could_not_be_added_is_visible_until_it_exists(
    journal: Journal, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = _RefusingInotify(journal._watcher._ino, "blocked")
    monkeypatch.setattr(journal._watcher, "_ino", refusing)
    (ws / "blocked").mkdir()
    lost = journal.barrier()
    assert lost.lost_watches == {"blocked"} and not lost.trustworthy
    assert any("max_user_watches" in reason for reason in lost.reasons)
    journal.reset_dirty(lost.seq)  # retried at each checkpoint, still refused
    assert not journal.barrier().trustworthy
    refusing.refuse = False
    journal.reset_dirty(journal.barrier().seq)
    watched = journal.barrier()
    assert watched.trustworthy and watched.lost_watches == frozenset()
    assert "blocked" in watched.dirty_dirs  # what it holds is rescanned, as for a new directory
    journal.reset_dirty(watched.seq)
    (ws / "blocked" / "f").write_text("x")
    assert journal.barrier().dirty_dirs == {"blocked"}


@pytest.mark.timeout(10)
def test_reset_dirty_forgets_only_what_the_checkpoint_covers(journal: Journal, ws: Path) -> None:
    (ws / "a").mkdir()
    (ws / "b").mkdir()
    _settle(journal)
    (ws / "a" / "f").write_text("x")
    checkpointed = journal.barrier()
    (ws / "b" / "g").write_text("y")  # after the checkpoint's barrier
    journal.reset_dirty(checkpointed.seq)
    assert journal.barrier().dirty_dirs == {"b"}


# -- the daemon -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_through_the_daemon_a_write_is_counted_by_the_next_barrier(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    before = barrier(socket_path)
    assert before is not None and before.trustworthy
    (ws / "f").write_text("x")
    after = barrier(socket_path)
    assert after is not None and after.seq > before.seq and after.dirty_dirs == {"."}
    cleared = reset(socket_path, after.seq)
    assert cleared is not None and cleared.dirty_dirs == frozenset()


@pytest.mark.timeout(30)
def test_writers_that_exit_at_once_are_caught(daemons: Daemons, ws: Path, run: Path) -> None:
    socket_path = daemons.start(ws, run)
    previous = barrier(socket_path)
    assert previous is not None
    for index in range(40):
        _sh(f"printf {index} >> f{index % 3}", ws)  # the writer is gone before the barrier
        mark = barrier(socket_path)
        assert mark is not None and mark.seq > previous.seq, f"write {index} was not counted"
        previous = mark


@pytest.mark.timeout(60)
def test_through_the_daemon_a_file_in_a_brand_new_directory_is_counted(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    for index in range(30):  # races the journal's new watch against the writer, repeatedly
        before = barrier(socket_path)
        assert before is not None
        _sh(f"mkdir -p d{index}/b && echo x > d{index}/b/f", ws)
        after = barrier(socket_path)
        assert after is not None and after.seq > before.seq
        assert f"d{index}/b" in after.dirty_dirs, f"round {index}: {sorted(after.dirty_dirs)}"
        assert reset(socket_path, after.seq) is not None


@pytest.mark.timeout(30)
def test_a_restarted_daemon_continues_the_sequence_and_reports_the_gap(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    (ws / "f").write_text("x")
    first = barrier(socket_path)
    assert first is not None and first.trustworthy
    stop(socket_path)
    assert barrier(socket_path) is None
    (ws / "g").write_text("made while no journal ran")
    socket_path = daemons.start(ws, run)
    second = barrier(socket_path)
    assert second is not None and second.seq > first.seq
    assert not second.trustworthy and any("restarted" in reason for reason in second.reasons)
    after_scan = reset(socket_path, second.seq)
    assert after_scan is not None and after_scan.trustworthy


@pytest.mark.timeout(30)
def test_a_killed_daemon_never_reuses_a_sequence_number(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    pid = daemons.adopt(socket_path, run)
    for index in range(50):
        (ws / f"f{index}").write_text("x")
    first = barrier(socket_path)
    assert first is not None
    os.kill(pid, signal.SIGKILL)  # no chance to persist its last seq
    assert _exited(daemons.pidfd(pid), 5.0)
    socket_path = daemons.start(ws, run)
    second = barrier(socket_path)
    assert second is not None and second.seq > first.seq and not second.trustworthy


@pytest.mark.timeout(30)
def test_every_seq_a_client_sees_is_persisted_first(
    ws: Path, run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon, "RESERVE", 3)  # re-reserve every few events
    run.mkdir()
    socket_path, state = str(run / "journal.sock"), run / "journal" / f"{TASK}.state"
    server = threading.Thread(target=serve, args=(str(run), 30.0))
    server.start()
    try:
        give_up = time.monotonic() + 5
        while ping(socket_path) is None:
            assert time.monotonic() < give_up, "the in-process journal did not answer"
            time.sleep(0.01)
        assert ensure_watching(TASK, str(ws), str(run)) == socket_path
        for index in range(20):
            (ws / f"f{index}").write_text("x")
            mark = barrier(socket_path)
            assert mark is not None
            assert json.loads(state.read_text())["seq"] >= mark.seq  # a crash restarts above it
    finally:
        stop(socket_path)
        server.join(10)
    assert not server.is_alive()


_RACER = """
import json, os, sys, time
from settled.workspace.journal.wire import ping
from settled.workspace.journal.lifecycle import ensure_watching
open(sys.argv[4], "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.0005)
socket_path = ensure_watching("t_race", sys.argv[1], sys.argv[2])
print(json.dumps({"socket": socket_path, "pid": ping(socket_path)["pid"]}))
"""


@pytest.mark.timeout(60)
def test_concurrent_ensure_running_calls_start_one_daemon(
    daemons: Daemons, ws: Path, run: Path, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{index}" for index in range(4)]
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(ws), str(run), str(go), str(flag)],
            stdout=subprocess.PIPE,
        )
        for flag in ready
    ]
    try:
        while not all(flag.exists() for flag in ready):
            time.sleep(0.005)
        go.touch()
        answers = [json.loads(racer.communicate(timeout=30)[0]) for racer in racers]
    finally:
        for racer in racers:
            racer.kill()
            racer.wait()
    for answer in answers:
        daemons.adopt(answer["socket"], run)
    assert len({answer["pid"] for answer in answers}) == 1
    assert journal_pids(run) == {answers[0]["pid"]}
    log = (run / "journal.log").read_text()
    assert log.count(" serving on ") == 1 and "another journal holds" not in log  # one spawned
    assert log.count(" watching ") == 1  # and the task was walked once


@pytest.mark.timeout(30)
def test_a_second_journal_for_the_same_run_dir_exits_at_once(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    assert serve(str(run), idle_exit_s=30) == 0  # it found the lock held
    assert ping(socket_path) is not None  # the first one still serves


@pytest.mark.timeout(30)
def test_barrier_on_a_dead_journal_returns_none(daemons: Daemons, ws: Path, run: Path) -> None:
    assert barrier(str(run / "journal.sock")) is None  # never started
    socket_path = daemons.start(ws, run)
    pid = daemons.adopt(socket_path, run)
    os.kill(pid, signal.SIGKILL)
    assert _exited(daemons.pidfd(pid), 5.0)
    assert os.path.exists(socket_path)  # stale socket file: nobody listens
    started = time.monotonic()
    assert barrier(socket_path) is None
    assert time.monotonic() - started < 0.5


@pytest.mark.timeout(30)
def test_barrier_on_a_hung_journal_returns_none_within_its_timeout(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    pid = daemons.adopt(socket_path, run)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert barrier(socket_path, timeout=0.3) is None
        assert time.monotonic() - started < 1.0
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(30)
def test_sigterm_stops_a_journal_cleanly_with_its_last_seq_persisted(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    pid = daemons.adopt(socket_path, run)
    (ws / "f").write_text("x")
    mark = barrier(socket_path)
    assert mark is not None
    os.kill(pid, signal.SIGTERM)
    assert _exited(daemons.pidfd(pid), 5.0)
    state = json.loads((run / "journal" / f"{TASK}.state").read_text())
    assert state["clean"] is True and state["seq"] >= mark.seq
    assert not os.path.exists(socket_path) and "signal SIGTERM" in (run / "journal.log").read_text()


@pytest.mark.timeout(30)
def test_a_release_persists_its_last_seq_before_the_next_request_is_served(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    """The clean state of a release is written after its reply (a close does not wait for
    its fsyncs), but before the journal reads another request: the next watch of the task
    continues above the released seq, as if the write had come first."""
    socket_path = daemons.start(ws, run)
    (ws / "f").write_text("x")
    mark = barrier(socket_path)
    assert mark is not None
    assert release(socket_path, TASK)
    assert ping(socket_path) is not None  # served after the release's deferred write
    state = json.loads((run / "journal" / f"{TASK}.state").read_text())
    assert state["clean"] is True and state["seq"] >= mark.seq
    daemons.start(ws, run)  # watched again: continues above the released seq, and says so
    again = barrier(socket_path)
    assert again is not None and again.seq > state["seq"]
    assert any(f"after seq {state['seq']}:" in reason for reason in again.reasons)


@pytest.mark.timeout(30)
def test_a_journal_with_no_task_exits_by_itself(daemons: Daemons, run: Path) -> None:
    socket_path = ensure_running(str(run), idle_exit_s=0.5)
    pid = daemons.adopt(socket_path, run)
    assert _exited(daemons.pidfd(pid), 10.0)
    assert ping(socket_path) is None and not os.path.exists(socket_path)
    assert "idle for 0.5 s with no task" in (run / "journal.log").read_text()


@pytest.mark.timeout(30)
def test_a_watched_task_keeps_the_journal_running_until_it_is_released(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run, idle_exit_s=0.3)
    pid = daemons.adopt(socket_path, run)
    assert not _exited(daemons.pidfd(pid), 1.5)  # five idle periods, no client, no event
    assert barrier(socket_path) is not None
    assert release(socket_path, TASK)
    assert barrier(socket_path) is None  # released: no longer watched
    assert _exited(daemons.pidfd(pid), 10.0)  # no task left: it leaves


@pytest.mark.timeout(30)
def test_ensure_watching_fails_clearly_when_the_workspace_is_missing(
    daemons: Daemons, tmp_path: Path, run: Path
) -> None:
    daemons.run_dirs.append(run)
    missing = tmp_path / "missing"
    try:
        with pytest.raises(JournalUnavailable, match="not a directory"):
            ensure_watching(TASK, str(missing), str(run))
    finally:
        if ping(str(run / "journal.sock")) is not None:
            daemons.adopt(str(run / "journal.sock"), run)
    assert not (run / "journal" / f"{TASK}.state").exists()


@pytest.mark.timeout(30)
def test_a_task_watched_at_one_workspace_is_refused_another(
    daemons: Daemons, ws: Path, run: Path, tmp_path: Path
) -> None:
    socket_path = daemons.start(ws, run)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(JournalUnavailable, match="is watched at"):
        ensure_watching(TASK, str(other), str(run))
    assert ensure_watching("t_other", str(other), str(run)) == socket_path  # another task may


@pytest.mark.timeout(30)
def test_a_run_dir_longer_than_a_socket_address_works(
    daemons: Daemons, ws: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / ("r" * 60) / ("u" * 60)
    socket_path = daemons.start(ws, run_dir)
    assert len(os.fsencode(socket_path)) > 108
    (ws / "f").write_text("x")
    mark = barrier(socket_path)
    assert mark is not None and mark.dirty_dirs == {"."}


@pytest.mark.timeout(30)
def test_a_session_owner_can_ask_for_a_barrier_with_only_its_own_path(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    probe = (
        "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
        "from settled.workspace.journal.wire import barrier; "
        "mark = barrier(sys.argv[2], sys.argv[3]); "
        "assert 'inotify_simple' not in sys.modules; print(json.dumps(mark.to_json()))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe, json.dumps(owner_path()), socket_path, TASK],
        capture_output=True,
        check=True,
        timeout=20,
    )
    assert json.loads(done.stdout)["trustworthy"] is True


def _imports(source: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in `source`; a relative import names itself."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.partition(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            relative = "." * node.level + (node.module or "")
            found.append((node.lineno, relative if node.level else relative.partition(".")[0]))
    return found


def test_the_wire_module_imports_only_the_standard_library() -> None:
    source = Path(wire_module.__file__ or "")
    foreign = [
        f"{source.name}:{line} imports {module}"
        for line, module in _imports(source)
        if module not in sys.stdlib_module_names
    ]
    assert not foreign, f"a session owner started with -I -S cannot import: {foreign}"


def test_the_journal_package_itself_imports_nothing() -> None:
    package = Path(wire_module.__file__ or "").with_name("__init__.py")
    assert _imports(package) == []


@pytest.mark.timeout(30)
def test_importing_the_wire_module_loads_no_other_settled_module() -> None:
    probe = (
        "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
        "import settled.workspace.journal.wire; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('settled'))))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe, json.dumps(owner_path())],
        capture_output=True,
        check=True,
        timeout=20,
    )
    assert json.loads(done.stdout) == [
        "settled",
        "settled.workspace",
        "settled.workspace.journal",
        "settled.workspace.journal.wire",
    ]


# -- one daemon, many tasks ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_one_daemon_watches_every_task_and_keeps_them_apart(
    daemons: Daemons, tmp_path: Path, run: Path
) -> None:
    roots = [tmp_path / f"ws{index}" for index in range(5)]
    for root in roots:
        root.mkdir()
    sockets = {daemons.start(root, run, task=f"t_{index}") for index, root in enumerate(roots)}
    assert len(sockets) == 1 and len(journal_pids(run)) == 1  # one process for all of them
    socket_path = sockets.pop()
    info = ping(socket_path)
    assert info is not None and info["tasks"] == 5
    before = {index: barrier(socket_path, f"t_{index}") for index in range(5)}
    (roots[2] / "sub").mkdir()
    (roots[2] / "sub" / "f").write_text("x")
    for index in range(5):
        mark, old = barrier(socket_path, f"t_{index}"), before[index]
        assert mark is not None and old is not None and mark.trustworthy
        if index == 2:
            assert mark.seq > old.seq and {".", "sub"} <= mark.dirty_dirs
        else:
            assert mark.seq == old.seq and mark.dirty_dirs == frozenset()


@pytest.mark.timeout(60)
def test_tasks_that_share_a_directory_share_its_watch_until_both_release_it(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    inner = ws / "inner"
    inner.mkdir()
    socket_path = daemons.start(ws, run, task="t_outer")
    daemons.start(inner, run, task="t_inner")  # the same directory, one watch descriptor
    assert release(socket_path, "t_inner")
    outer = barrier(socket_path, "t_outer")
    assert outer is not None
    (inner / "f").write_text("x")  # the outer task must still see it
    after = barrier(socket_path, "t_outer")
    assert after is not None and after.seq > outer.seq and after.dirty_dirs == {"inner"}
    assert after.trustworthy
    assert barrier(socket_path, "t_inner") is None


@pytest.mark.timeout(30)
def test_a_released_task_watched_again_continues_its_sequence_and_reports_the_gap(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    socket_path = daemons.start(ws, run)
    (ws / "f").write_text("x")
    first = barrier(socket_path)
    assert first is not None and release(socket_path, TASK)
    (ws / "g").write_text("made while nobody watched")
    daemons.start(ws, run)
    again = barrier(socket_path)
    assert again is not None and again.seq > first.seq and not again.trustworthy
    assert any("restarted" in reason for reason in again.reasons)


@pytest.mark.timeout(30)
def test_a_forgotten_task_leaves_no_state(daemons: Daemons, ws: Path, run: Path) -> None:
    socket_path = daemons.start(ws, run)
    state = run / "journal" / f"{TASK}.state"
    assert state.exists()
    assert release(socket_path, TASK, forget=True)
    assert not state.exists() and barrier(socket_path) is None
    daemons.start(ws, run)  # a new start: nothing to continue, nothing untrusted
    fresh = barrier(socket_path)
    assert fresh is not None and fresh.trustworthy


@pytest.mark.timeout(30)
def test_requests_that_name_no_valid_task_are_refused(
    daemons: Daemons, ws: Path, run: Path
) -> None:
    from settled.workspace.journal.wire import request

    socket_path = daemons.start(ws, run)
    for task in ("../escape", "", ".hidden", "a/b", "x" * 200, 7):
        reply = request(socket_path, {"op": "barrier", "task": task}, 2.0)
        assert reply is not None and "no valid task" in reply["error"]
        if isinstance(task, str):
            with pytest.raises(JournalUnavailable, match="no valid task"):
                ensure_watching(task, str(ws), str(run))
    assert request(socket_path, {"op": "nonsense", "task": TASK}, 2.0) == {
        "error": "unknown request 'nonsense': watch, barrier, reset, ping, release or stop"
    }
    assert barrier(socket_path) is not None  # the daemon serves on


def test_a_journal_without_its_own_watcher_shares_the_one_it_is_given(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    watcher = Watcher()
    try:
        with Journal(str(first), watcher=watcher) as one, Journal(str(second), watcher=watcher):
            assert one.fileno() == watcher.fileno() is not None
            (second / "f").write_text("x")
            assert one.barrier().dirty_dirs == frozenset()
    finally:
        watcher.close()


@pytest.mark.timeout(60)
def test_a_journal_whose_home_was_deleted_ends_instead_of_watching_for_nobody(
    tmp_path: Path,
) -> None:
    """Deleting a home (as a host that is done does) leaves its daemon unreachable; it ends
    within its orphan check, and a home made again at the same path gets a journal of its own
    whose socket the old one never removes."""
    from settled.runtime import Runtime

    home = tmp_path / "home"
    workspace = tmp_path / "w"
    workspace.mkdir()
    with Runtime(str(home)) as runtime:
        runtime.new_task(str(workspace))  # watched: the daemon is not idle
    run_dir = home / "run"
    (old,) = journal_pids(run_dir)
    shutil.rmtree(home)
    with Runtime(str(home)) as runtime:
        runtime.new_task(str(workspace))
    deadline = time.monotonic() + 30
    while old in journal_pids(run_dir):
        assert time.monotonic() < deadline, "the orphaned journal did not end"
        time.sleep(0.1)
    (new,) = journal_pids(run_dir)
    assert new != old and (run_dir / "journal.sock").exists()  # its socket is left alone
