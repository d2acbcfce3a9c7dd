"""The command line's manners (issue 37): what `ps`, `ls` and `--help` show, and what each
settled-made outcome says on stderr; driven as a user would, with real `settled` processes."""

from __future__ import annotations

import json
from typing import Any

import test_cli
from test_cli import CLI

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


def test_an_http_body_s_timeout_0_is_no_limit() -> None:
    from settled.server.bodies import session_request

    assert session_request({"key": "k", "shell": "true", "timeout": 0})["timeout"] is None
    assert session_request({"key": "k", "shell": "true", "timeout": 2})["timeout"] == 2.0
