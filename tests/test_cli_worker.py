"""The CLI's thin client and the workers of the home's zygote (cli/thin.py, cli/worker.py): once
the home's zygote runs, a verb runs in a worker it forks, with the caller's stdio, directory,
environment, umask and argv, and the caller exits with its code; everything else runs here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import test_cli
from test_cli import CLI, SETTLED
from test_home_launcher import _zygote_pid
from test_launcher import _alive, _gone_within, _within

from settled.cli import thin
from settled.owner import home_launcher

cli = test_cli.cli  # the fixtures, shared
task = test_cli.task

# Runs the CLI's entry point and then names the settled modules this process imported.
IMPORTS_PROBE = (
    "import sys; from settled.cli import main; code = main(sys.argv[1:]); "
    "sys.stdout.flush(); "
    "print(sorted(m for m in sys.modules if m.startswith('settled')), file=sys.stderr); "
    "sys.exit(code)"
)


def _warm(cli: CLI, task_id: str) -> int:
    """Start the home's zygote (the first `run` does) and return its pid."""
    first = cli.run("run", "--task", task_id, "--", "true")
    assert first.returncode == 0, first.stderr
    return _zygote_pid(cli.home / "run")


def _imports_of(cli: CLI, *args: str, env: dict[str, str] | None = None) -> tuple[Any, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_PROBE, *args], capture_output=True, timeout=60,
        env={**cli.env, **(env or {})},
    )  # fmt: skip
    modules = json.loads(done.stderr.decode().strip().splitlines()[-1].replace("'", '"'))
    return done, modules


def test_a_served_call_imports_only_the_thin_client_and_prints_what_a_local_one_does(
    cli: CLI, task: dict[str, Any]
) -> None:
    _warm(cli, task["task"])
    served, imported = _imports_of(cli, "status", task["task"], "--json")
    local, imported_here = _imports_of(cli, "status", task["task"], "--json",
                                       env={"SETTLED_CLI": "local"})  # fmt: skip
    assert served.returncode == local.returncode == 0, (served.stderr, local.stderr)
    assert json.loads(served.stdout) == json.loads(local.stdout)
    assert "settled.runtime" not in imported, imported  # the worker ran it
    assert {"settled.cli.thin", "settled.where"} <= set(imported)
    assert "settled.runtime" in imported_here  # SETTLED_CLI=local: this process ran it


