"""The command line's manners (issue 37): what `ps`, `ls` and `--help` show, and what each
settled-made outcome says on stderr; driven as a user would, with real `settled` processes."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import test_cli
from conftest import ESCAPEE, kill_marked
from test_cli import CLI, SETTLED

cli = test_cli.cli  # the fixtures, shared
task = test_cli.task


def test_ps_shows_a_dash_for_an_exit_not_known_and_ls_says_complete_once(
    cli: CLI, task: dict[str, Any]
) -> None:
    cli.run("run", "--task", task["task"], "--key", "gone", "--", "/no/such/program", "x")
    cli.run("run", "--task", task["task"], "--key", "killed", "--", "sh", "-c", "kill -9 $$")
    rows = cli.run("ps", task["task"]).stdout.decode().splitlines()[1:]
    exits = {row.split()[1]: row.split()[3] for row in rows}
    assert exits == {"gone": "-", "killed": "SIGKILL"}
    assert "None" not in "\n".join(rows)
    assert cli.run("close", task["task"]).returncode == 0
    listed = cli.run("ls").stdout.decode().splitlines()
    assert listed[1].split()[1] == "complete" and "(complete)" not in listed[1]


def test_task_new_help_describes_workspace_and_key(cli: CLI) -> None:
    text = cli.run("task", "new", "--help").stdout.decode()
    options = text.split("options:", 1)[1]
    workspace = options.split("--workspace", 1)[1].split("\n  -", 1)[0]
    key = options.split("--key KEY", 1)[1].split("\n  -", 1)[0]
    assert "directory" in workspace and "default" in workspace
    assert "same task" in key and "default" in key


def test_ls_json_keeps_state_and_complete_apart(cli: CLI, task: dict[str, Any]) -> None:
    assert cli.run("close", task["task"]).returncode == 0
    row = json.loads(cli.run("ls", "--json").stdout)["tasks"][0]
    assert row["state"] == "complete" and row["complete"] is True


# -- --timeout 0, and stdin that is not passed -------------------------------------------------


def test_timeout_0_is_no_limit_and_the_same_command_as_none(cli: CLI, task: dict[str, Any]) -> None:
    command = ("--", "sh", "-c", "sleep 0.3; echo done")
    done = cli.run("run", "--task", task["task"], "--key", "k0", "--timeout", "0", *command)
    assert done.returncode == 0 and done.stdout == b"done\n", done.stderr
    receipt = cli.json("wait", cli.run("ps", task["task"], "-q").stdout.decode().strip())
    assert receipt["exit"]["reason"] == "exited"
    again = cli.json("exec", "--task", task["task"], "--key", "k0", *command)
    assert again["reused"] is True  # no --timeout and --timeout 0: one command, one digest


def test_timeout_0_is_no_limit_for_every_face_the_runtime_decides_it(tmp_path: Path) -> None:
    """HTTP bodies, MCP and the library pass 0 through; Runtime.exec reads it as no limit."""
    from settled.identity import CommandSpec
    from settled.requests import ExecRequest
    from settled.runtime import Runtime

    assert ExecRequest.from_json({"key": "k", "shell": "true", "timeout": 0}).timeout == 0
    (tmp_path / "ws").mkdir()
    with Runtime(str(tmp_path / "home")) as rt:
        task = rt.new_task(str(tmp_path / "ws")).task
        zero = rt.exec(task, shell="sleep 0.3", key="zero", timeout=0)
        assert rt.wait(zero.session, 30)["receipt"]["exit"]["reason"] == "exited"
        spec = CommandSpec.from_json(rt.store.get_session(zero.session).spec)
        assert spec.timeout is None
        assert rt.exec(task, shell="sleep 0.3", key="zero").reused  # the same command as none
        rt.close_task(task, deadline=30)


def _run_with_stdin(cli: CLI, task: dict[str, Any], stdin: Any, *extra: str) -> Any:
    return subprocess.run(
        [*SETTLED, "run", "--task", task["task"], *extra, "--", "sh", "-c", "cat; echo end"],
        stdin=stdin, capture_output=True, env=cli.env, timeout=60,
    )  # fmt: skip


def test_piped_stdin_not_passed_is_said_once_and_how_to_pass_it(
    cli: CLI, task: dict[str, Any], tmp_path: Path
) -> None:
    read, write = os.pipe()
    os.write(write, b"hi\n")
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        done = _run_with_stdin(cli, task, pipe)
    assert done.returncode == 0 and done.stdout == b"end\n"
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "not passed" in lines[0] and "--stdin -" in lines[0], lines
    data = tmp_path / "data"
    data.write_bytes(b"from a file\n")
    with data.open("rb") as handle:
        from_file = _run_with_stdin(cli, task, handle)
    assert b"a file with 12 bytes" in from_file.stderr and b"--stdin -" in from_file.stderr
    read, write = os.pipe()
    os.write(write, b"hi\n")
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        passed = _run_with_stdin(cli, task, pipe, "--stdin", "-")
    assert passed.stdout == b"hi\nend\n" and passed.stderr == b""


def test_no_stdin_warning_for_a_terminal_dev_null_or_an_empty_pipe(
    cli: CLI, task: dict[str, Any]
) -> None:
    quiet = [_run_with_stdin(cli, task, subprocess.DEVNULL)]
    read, write = os.pipe()
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        quiet.append(_run_with_stdin(cli, task, pipe))
    primary, secondary = os.openpty()
    try:
        quiet.append(_run_with_stdin(cli, task, secondary))
    finally:
        os.close(primary)
        os.close(secondary)
    for done in quiet:
        assert done.returncode == 0 and done.stdout == b"end\n" and done.stderr == b"", done


# -- a closed pipe: a quiet 141, as git -------------------------------------------------------


def _piped(cli: CLI, reader: str, *args: str, env: dict[str, str] | None = None) -> Any:
    """`settled ARGS | READER` through bash: the settled side's code, stdout as the reader
    printed it, stderr as settled (and the reader) printed it."""
    script = f'"${{@:2}}" | {reader}; exit "${{PIPESTATUS[0]}}"'
    return subprocess.run(
        ["bash", "-c", script, "bash", "_", *SETTLED, *args],
        capture_output=True, env={**cli.env, **(env or {})}, timeout=90,
    )  # fmt: skip


@pytest.mark.parametrize("where", ["warm", "local"])
def test_ls_into_head_is_a_quiet_141(cli: CLI, tmp_path: Path, where: str) -> None:
    deep = tmp_path / "w"
    for _ in range(16):  # a long workspace name: 24 rows are more than a pipe holds (64 KiB)
        deep = deep / ("d" * 200)
    deep.mkdir(parents=True)
    for _ in range(24):
        made = cli.run("task", "new", "--workspace", str(deep), "--shared-workspace", "-q")
        assert made.returncode == 0, made.stderr
    env = {"SETTLED_CLI": "local"} if where == "local" else {}
    whole = cli.run("ls", env=env)
    assert whole.returncode == 0 and len(whole.stdout) > 65536
    done = _piped(cli, "head -1", "ls", env=env)
    assert (done.returncode, done.stderr) == (141, b"")
    assert done.stdout.split() == [b"TASK", b"STATE", b"SESSIONS", b"AGE", b"WORKSPACE"]


@pytest.mark.parametrize(
    "args", [["--help"], ["run", "--help"], ["ls"], ["--version"]], ids=" ".join
)
def test_any_verb_into_a_closed_pipe_is_a_quiet_141(cli: CLI, args: list[str]) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before settled writes a byte
    try:
        done = subprocess.run(
            [*SETTLED, *args], stdout=write, stderr=subprocess.PIPE, env=cli.env, timeout=60
        )
    finally:
        os.close(write)
    assert done.stderr == b""
    # argparse prints a help itself and swallows its write's error: that one exits 0, quietly
    assert done.returncode == (0 if "--help" in args else 141)


MIB = 1 << 20


def test_logs_run_and_follow_into_head_are_a_quiet_141(cli: CLI, task: dict[str, Any]) -> None:
    big = f"head -c {MIB} /dev/zero"
    ran = _piped(cli, "head -c 10", "run", "--task", task["task"], "--", "sh", "-c", big)
    assert (ran.returncode, ran.stderr, ran.stdout) == (141, b"", b"\0" * 10)
    session = cli.run("ps", task["task"], "-q").stdout.decode().split()[0]
    assert cli.json("wait", session)["output"]["stdout"]["cursor"] == MIB  # it ran on, whole
    for stream in ("merged", "stdout"):
        logs = _piped(cli, "head -c 10", "logs", session, "--stream", stream)
        assert (logs.returncode, logs.stderr, logs.stdout) == (141, b"", b"\0" * 10)
    live = cli.json("exec", "--task", task["task"], "--", "sh", "-c", f"{big}; sleep 60")
    followed = _piped(cli, "head -c 10", "logs", live["session"], "--follow")
    assert (followed.returncode, followed.stderr) == (141, b"")
    assert cli.json("status", live["session"])["state"] == "running"  # only the reader left


# -- every code of settled's own says why, on one line; the command's own codes say nothing ----


def _lines(err: bytes) -> list[str]:
    return err.decode().strip().splitlines()


def test_a_command_not_found_says_so_naming_the_path_it_searched(
    cli: CLI, task: dict[str, Any]
) -> None:
    done = cli.run("run", "--task", task["task"], "--", "no-such-program-37", "arg")
    assert done.returncode == 127 and done.stdout == b""
    (line,) = _lines(done.stderr)
    assert line.startswith("settled: no-such-program-37: not found on PATH (PATH=/"), line
    assert "never started" in line and "full path" in line
    absolute = cli.run("run", "--task", task["task"], "--", "/no/such/program", "x")
    assert absolute.returncode == 127
    assert _lines(absolute.stderr) == [
        "settled: /no/such/program: no such file; the command never started (exit 127)"
    ]
    as_json = cli.run("run", "--task", task["task"], "--json", "--", "no-such-program-37", "y")
    assert as_json.returncode == 127 and json.loads(as_json.stdout)["exit"]["stage"] == "exec"
    assert "not found on PATH" in as_json.stderr.decode()


def test_a_timeout_names_the_limit(cli: CLI, task: dict[str, Any]) -> None:
    done = cli.run(
        "run", "--task", task["task"], "--timeout", "0.5", "--grace", "0.2", "--", "sleep", "30"
    )
    assert done.returncode == 124
    (line,) = _lines(done.stderr)
    assert "--timeout of 0.5 s" in line and "KILL after 0.2 s" in line and "status s_" in line


@pytest.mark.parametrize("code", [0, 1, 117, 124, 127])
def test_the_command_s_own_exit_codes_are_never_explained(
    cli: CLI, task: dict[str, Any], code: int
) -> None:
    done = cli.run("run", "--task", task["task"], "--", "sh", "-c", f"exit {code}")
    assert (done.returncode, done.stderr) == (code, b"")


def test_a_shell_s_own_not_found_is_its_own_line_only(cli: CLI, task: dict[str, Any]) -> None:
    done = cli.run("run", "--task", task["task"], "--", "no-such-program-37")  # via /bin/sh -c
    assert done.returncode == 127
    (line,) = _lines(done.stderr)
    assert "no-such-program-37" in line and not line.startswith("settled:")


def test_a_cancel_while_run_relays_says_who_cancelled(cli: CLI, task: dict[str, Any]) -> None:
    proc = subprocess.Popen(
        [*SETTLED, "run", "--task", task["task"], "--", "sh", "-c", "echo up; exec sleep 30"],
        env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    session = cli.run("ps", task["task"], "-q").stdout.decode().strip()
    assert cli.run("cancel", session, "--reason", "not needed").returncode == 0
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert _lines(err) == [f"settled: {session} was cancelled (not needed); see `settled status "
                           f"{session}`"]  # fmt: skip


def test_an_unknown_outcome_says_why_and_what_to_run(
    cli: CLI, task: dict[str, Any], marker: str
) -> None:
    try:
        done = cli.run(
            "run", "--task", task["task"], "--boundary", "pgroup", "--grace", "0.5", "--",
            ESCAPEE,
        )  # fmt: skip
        assert done.returncode == 117 and done.stdout == b"escaped\n"
        (line,) = _lines(done.stderr)
        assert "is unknown (exit 117): nothing proves its processes are gone" in line
        assert "settled status s_" in line and f"settled recover --task {task['task']}" in line
    finally:
        kill_marked(marker, b"sleep")


# -- close: what it waits for on a terminal, its default deadline, Ctrl-C ----------------------


class Terminal:
    """A `settled` process on a real pseudo-terminal (its controlling terminal: Ctrl-C typed
    there is the kernel's SIGINT to it), and everything it wrote there."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        argv = [*SETTLED, *args]
        pid, fd = pty.fork()
        if pid == 0:  # the child: nothing but exec
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.seen = pid, fd, b""

    def read_until(self, needle: bytes, seconds: float) -> bool:
        give_up = time.monotonic() + seconds
        while needle not in self.seen:
            left = give_up - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return False
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the process closed the terminal (it ended)
                return needle in self.seen
            if not chunk:
                return needle in self.seen
            self.seen += chunk
        return True

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)

    def end(self, seconds: float = 60) -> int:
        """Its exit code, after reading the rest of what it wrote."""
        self.read_until(b"\0never\0", seconds)
        give_up = time.monotonic() + seconds
        while True:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > give_up:
                os.kill(self.pid, signal.SIGKILL)
            time.sleep(0.05)


