"""The environment policy people can predict: a command gets its caller's PATH (recorded and in
the digest), `--clean-env` the standard one, and a PATH that leads outside the command's view is
said before the command runs. Real `settled` processes, real commands, a real tool outside the
view; the Python client's default checked on the wire it sends."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import test_cli
from test_cli import CLI

from settled.client import _with_inherited
from settled.environment import (
    STANDARD_PATH,
    base_environment,
    caller_policy,
    path_in_view,
    path_of,
    unseen_on_path,
)
from settled.errors import BadInput
from settled.runtime import Runtime

cli = test_cli.cli  # the fixtures, shared
task = test_cli.task


def _tool(directory: Path, name: str, says: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tool = directory / name
    tool.write_text(f"#!/bin/sh\necho '{says}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return tool


def test_the_callers_path_is_the_default_and_clean_env_gives_the_standard_one() -> None:
    environ = {"PATH": "/opt/x/bin:/usr/bin", "OTHER": "1"}
    assert caller_policy([], False, False, environ) == ["PATH"]
    assert caller_policy(["OTHER"], False, False, environ) == ["OTHER", "PATH"]
    assert caller_policy(["OTHER"], False, True, environ) == ["OTHER"]
    assert caller_policy([], True, False, environ) == []  # --inherit-env takes PATH anyway
    assert caller_policy([], False, False, {}) == []  # a caller with no PATH: the standard one
    with pytest.raises(BadInput, match="--clean-env and --inherit-env contradict"):
        caller_policy([], True, True, environ)
    assert path_of({}, False, environ) == "/opt/x/bin:/usr/bin"
    assert path_of({}, True, environ) == STANDARD_PATH
    assert path_of({"PATH": "/p"}, False, environ) == "/p"  # --env PATH=... wins


def test_run_gives_the_callers_path_recorded_and_clean_env_the_standard_one(
    cli: CLI, task: dict[str, Any], tmp_path: Path
) -> None:
    tools = tmp_path / "ws" / "tools"  # in the workspace: the command's view shows it
    _tool(tools, "only-mine", "found mine")
    home = base_environment()["HOME"]  # the command's: in its view, the task's own directory
    caller_path = f"{tools}:{home}/.local/bin:{STANDARD_PATH}"
    done = cli.run("run", "--task", task["task"], "--", "only-mine", env={"PATH": caller_path})
    assert (done.returncode, done.stdout) == (0, b"found mine\n"), done.stderr
    assert b"settled:" not in done.stderr  # nothing to say: the view shows the tool
    receipt = cli.json("run", "--task", task["task"], "--", "sh", "-c", 'echo "$PATH"',
                       env={"PATH": caller_path})  # fmt: skip
    with Runtime(str(cli.home)) as rt:
        spec = rt.store.get_session(receipt["session"]).spec
    assert dict(spec["env"])["PATH"] == f"{tools}:{STANDARD_PATH}"  # less the task's own dir
    assert "PATH" in spec["inherited"]
    clean = cli.run("run", "--task", task["task"], "--clean-env", "--", "sh", "-c", 'echo "$PATH"',
                    env={"PATH": caller_path})  # fmt: skip
    assert clean.stdout.decode().strip() == STANDARD_PATH, clean.stderr
    other = cli.run("run", "--task", task["task"], "--key", receipt["key"], "--", "sh", "-c",
                    'echo "$PATH"', env={"PATH": STANDARD_PATH})  # fmt: skip
    assert other.returncode == 4 and b"KeyConflict" in other.stderr  # PATH is in the digest
    both = cli.run("run", "--task", task["task"], "--clean-env", "--inherit-env", "--", "true")
    assert both.returncode == 2
    assert both.stderr.decode().strip().endswith("contradict each other: choose one")


def test_a_tool_on_the_path_outside_the_view_is_named_with_what_runs_instead(
    cli: CLI, task: dict[str, Any], tmp_path: Path
) -> None:
    outside = tmp_path / "venv" / "bin"  # a virtualenv beside the workspace, not in it
    _tool(outside, "sh", "the callers sh")  # shadows /bin/sh on the caller's PATH
    caller_path = f"{outside}:{STANDARD_PATH}"
    done = cli.run("run", "--task", task["task"], "--", "sh", "-c", "echo system",
                   env={"PATH": caller_path})  # fmt: skip
    assert done.returncode == 0 and done.stdout == b"system\n"  # the view's sh ran
    note = done.stderr.decode().splitlines()[0]
    assert note.startswith(f"settled: sh is {outside}/sh on the PATH, outside the command's view")
    assert f"to run it, grant --readable {tmp_path / 'venv'}" in note
    assert "it runs /" in note
    granted = cli.run("run", "--task", task["task"], "--readable", str(tmp_path / "venv"), "--",
                      "sh", "-c", "echo system", env={"PATH": caller_path})  # fmt: skip
    assert granted.stdout == b"the callers sh\n", granted.stderr
    assert b"settled:" not in granted.stderr
    _tool(tmp_path / "elsewhere", "nowhere-else", "x")
    missing = cli.run("run", "--task", task["task"], "--", "nowhere-else",
                      env={"PATH": f"{tmp_path / 'elsewhere'}:{STANDARD_PATH}"})  # fmt: skip
    assert "outside the command's view: it will not find it" in missing.stderr.decode()
    assert missing.returncode == 127


def test_unseen_on_path_needs_the_link_target_in_view_too(tmp_path: Path) -> None:
    real = _tool(tmp_path / "pyenv" / "bin", "python9", "real")
    venv = tmp_path / "ws" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python9").symlink_to(real)
    search = f"{venv}:{STANDARD_PATH}"
    note = unseen_on_path("python9", search, ["/usr", str(tmp_path / "ws")])
    assert note is not None and f"grant --readable {tmp_path / 'pyenv'}" in note
    assert unseen_on_path("python9", search, ["/usr", str(tmp_path)]) is None
    assert unseen_on_path("/bin/sh", search, ["/usr"]) is None  # a path is not looked up


def test_the_python_client_sends_its_path_unless_clean_env() -> None:
    env, inherited = _with_inherited({"A": "1"}, [], False, False)
    assert env == {"PATH": os.environ["PATH"], "A": "1"} and inherited == ["PATH"]
    assert _with_inherited({"A": "1"}, [], False, True) == ({"A": "1"}, [])
    env, inherited = _with_inherited({"PATH": "/mine"}, [], False, False)
    assert env == {"PATH": "/mine"} and inherited == []  # an explicit PATH wins, not recorded


def test_path_in_view_drops_the_tasks_own_dirs_and_relative_entries() -> None:
    search = "/root/.local/bin:.::bin:/tmp/x:/var/tmp:/dev/shm/b:/opt/tool/bin:/usr/bin:/root2"
    assert path_in_view(search, "/root") == "/opt/tool/bin:/usr/bin:/root2"
    shown = ["/root/.pyenv/versions/3"]  # a read-only grant shows the host's directory there
    assert path_in_view("/root/.pyenv/versions/3/bin:/usr/bin", "/root", shown) == (
        "/root/.pyenv/versions/3/bin:/usr/bin"
    )


def test_a_tool_planted_in_the_tasks_home_is_not_what_a_later_command_runs(
    cli: CLI, task: dict[str, Any]
) -> None:
    """The caller's ~/.local/bin is, in the command's view, the task's own home: an earlier
    (hostile) command of the task could fill it, so the inherited PATH leaves it out."""
    home = base_environment()["HOME"]
    caller_path = f"{home}/.local/bin:{STANDARD_PATH}"
    plant = (
        f"mkdir -p {home}/.local/bin && printf '#!/bin/sh\\necho 1 passed\\n' "
        f"> {home}/.local/bin/planted-tool && chmod +x {home}/.local/bin/planted-tool"
    )
    done = cli.run("run", "--task", task["task"], "--", "sh", "-c", plant,
                   env={"PATH": caller_path})  # fmt: skip
    assert done.returncode == 0, done.stderr
    later = cli.run("run", "--task", task["task"], "--", "planted-tool", "-q",
                    env={"PATH": caller_path})  # fmt: skip
    assert later.returncode == 127 and b"1 passed" not in later.stdout, later.stdout
    shown = cli.run("run", "--task", task["task"], "--", "sh", "-c", 'echo "$PATH"',
                    env={"PATH": caller_path})  # fmt: skip
    assert shown.stdout.decode().strip() == STANDARD_PATH
    explicit = cli.run("run", "--task", task["task"], "--env", f"PATH={caller_path}", "--",
                       "planted-tool")  # fmt: skip
    assert explicit.stdout == b"1 passed\n"  # a PATH given with --env is the caller's choice
