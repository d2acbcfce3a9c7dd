"""Watching scales with the host, and task creation is all or nothing (issue 12, item 2).

The inotify limits are per user and per user namespace, charged at every level up to the host's:
a child user namespace (`unshare --user --map-root-user`) has its own `user.max_inotify_instances`
and `user.max_inotify_watches` (/proc/sys/user/), which it may set lower without lowering the
host's `fs.inotify.max_user_*`, which every other process of this machine shares. (Those
/proc/sys/fs/inotify files are the host's even inside the child: never write them here.) So each
test runs the settled process that must live under a low limit (the Runtime making 300 tasks, or
the home's journal daemon) in such a namespace, and the rest as usual, and checks that the host's
limits are unchanged. Skipped, with the reason, where no child user namespace can set its limits.
Every daemon a test starts is stopped by the test (and by conftest).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import journal_pids

from settled.errors import BadInput
from settled.runtime import Runtime
from settled.workspace.journal import lifecycle as journal_lifecycle
from settled.workspace.journal import wire as journal_wire
from settled.workspace.journal.errors import JournalUnavailable

HOST_LIMITS = ("/proc/sys/fs/inotify/max_user_instances", "/proc/sys/fs/inotify/max_user_watches")

# Run in a child user namespace: set its own inotify limits, then do what argv[2] says.
_CHILD = r"""
import ctypes, json, os, sys
limits, mode, home = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
for name, value in limits.items():  # this namespace's own: /proc/sys/user, never fs/inotify
    assert name in ("max_inotify_instances", "max_inotify_watches"), name
    with open(f"/proc/sys/user/{name}", "w") as handle:
        handle.write(f"{value}\n")
if mode == "daemon":  # start the home's journal here: it lives under these limits
    from settled.workspace.journal.lifecycle import ensure_running
    print(json.dumps({"socket": ensure_running(os.path.join(home, "run"))}))
elif mode == "tasks":  # make N tasks here: every journal start happens under these limits
    from settled.runtime import Runtime
    count, made = int(sys.argv[4]), []
    with Runtime(home) as rt:
        for index in range(count):
            workspace = os.path.join(home, "..", "ws", str(index))
            os.makedirs(os.path.join(workspace, "sub"))
            made.append(rt.new_task(workspace, key=f"k{index}").task)
    libc = ctypes.CDLL(None, use_errno=True)
    fds = [libc.inotify_init1(0) for _ in range(limits["max_inotify_instances"] + 1)]
    refused = sum(fd < 0 for fd in fds)  # the limit was in force for this process too
    for fd in fds:
        if fd >= 0:
            os.close(fd)
    print(json.dumps({"tasks": made, "refused_instances": refused}))
"""


def _userns_can_set_limits() -> str | None:
    """None if a child user namespace can set its own inotify limits here, else why not."""
    if os.geteuid() != 0:
        return "not root: cannot map root into a child user namespace and set its limits"
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    own = "/proc/sys/user/max_inotify_instances"
    before = _host_limits()
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", f"echo 7 > {own} && cat {own}"],
        capture_output=True,
        timeout=30,
    )
    assert _host_limits() == before, "a child user namespace changed the host's limits"
    if done.returncode != 0 or done.stdout.strip() != b"7":
        return f"a child user namespace cannot set its inotify limits: {done.stderr!r}"
    return None


def _host_limits() -> list[str]:
    return [Path(path).read_text() for path in HOST_LIMITS]


@pytest.fixture(scope="module")
def userns() -> None:
    reason = _userns_can_set_limits()
    if reason is not None:
        pytest.skip(reason)


def _in_userns(limits: dict[str, int], mode: str, home: Path, *args: str) -> dict[str, Any]:
    before = _host_limits()
    done = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            sys.executable,
            "-c",
            _CHILD,
            json.dumps(limits),
            mode,
            str(home),
            *args,
        ],
        capture_output=True,
        timeout=300,
    )
    assert _host_limits() == before, "the child user namespace changed the host's limits"
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "home"
    try:
        yield path
    finally:
        pidfds = [os.pidfd_open(pid) for pid in journal_pids(path / "run")]
        journal_lifecycle.stop(str(path / "run" / "journal.sock"))
        survivors = []
        for fd in pidfds:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(10_000):  # readable once the process has exited
                survivors.append(fd)
            os.close(fd)
        assert not survivors, "a journal daemon of this home survived its stop"


def _daemon_with_limits(home: Path, **limits: int) -> str:
    """The home's journal, started in a child user namespace with these inotify limits."""
    Runtime(str(home)).close()  # the home, made as usual
    socket_path: str = _in_userns(limits, "daemon", home)["socket"]
    return socket_path


def _workspace(tmp_path: Path, directories: int) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    for index in range(directories):
        (root / f"d{index}").mkdir(parents=True)
    return root


# -- many tasks, one watcher ----------------------------------------------------------------


@pytest.mark.timeout(600)
def test_300_tasks_under_a_low_instance_limit_share_one_daemon_and_close(
    userns: None, home: Path
) -> None:
    limit = 4  # a journal per task would have failed at the fifth task
    made = _in_userns({"max_inotify_instances": limit}, "tasks", home, "300")
    tasks = made["tasks"]
    assert len(set(tasks)) == 300 and made["refused_instances"] >= 1
    assert len(journal_pids(home / "run")) == 1
    socket_path = str(home / "run" / "journal.sock")
    info = journal_wire.ping(socket_path)
    assert info is not None and info["tasks"] == 300 and info["instance"] == "ok"
    assert info["directories"] == 600  # each workspace and its one subdirectory
    with Runtime(str(home)) as rt:
        assert len(rt.store._db.execute("SELECT task FROM tasks").fetchall()) == 300
        for task in tasks[:3]:  # commands run and are seen by the shared journal
            admission = rt.exec(task, shell="echo x > sub/f", key="w")
            assert rt.wait(admission.session, timeout=60)["receipt"]["exit"]["code"] == 0
        for task in tasks:
            result = rt.close_task(task)
            assert result.complete and result.receipt is not None
            assert result.receipt["final_scan"]["journal_trusted"] is True
        with_command = rt.close_task(tasks[0]).receipt
        assert with_command is not None
        assert with_command["sessions"][0]["terminal_mutation"]["source"] == "journal"
    info = journal_wire.ping(socket_path)
    assert info is not None and info["tasks"] == 0  # every close released its task