def test_close_help_states_its_default_deadline() -> None:
    from settled.cli.closing import DEFAULT_DEADLINE_S as SHOWN
    from settled.close.join import DEFAULT_DEADLINE_S

    assert SHOWN == DEFAULT_DEADLINE_S
    text = subprocess.run([*SETTLED, "close", "--help"], capture_output=True, timeout=60)
    deadline = " ".join(text.stdout.decode().split("--deadline", 1)[1].split())
    assert f"(default: {DEFAULT_DEADLINE_S:g})" in deadline and "cancelled" in deadline


def test_a_long_close_says_what_it_waits_for_on_a_terminal_only(
    cli: CLI, task: dict[str, Any], tmp_path: Path
) -> None:
    session = cli.json("exec", "--task", task["task"], "--", "sleep", "4.5")["session"]
    close = Terminal(["close", task["task"]], cli.env)
    assert close.end() == 0, close.seen
    lines = [line for line in close.seen.decode().splitlines() if "closing" in line]
    assert lines, close.seen
    assert f"closing {task['task']}: waiting for session {session} (sleep 4.5, running" in lines[0]
    assert "s so far of a 600 s deadline" in lines[0]
    workspace = tmp_path / "quiet"
    workspace.mkdir()
    other = cli.json("task", "new", "--workspace", str(workspace))["task"]
    cli.json("exec", "--task", other, "--", "sleep", "4")
    piped = cli.run("close", other)
    assert piped.returncode == 0 and piped.stderr == b""  # not a terminal: not a word


