"""The SQLite store's write gate (store/gate.py) with real processes and real flocks: it is
handed over when its holder lets go or dies, a stopped holder delays a writer by the bound only,
and a forked child never keeps it held. SQLite's lock decides every write either way."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from typing import Any

import pytest

from settled.store import gate
from settled.store.sqlite import SQLiteStore


def _store(tmp_path: Any) -> SQLiteStore:
    return SQLiteStore(os.path.join(str(tmp_path), "settled.db"))


def _free(store: SQLiteStore) -> bool:
    """Whether the gate is free now (taken and let go on a description of its own)."""
    fd = os.open(store.path + gate.SUFFIX, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _holder(store: SQLiteStore) -> tuple[int, int]:
    """A child process that takes the gate, says so through a pipe, and sleeps."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - killed by the test
        fd = os.open(store.path + gate.SUFFIX, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(write, b"held")
        while True:
            time.sleep(60)
    os.close(write)
    assert os.read(read, 4) == b"held"
    os.close(read)
    return child, read


def _end(child: int) -> None:
    """Kill and reap the holder (once; again is a no-op)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(child, 0)


def test_a_write_takes_the_gate_and_lets_it_go(tmp_path: Any) -> None:
    store = _store(tmp_path)
    try:
        with gate.held(store.path, 5.0) as got:
            assert got and not _free(store)
        assert _free(store)
        store.create_task("k", "/w")  # a write through the store: the gate is let go after it
        assert _free(store)
    finally:
        store.close()


def test_a_holder_that_dies_hands_the_gate_to_the_waiting_writer(tmp_path: Any) -> None:
    store = _store(tmp_path)
    child, _ = _holder(store)
    try:
        assert not _free(store)
        os.kill(child, signal.SIGKILL)  # the kernel lets go of its flock as it closes its files
        with gate.held(store.path, 30.0) as got:
            assert got
        store.create_task("k", "/w")
    finally:
        _end(child)
        store.close()


def test_a_stopped_holder_delays_a_write_by_the_bound_then_sqlite_decides(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from settled.store import sqlite as module

    store = _store(tmp_path)
    child, _ = _holder(store)
    try:
        os.kill(child, signal.SIGSTOP)
        monkeypatch.setattr(module, "BUSY_TIMEOUT_S", 0.3)
        with gate.held(store.path, 0.3) as got:
            assert not got  # ran out: the writer goes on without it
        task, _ = store.create_task("k", "/w")  # written on SQLite's lock alone
        assert store.get_task(task.task).state == "open"
        _end(child)
        deadline = time.monotonic() + 30
        while not _free(store):  # each abandoned wait takes the gate and lets go at once
            assert time.monotonic() < deadline, "an abandoned wait kept the gate"
            time.sleep(0.01)
    finally:
        _end(child)
        store.close()


def test_a_child_forked_while_the_gate_is_held_does_not_keep_it(tmp_path: Any) -> None:
    """Its copy is closed as the fork returns in it (a zygote forked while another thread of
    its process wrote would otherwise hold the gate for its whole life)."""
    store = _store(tmp_path)
    started, go = os.pipe(), os.pipe()
    try:
        with gate.held(store.path, 5.0) as got:
            assert got
            child = os.fork()
            if child == 0:  # pragma: no cover - says it runs, then waits for the parent's word
                os.write(started[1], b"r")
                os.read(go[0], 1)
                os._exit(0)
        assert os.read(started[0], 1) == b"r"  # past the fork's hooks, alive, not exiting
        assert _free(store), "the child's copy kept the gate held"
        os.write(go[1], b"x")
        os.waitpid(child, 0)
    finally:
        for fd in (*started, *go):
            os.close(fd)
        store.close()


def test_a_holder_stopped_inside_its_transaction_fails_a_writer_within_one_bound(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped while it holds the gate and SQLite's lock: another writer waits out the gate,
    then SQLite only for what is left of the same busy timeout, and fails as it did before the
    gate (database is locked), never waiting for the holder for good. Nothing is written."""
    import sqlite3

    from settled.store import sqlite as module

    store = _store(tmp_path)
    task, _ = store.create_task("k", "/w")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - stopped, then killed by the test
        holder = SQLiteStore(store.path)
        with holder._write() as db:
            db.execute("UPDATE tasks SET frozen='held' WHERE task=?", (task.task,))
            os.write(write, b"in")
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    try:
        assert os.read(read, 2) == b"in"
        monkeypatch.setattr(module, "BUSY_TIMEOUT_S", 0.5)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            store.create_task("k2", "/w2")
    finally:
        _end(child)
        os.close(read)
        os.close(write)
    assert store.get_task(task.task).frozen is None  # the holder's write died with it
    store.create_task("k2", "/w2")  # and the gate with it
    store.close()
