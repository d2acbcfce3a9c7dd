"""Verbs racing each other agree (issue 12, item 5), and every exit code is listed.

Two closes of one task at once, in threads and as `settled close` processes, both return the one
recorded close receipt; `task destroy` racing a running session, a close or another destroy
raises nothing but typed errors; the exit-code table in errors.py is what `settled --help` and
the README list, and an unexpected exception is one line and exit 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from settled.errors import EXIT_CODES, SettledError
from settled.records import TaskRecord
from settled.runtime import Runtime

SETTLED = [sys.executable, "-m", "settled.cli"]
README = Path(__file__).resolve().parent.parent / "README.md"


def _workspace(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.mkdir()
    return str(path)


def _at_once(home: str, *actions: Callable[[Runtime], Any]) -> list[Any]:
    """Run each action in its own thread with its own Runtime, all released at one barrier;
    what each returned, or the exception it raised."""
    results: list[Any] = [None] * len(actions)
    barrier = threading.Barrier(len(actions))

    def run(index: int) -> None:
        try:
            with Runtime(home) as runtime:
                barrier.wait(timeout=30)
                results[index] = actions[index](runtime)
        except BaseException as exc:  # the test inspects it
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(actions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive()
    return results


def _finished_task(rt: Runtime, tmp_path: Path, name: str) -> TaskRecord:
    task = rt.new_task(_workspace(tmp_path, name))
    rt.wait(rt.exec(task.task, shell="echo made > out; echo done").session)
    return task


def _untyped(results: list[Any]) -> list[BaseException]:
    return [r for r in results if isinstance(r, BaseException) and not isinstance(r, SettledError)]


# -- two closes at once ---------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(3))
def test_two_closes_in_threads_both_return_the_one_close_receipt(
    rt: Runtime, tmp_path: Path, attempt: int
) -> None:
    task = _finished_task(rt, tmp_path, f"ws{attempt}")
    results = _at_once(rt.home, *[lambda r: r.close_task(task.task)] * 2)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert all(r.complete for r in results)
    digests = {r.receipt["digest"] for r in results}
    assert digests == {rt.close_task(task.task).receipt["digest"]}  # the one recorded
    assert rt.task_record(task.task).state == "complete"
    rows = rt.store._db.execute(  # type: ignore[attr-defined]
        "SELECT COUNT(*) FROM checkpoints WHERE task=?", (task.task,)
    ).fetchone()
    assert rows[0] == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(3))
def test_two_close_processes_both_exit_0_with_the_same_receipt(
    rt: Runtime, tmp_path: Path, attempt: int
) -> None:
    task = _finished_task(rt, tmp_path, f"ws{attempt}")
    env = {**os.environ, "SETTLED_HOME": rt.home}
    closes = [
        subprocess.Popen(
            [*SETTLED, "close", task.task, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [close.communicate(timeout=120) for close in closes]
    codes = [close.returncode for close in closes]
    assert codes == [0, 0], (codes, outputs)
    receipts = [json.loads(out) for out, _err in outputs]
    assert receipts[0]["digest"] == receipts[1]["digest"]
    assert receipts[0] == rt.close_task(task.task).receipt


# -- destroy racing ------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(3))
def test_destroy_racing_a_running_session_raises_nothing_untyped(
    rt: Runtime, tmp_path: Path, attempt: int
) -> None:
    task = rt.new_task(_workspace(tmp_path, f"ws{attempt}"))
    session = rt.exec(task.task, shell="sleep 30").session
    # the owner settles the session while the destroy kills its boundary: both remove cgroups
    results = _at_once(rt.home, lambda r: r.destroy_task(task.task), lambda r: r.cancel(session))
    assert not _untyped(results), results
    assert not isinstance(results[0], BaseException), results[0]
    assert rt.wait(session, timeout=60)["state"] == "settled"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(3))
def test_two_destroys_at_once_raise_nothing_and_settle_the_session(
    rt: Runtime, tmp_path: Path, attempt: int
) -> None:
    task = rt.new_task(_workspace(tmp_path, f"ws{attempt}"))
    session = rt.exec(task.task, shell="sleep 30").session
    results = _at_once(rt.home, *[lambda r: r.destroy_task(task.task)] * 2)
    assert not [r for r in results if isinstance(r, BaseException)], results
    for result in results:
        (reported,) = result["sessions"]
        assert reported["state"] in ("settled", "skipped"), reported
    view = rt.wait(session, timeout=60)
    assert view["state"] == "settled" and view["receipt"]["death"]["proven"] is True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(3))
def test_destroy_racing_a_close_raises_nothing_untyped(
    rt: Runtime, tmp_path: Path, attempt: int
) -> None:
    task = rt.new_task(_workspace(tmp_path, f"ws{attempt}"))
    session = rt.exec(task.task, shell="sleep 30").session
    results = _at_once(
        rt.home,
        lambda r: r.destroy_task(task.task),
        lambda r: r.close_task(task.task, deadline=0.5),
    )
    assert not _untyped(results), results
    assert rt.wait(session, timeout=60)["state"] == "settled"
    assert rt.close_task(task.task).complete  # a later close finishes what either left


# -- exit codes ------------------------------------------------------------------------------


def _help_codes() -> dict[int, str]:
    done = subprocess.run([*SETTLED, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    listed = done.stdout.split("exit codes:\n", 1)[1]
    return {int(m[1]): m[2].strip() for m in re.finditer(r"^\s+(\d+)\s+(.+)$", listed, re.M)}


def _readme_codes() -> dict[int, str]:
    text = README.read_text()
    table = text.split("| code | meaning |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    return {int(m[1]): m[2].strip() for m in re.finditer(r"^\| (\d+) \| (.+) \|$", table, re.M)}


def test_help_and_readme_list_exactly_the_exit_code_table() -> None:
    assert _help_codes() == EXIT_CODES
    assert _readme_codes() == EXIT_CODES
    assert {0, 1, 2, 3, 4} <= set(EXIT_CODES)


def test_every_error_type_exits_with_a_listed_code() -> None:
    import settled.server.errors  # their error types register as subclasses
    import settled.workspace.checkpoint
    import settled.workspace.restore  # noqa: F401

    def subclasses(cls: type[SettledError]) -> list[type[SettledError]]:
        found = []
        for sub in cls.__subclasses__():
            found += [sub, *subclasses(sub)]
        return found

    for error in subclasses(SettledError):
        assert error.exit_code in EXIT_CODES, error


def test_an_unexpected_exception_is_one_line_and_exit_1(cli_home: Path) -> None:
    env = {**os.environ, "SETTLED_HOME": str(cli_home)}
    workspace = cli_home.parent / "ws"
    workspace.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*SETTLED, *args], capture_output=True, text=True, env=env, timeout=60
        )

    task = json.loads(run("task", "new", "--workspace", str(workspace), "--json").stdout)
    admitted = run("exec", "--task", task["task"], "--wait", "--json", "--", "echo hi")
    session = json.loads(admitted.stdout)["session"]
    log = cli_home / "sessions" / session / "stdout.log"
    log.unlink()
    log.mkdir()  # a damaged home: what no typed error foresaw
    done = run("logs", session)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("settled: internal error: IsADirectoryError")
    assert "please report" in done.stderr
    assert run("close", task["task"]).returncode == 0


@pytest.fixture
def cli_home(tmp_path: Path) -> Path:
    return tmp_path / "home"