# -- the kernel refuses: the task works, the journal says it cannot vouch --------------------


@pytest.mark.timeout(120)
def test_refused_watches_leave_the_task_working_and_its_scans_full(
    userns: None, home: Path, tmp_path: Path
) -> None:
    socket_path = _daemon_with_limits(home, max_inotify_watches=3)
    workspace = _workspace(tmp_path, 8)  # 9 directories, 3 watches allowed
    with Runtime(str(home)) as rt:
        task = rt.new_task(str(workspace))
        mark = journal_wire.barrier(socket_path, task.task)
        assert mark is not None and not mark.trustworthy and mark.lost_watches
        assert any("max_inotify_watches = 3" in reason for reason in mark.reasons)
        admission = rt.exec(task.task, shell="echo x > d7/f", key="w")
        assert rt.wait(admission.session, timeout=60)["receipt"]["exit"]["code"] == 0
        checkpoint = rt.checkpoint(task.task)  # incremental asked for: full, the journal is lost
        assert checkpoint["scan"]["mode"] == "full"
        result = rt.close_task(task.task)
        assert result.complete and result.receipt is not None
        scan = result.receipt["final_scan"]
        assert scan["mode"] == "full" and scan["journal_trusted"] is False
        assert any("ENOSPC" in why for why in scan["journal_untrusted_because"])


@pytest.mark.timeout(120)
def test_a_refused_inotify_instance_leaves_every_task_working_and_untrusted(
    userns: None, home: Path, tmp_path: Path
) -> None:
    socket_path = _daemon_with_limits(home, max_inotify_instances=0)
    info = journal_wire.ping(socket_path)
    assert info is not None and "max_inotify_instances = 0" in info["instance"]
    workspace = _workspace(tmp_path, 2)
    with Runtime(str(home)) as rt:
        task = rt.new_task(str(workspace))
        admission = rt.exec(task.task, shell="echo x > d1/f", key="w")
        view = rt.wait(admission.session, timeout=60)
        assert view["receipt"]["exit"]["code"] == 0
        assert view["receipt"]["terminal_mutation"]["trustworthy"] is False
        assert rt.checkpoint(task.task)["scan"]["mode"] == "full"
        result = rt.close_task(task.task)
        assert result.complete and result.receipt is not None
        scan = result.receipt["final_scan"]
        assert scan["mode"] == "full" and scan["journal_trusted"] is False
        because = scan["journal_untrusted_because"]
        assert any("refused an inotify instance" in why and "EMFILE" in why for why in because)


# -- all or nothing -------------------------------------------------------------------------


def _rows(home: Path, table: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(home / "settled.db") as db:
        return db.execute(f"SELECT * FROM {table}").fetchall()  # a fixed table name


def _break_the_journal(home: Path) -> None:
    """The daemon cannot make its per-task state directory, so it never starts."""
    journal_lifecycle.stop(str(home / "run" / "journal.sock"))
    shutil.rmtree(home / "run" / "journal", ignore_errors=True)
    (home / "run" / "journal").write_text("not a directory")


@pytest.mark.timeout(120)
def test_a_task_whose_journal_cannot_start_leaves_nothing(home: Path, tmp_path: Path) -> None:
    with Runtime(str(home)) as rt:
        _break_the_journal(home)
        workspaces = set(home.glob("workspace-*"))
        with pytest.raises(JournalUnavailable, match="did not start"):
            rt.new_task()  # a workspace made by settled: it goes too
        with pytest.raises(JournalUnavailable, match="did not start"):
            rt.new_task(str(_workspace(tmp_path, 1)), key="given")
        assert _rows(home, "tasks") == [] and set(home.glob("workspace-*")) == workspaces
        (home / "run" / "journal").unlink()
        task = rt.new_task(str(tmp_path / "ws"), key="given")  # the same key: a new task
        assert [row[0] for row in _rows(home, "tasks")] == [task.task]
        mark = journal_wire.barrier(rt.workspace.socket(), task.task)
        assert mark is not None and mark.trustworthy  # no state of the failed one remained


@pytest.mark.timeout(120)
def test_task_new_from_the_cli_fails_whole(home: Path, tmp_path: Path, marker: str) -> None:
    Runtime(str(home)).close()
    _break_the_journal(home)
    env = {**os.environ, "SETTLED_HOME": str(home), "TEST_SESSION_MARKER": marker}
    done = subprocess.run(
        [sys.executable, "-m", "settled.cli", "task", "new", "--json"],
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert done.returncode != 0 and b"Traceback" not in done.stderr
    assert b"journal" in done.stderr
    assert _rows(home, "tasks") == [] and not list(home.glob("workspace-*"))


def test_a_refused_key_leaves_no_workspace_behind(home: Path, tmp_path: Path) -> None:
    with Runtime(str(home)) as rt:
        rt.new_task(str(_workspace(tmp_path, 0)), key="mine")
        with pytest.raises(BadInput, match="already names task"):
            rt.new_task(key="mine")  # settled would make a workspace: refused, it is gone
        assert not list(home.glob("workspace-*")) and len(_rows(home, "tasks")) == 1
