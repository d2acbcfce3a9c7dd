"""`settled run`, `attach`, `ls`, `ps` and the CLI's manners, driven as a user would: real
`settled` processes, real commands, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_cli
from test_cli import CLI, SETTLED

cli = test_cli.cli  # the fixtures, shared
task = test_cli.task


def test_run_streams_both_streams_as_bytes_and_exits_with_the_commands_code(
    cli: CLI, task: dict[str, Any]
) -> None:
    script = "printf 'out\\n'; printf 'err' >&2; head -c 65536 /dev/urandom > bin; cat bin; exit 7"
    done = cli.run("run", "--task", task["task"], "--", "sh", "-c", script)
    assert done.returncode == 7, done.stderr
    binary = (Path(task["workspace"]) / "bin").read_bytes()
    assert done.stdout == b"out\n" + binary  # bit for bit, no line splitting
    assert done.stderr == b"err"


@pytest.mark.parametrize(
    ("command", "extra", "code"),
    [
        (["true"], [], 0),
        (["sh", "-c", "kill -KILL $$"], [], 128 + signal.SIGKILL),
        (["sleep", "30"], ["--timeout", "0.5", "--grace", "0.5"], 124),
        (["/no/such/program"], [], 127),
    ],
    ids=["zero", "signal", "timeout", "cannot-start"],
)
def test_run_exit_codes_follow_the_shell_and_timeout_1(
    cli: CLI, task: dict[str, Any], command: list[str], extra: list[str], code: int
) -> None:
    done = cli.run("run", "--task", task["task"], *extra, "--", *command)
    assert done.returncode == code, done.stderr


def test_run_json_prints_the_process_receipt_and_keeps_the_code(
    cli: CLI, task: dict[str, Any]
) -> None:
    done = cli.run("run", "--task", task["task"], "--json", "--", "sh", "-c", "echo hi; exit 3")
    assert done.returncode == 3
    receipt = json.loads(done.stdout)
    assert receipt["kind"] == "process" and receipt["exit"]["code"] == 3
    assert receipt["output"]["stdout"]["cursor"] == 3


def test_ctrl_c_detaches_and_attach_goes_on_from_the_printed_cursors(
    cli: CLI, task: dict[str, Any]
) -> None:
    script = "echo one; sleep 1.5; echo two; echo late >&2"
    proc = subprocess.Popen(
        [*SETTLED, "run", "--task", task["task"], "--", "sh", "-c", script],
        env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"one\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and out == b""
    hint = err.decode().strip().splitlines()[-1]
    assert "runs on" in hint and "settled attach" in hint
    words = hint[hint.index("settled attach") :].split()
    assert words[3:] == ["--from", "4", "--stderr-from", "0"]
    attached = cli.run(*words[1:])
    assert attached.returncode == 0
    assert attached.stdout == b"two\n" and attached.stderr == b"late\n"


def test_cancel_on_interrupt_cancels_and_exits_as_terminated(
    cli: CLI, task: dict[str, Any]
) -> None:
    proc = subprocess.Popen(
        [*SETTLED, "run", "--task", task["task"], "--cancel-on-interrupt", "--",
         "sh", "-c", "echo started; exec sleep 30"],
        env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert b"cancelling" in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", "--task", "t_0", "true"], "needs `--` before the command"),
        (["run", "--task", "t_0", "--"], "needs a command after `--`"),
        (["run", "--bogus", "--task", "t_0", "--", "true"], "unrecognized arguments: --bogus"),
        (["attach", "s_0000000000000000"], "unknown session"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(cli: CLI, args: list[str], words: str) -> None:
    done = cli.run(*args)
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in lines[0]


def test_a_malformed_env_file_is_one_line_and_exit_2(
    cli: CLI, task: dict[str, Any], tmp_path: Path
) -> None:
    env_file = tmp_path / "vars"
    env_file.write_text("A=1\nthis is not a pair\n")
    done = cli.run("run", "--task", task["task"], "--env-file", str(env_file), "--", "true")
    assert done.returncode == 2
    assert done.stderr.decode().strip() == (
        f"settled: BadInput: --env-file {env_file}:2: 'this is not a pair' is not NAME=VALUE "
        "(NAME of letters, digits and _, not starting with a digit)"
    )


def test_env_flags_reach_the_command_and_only_they_do(
    cli: CLI, task: dict[str, Any], tmp_path: Path
) -> None:
    env_file = tmp_path / "vars"
    env_file.write_text("# comment\nexport FROM_FILE='a b'\nBOTH=file\n")
    done = cli.run(
        "run", "--task", task["task"], "--env-file", str(env_file), "--env", "BOTH=flag",
        "--inherit", "PASSED_ON", "--", "env",
        env={"PASSED_ON": "yes", "NOT_PASSED": "secret"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = dict(line.split("=", 1) for line in done.stdout.decode().splitlines())
    assert seen["FROM_FILE"] == "a b" and seen["BOTH"] == "flag" and seen["PASSED_ON"] == "yes"
    assert "NOT_PASSED" not in seen and not any(name.startswith("SETTLED_") for name in seen)
    whole = cli.run("run", "--task", task["task"], "--inherit-env", "--", "env",
                    env={"NOT_PASSED": "now passed"})  # fmt: skip
    assert b"NOT_PASSED=now passed" in whole.stdout and b"SETTLED_HOME" not in whole.stdout


def test_ls_and_ps_show_tasks_sessions_and_commands(cli: CLI, task: dict[str, Any]) -> None:
    cli.run("run", "--task", task["task"], "--key", "first", "--", "sh", "-c", "echo hi; exit 4")
    listed = cli.json("ls")["tasks"]
    assert [row["task"] for row in listed] == [task["task"]]
    assert listed[0]["sessions"] == 1 and listed[0]["workspace"] == task["workspace"]
    text = cli.run("ps", task["task"]).stdout.decode()
    header, row = text.splitlines()
    assert header.split()[:4] == ["SESSION", "KEY", "STATE", "EXIT"]
    assert " first " in row and " settled " in row and " 4 " in row and "3/0" in row
    assert row.endswith("sh -c 'echo hi; exit 4'")
    assert cli.run("ps", task["task"], "-q").stdout.decode().startswith("s_")
    session = json.loads(cli.run("ps", task["task"], "--json").stdout)["sessions"][0]
    assert "sh -c" in cli.run("status", session["session"]).stdout.decode()


def test_every_verb_has_help_with_an_example_and_exit_codes(cli: CLI) -> None:
    top = cli.run("--help").stdout.decode()
    assert "exit codes:" in top and "124 timeout" in top
    verbs = [
        "run", "exec", "attach", "ls", "ps", "wait", "logs", "status", "cancel", "close",
        "checkpoint", "recover", "hosts", "explain", "restore", "verify", "mcp", "serve", "demo",
        "probe",
    ]  # fmt: skip
    for verb in [*verbs, "task new", "task destroy"]:
        text = cli.run(*verb.split(), "--help").stdout.decode()
        assert "example:" in text and "exit codes" in text, verb
        assert "(default: None)" not in text, verb
    run_help = cli.run("run", "--help").stdout.decode()
    assert "124" in run_help and "117" in run_help and "127" in run_help


def test_the_default_home_does_not_depend_on_the_directory(tmp_path: Path) -> None:
    from settled.home import ROOT_HOME, default_home

    assert default_home({}, uid=0) == ROOT_HOME
    assert default_home({"XDG_STATE_HOME": "/st"}, uid=1000) == "/st/settled"
    assert default_home({"XDG_STATE_HOME": "relative"}, uid=1000).endswith("/.local/state/settled")
    env = {k: v for k, v in os.environ.items() if k != "SETTLED_HOME"}
    env |= {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path)}
    for where in (tmp_path, Path("/")):
        if os.geteuid() == 0:
            break  # root's default is /var/lib/settled: not written by a test
        subprocess.run([*SETTLED, "ls"], env=env, cwd=where, check=True, timeout=60)
        assert (tmp_path / "state" / "settled").is_dir()


def test_no_traceback_without_debug_and_one_with_it(cli: CLI, tmp_path: Path) -> None:
    bad = tmp_path / "file"
    bad.write_text("")
    plain = cli.run("ls", "--home", str(bad / "sub"))
    assert plain.returncode != 0 and b"Traceback" not in plain.stderr
    assert len(plain.stderr.decode().strip().splitlines()) == 1
    debug = cli.run("ls", "--home", str(bad / "sub"), "--debug")
    assert b"Traceback" in debug.stderr


def test_logs_default_to_both_streams_in_the_order_they_were_stored(
    cli: CLI, task: dict[str, Any]
) -> None:
    script = "printf a; sleep 0.2; printf B >&2; sleep 0.2; printf c; sleep 0.2; printf D >&2"
    done = cli.json("exec", "--task", task["task"], "--wait", "--", "sh", "-c", script)
    session = done["session"]
    assert cli.run("logs", session).stdout == b"aBcD"
    assert cli.run("logs", session, "--from", "2").stdout == b"cD"
    assert cli.run("logs", session, "--stream", "stderr").stdout == b"BD"
    assert cli.run("logs", session, "--follow", "--timeout", "30").stdout == b"aBcD"


def test_serve_swerex_answers_swe_rex_s_own_client_with_a_key_from_the_environment(
    cli: CLI, tmp_path: Path
) -> None:
    pytest.importorskip("swerex")
    import asyncio
    import socket

    from swerex.runtime.remote import RemoteRuntime

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**cli.env, "SETTLED_SWEREX_API_KEY": "k3y"}
    server = subprocess.Popen(
        [*SETTLED, "serve", "--swerex", "--port", str(port),
         "--swerex-workspace", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        good = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token="k3y", timeout=30)
        bad = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token="wrong", timeout=30)

        async def probe_both() -> tuple[bool, bool]:
            for _ in range(100):
                if server.poll() is not None:
                    break
                if await good.is_alive():
                    return True, bool(await bad.is_alive())
                await asyncio.sleep(0.1)
            return False, False

        assert asyncio.run(probe_both()) == (True, False)
    finally:
        server.terminate()
        server.wait(timeout=30)
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    refused = cli.run("serve", "--swerex", "--api-key-file", str(empty), "--port", str(port))
    assert refused.returncode == 2 and b"is empty" in refused.stderr