def test_ctrl_c_on_a_close_says_how_to_finish_it_and_run_says_so_too(
    cli: CLI, task: dict[str, Any]
) -> None:
    session = cli.json("exec", "--task", task["task"], "--", "sleep", "60")["session"]
    close = Terminal(["close", task["task"]], cli.env)
    assert close.read_until(b"waiting for session " + session.encode(), 30), close.seen
    close.type(b"\x03")  # Ctrl-C, as typed
    assert close.end() == 130, close.seen
    said = close.seen.decode().replace("\r", "")
    assert f"close of {task['task']} interrupted" in said
    assert f"Finish it: settled close {task['task']}\n" in said
    refused = cli.run("run", "--task", task["task"], "--", "true")
    assert refused.returncode == 4
    (line,) = _lines(refused.stderr)
    assert "AdmissionSealed" in line and "being closed" in line
    assert line.endswith(f"run `settled close {task['task']}` to finish closing it")
    cli.run("cancel", session)
    assert cli.run("close", task["task"]).returncode == 0
    closed = cli.run("run", "--task", task["task"], "--", "true")
    assert closed.returncode == 4 and b"settled task new" in closed.stderr


def test_an_outcome_lost_with_its_owner_says_so_on_attach(cli: CLI, task: dict[str, Any]) -> None:
    from conftest import _skip_unavailable

    _skip_unavailable("cgroup2")
    admitted = cli.json(
        "exec", "--task", task["task"], "--boundary", "cgroup2", "--", "printf hi; sleep 300"
    )
    os.kill(admitted["owner_pid"], signal.SIGKILL)
    give_up = time.monotonic() + 20
    while cli.json("status", admitted["session"])["state"] != "unknown":
        assert time.monotonic() < give_up
        time.sleep(0.05)
    assert cli.json("recover")["sessions"][0]["state"] == "settled"
    attached = cli.run("attach", admitted["session"])
    assert attached.returncode == 117 and attached.stdout == b"hi"
    (line,) = _lines(attached.stderr)
    assert "is unknown (exit 117): the exit status was lost with the owner" in line, line
    assert f"settled status {admitted['session']}" in line