def test_bytes_code_directory_environment_and_umask_reach_the_command_as_from_a_local_call(
    cli: CLI, task: dict[str, Any], tmp_path: Path
) -> None:
    _warm(cli, task["task"])
    here = tmp_path / "elsewhere"
    here.mkdir()
    script = "printf '\\377'; printf \"$1|$FROM_CALLER|$(umask)|\"; cat; echo err >&2; exit 7"
    argv = ["run", "--task", task["task"], "--inherit", "FROM_CALLER", "--stdin", "-", "--",
            "sh", "-c", script, "sh", "an arg"]  # fmt: skip
    outcomes = []
    for mode in ("home", "local"):
        done = subprocess.run(
            [*SETTLED, *argv], input=b"from stdin", capture_output=True, timeout=60,
            cwd=here, env={**cli.env, "FROM_CALLER": "v\u00e9", "SETTLED_CLI": mode}, umask=0o027,
        )  # fmt: skip
        outcomes.append((done.returncode, done.stdout, done.stderr))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0] == (7, b"\xffan arg|v\xc3\xa9|0027|from stdin", b"err\n")
    (here / "ws").mkdir()
    made = subprocess.run(
        [*SETTLED, "task", "new", "--workspace", "ws", "--json"], capture_output=True,
        timeout=60, cwd=here, env=cli.env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["workspace"] == str(here / "ws")  # the caller's directory


def test_usage_errors_and_help_read_and_exit_as_from_a_local_call(
    cli: CLI, task: dict[str, Any]
) -> None:
    _warm(cli, task["task"])
    for argv in (["run", "--task"], ["run", "--bogus"], ["wait", "--help"], ["task", "nope"]):
        served = cli.run(*argv)
        local = cli.run(*argv, env={"SETTLED_CLI": "local"})
        assert (served.returncode, served.stdout, served.stderr) == (
            local.returncode, local.stdout, local.stderr,
        ), argv  # fmt: skip


def test_ctrl_c_of_the_caller_reaches_the_worker_and_detaches_as_a_local_run_does(
    cli: CLI, task: dict[str, Any]
) -> None:
    _warm(cli, task["task"])
    caller = _streaming_caller(cli, task["task"], subprocess.PIPE)
    try:
        caller.send_signal(signal.SIGINT)
        _out, err = caller.communicate(timeout=30)
    finally:
        caller.kill()
        caller.wait()
    assert caller.returncode == 130, err
    assert b"settled: detached; session s_" in err  # the worker's words, through our stderr
    session = err.split(b"session ")[1].split()[0].decode()
    assert cli.json("status", session)["state"] == "running"  # it runs on, as detached
    assert cli.run("cancel", session).returncode == 0


def test_a_caller_killed_outright_takes_its_worker_with_it(cli: CLI, task: dict[str, Any]) -> None:
    zygote = _warm(cli, task["task"])
    admitted = cli.json("exec", "--task", task["task"], "--", "sleep 30")
    caller = subprocess.Popen([*SETTLED, "wait", admitted["session"]], env=cli.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        worker = _worker_of(zygote)
        caller.kill()  # SIGKILL: it relays nothing
        caller.wait()
        assert _gone_within(worker, 10)  # its end of the connection closed: SIGIO ends it
    finally:
        caller.kill()
        caller.wait()
    assert cli.json("status", admitted["session"])["state"] == "running"  # the session is not it
    assert cli.run("cancel", admitted["session"]).returncode == 0


def _worker_of(zygote: int, timeout: float = 20.0) -> int:
    """The zygote's one child that stays (stubs exit at once): the worker of the call."""
    assert _within(lambda: bool(_live_children(zygote)), timeout), f"{zygote} forked no worker"
    return _live_children(zygote)[0]


def _live_children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children if _alive(int(child))]


def _streaming_caller(cli: CLI, task_id: str, stderr: int) -> subprocess.Popen[bytes]:
    """`settled run` of a command that printed `up` (read here) and sleeps 30 s."""
    caller = subprocess.Popen(
        [*SETTLED, "run", "--task", task_id, "--", "sh", "-c", "echo up; sleep 30"],
        stdout=subprocess.PIPE, stderr=stderr, env=cli.env,
    )  # fmt: skip
    assert caller.stdout is not None and caller.stdout.readline() == b"up\n"
    return caller


def test_a_zygote_of_another_install_leaves_and_the_call_runs_here(
    cli: CLI, task: dict[str, Any], monkeypatch: Any
) -> None:
    zygote = _warm(cli, task["task"])
    monkeypatch.setenv("SETTLED_HOME", str(cli.home))
    monkeypatch.setattr(thin, "install_identity", lambda: "0.0 /elsewhere 1")
    assert thin.answered_by_home(["status", task["task"]]) is None  # this process runs it
    assert _gone_within(zygote, 10)  # and the zygote, of other code, left


def test_what_the_thin_client_leaves_to_this_process(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setenv("SETTLED_HOME", str(tmp_path))
    assert thin.served_home(["status", "t_1"]) == str(tmp_path)
    assert thin.served_home(["--json", "--home", "/h", "ps", "t_1"]) == "/h"
    assert thin.served_home(["run", "--home=/h2", "--", "--home", "/no"]) == "/h2"
    for local in (["serve"], ["demo"], ["--help"], ["-h", "status"], ["--hom", "/h", "ls"],
                  ["--home"], [], ["--home", "--json", "ls"]):  # fmt: skip
        assert thin.served_home(local) is None, local
    assert thin.answered_by_home(["status", "t_1"]) is None  # no zygote answers here
    monkeypatch.setenv("SETTLED_LAUNCHER", "fresh")
    monkeypatch.setattr(thin, "served_home", lambda argv: (_ for _ in ()).throw(AssertionError))
    assert thin.answered_by_home(["status", "t_1"]) is None  # asked for: it does not look


def test_a_closed_stdout_runs_here_as_before(cli: CLI, task: dict[str, Any]) -> None:
    _warm(cli, task["task"])
    outcomes = []
    for mode in ("home", "local"):
        done = subprocess.run(
            f"exec {' '.join(SETTLED)} status {task['task']} >&-", shell=True,
            capture_output=True, timeout=60, env={**cli.env, "SETTLED_CLI": mode},
        )  # fmt: skip
        outcomes.append(done.returncode)
    assert outcomes[0] == outcomes[1]
    assert os.path.exists(cli.home / "run" / "launcher.sock")


def test_a_worker_killed_by_a_signal_ends_its_caller_by_the_same_signal(
    cli: CLI, task: dict[str, Any]
) -> None:
    _warm(cli, task["task"])
    crashed = cli.run("close", task["task"], env={"SETTLED_FAULT": "close.after_sealed:crash"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr  # told by the zygote
    assert b"settled: crash at fault point close.after_sealed" in crashed.stderr
    assert cli.json("close", task["task"])["outcome"]["complete"] is True


def test_ctrl_z_stops_the_worker_with_its_caller_and_sigcont_resumes_both(
    cli: CLI, task: dict[str, Any]
) -> None:
    zygote = _warm(cli, task["task"])
    caller = _streaming_caller(cli, task["task"], subprocess.DEVNULL)
    try:
        worker = _worker_of(zygote)
        caller.send_signal(signal.SIGTSTP)
        assert _state_becomes(caller.pid, "T") and _state_becomes(worker, "T")
        caller.send_signal(signal.SIGCONT)
        assert _state_becomes(caller.pid, "S") and _state_becomes(worker, "S")
        caller.send_signal(signal.SIGINT)  # detach; the session runs on
        assert caller.wait(timeout=30) == 130
    finally:
        caller.kill()
        caller.wait()
    sessions = cli.json("status", task["task"])["sessions"]
    for session in sessions:
        if session["state"] == "running":
            assert cli.run("cancel", session["session"]).returncode == 0


def _state_becomes(pid: int, state: str, timeout: float = 10.0) -> bool:
    def state_now() -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    return _within(lambda: state_now() == state, timeout)


def test_a_stopped_zygote_frees_the_home_at_once_and_its_running_calls_end_as_they_would(
    cli: CLI, task: dict[str, Any]
) -> None:
    zygote = _warm(cli, task["task"])
    admitted = cli.json("exec", "--task", task["task"], "--", "sleep 1; echo done")
    waiting = subprocess.Popen([*SETTLED, "wait", admitted["session"]], env=cli.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _worker_of(zygote)
        assert home_launcher.stop(str(cli.home / "run"))  # returns once the lock is free
        again = cli.run("run", "--task", task["task"], "--", "echo next")  # a new zygote
        assert again.returncode == 0 and again.stdout == b"next\n", again.stderr
        assert _zygote_pid(cli.home / "run") != zygote
        out, err = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
        waiting.wait()
    assert waiting.returncode == 0, err  # the old zygote's worker finished its wait
    assert out.startswith(b"process receipt " + admitted["session"].encode()), out
    assert b"exit code 0 (exited)" in out
    assert _gone_within(zygote, 10)  # and the old zygote left after it


def test_past_its_capacity_the_zygote_leaves_a_call_to_its_caller(
    cli: CLI, task: dict[str, Any]
) -> None:
    import resource

    def few_descriptors() -> None:  # the zygote inherits it: room for 3 workers (31 // 8)
        resource.setrlimit(resource.RLIMIT_NOFILE, (31, 31))

    first = subprocess.run(
        [*SETTLED, "run", "--task", task["task"], "--", "true"], capture_output=True,
        timeout=60, env=cli.env, preexec_fn=few_descriptors,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    zygote = _zygote_pid(cli.home / "run")
    admitted = cli.json("exec", "--task", task["task"], "--", "sleep 30")
    waits = [
        subprocess.Popen([*SETTLED, "wait", admitted["session"]], env=cli.env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(3)
    ]  # fmt: skip
    try:
        assert _within(lambda: len(_live_children(zygote)) == 3, 20)
        done, imported = _imports_of(cli, "status", task["task"], "--json")
        assert done.returncode == 0, done.stderr
        assert "settled.runtime" in imported  # no room: it ran in its own process
    finally:
        for waiting in waits:
            waiting.kill()
            waiting.wait()
    assert cli.run("cancel", admitted["session"]).returncode == 0
