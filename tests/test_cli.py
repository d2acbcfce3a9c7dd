"""The CLI contract, driven as a user or an agent harness would: real `settled` processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import ESCAPEE, kill_marked

SETTLED = [sys.executable, "-m", "settled.cli"]


class CLI:
    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.env = {**os.environ, "SETTLED_HOME": str(home), **(env or {})}

    def run(
        self,
        *args: str,
        stdin: bytes | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*SETTLED, *args],
            input=stdin,
            capture_output=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
        )

    def json(self, *args: str, code: int = 0, **kw: Any) -> dict[str, Any]:
        done = (
            self.run(*args, "--json", **kw)
            if "--" not in args
            else self.run(*_json_before_dashdash(args), **kw)
        )
        assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
        payload: dict[str, Any] = json.loads(done.stdout)
        return payload


def _json_before_dashdash(args: tuple[str, ...]) -> list[str]:
    at = args.index("--")
    return [*args[:at], "--json", *args[at:]]


@pytest.fixture
def cli(tmp_path: Path, marker: str) -> Any:
    tool = CLI(tmp_path / "home", {"TEST_SESSION_MARKER": marker})
    yield tool
    for row in _sessions(tool):
        if row["state"] in ("admitted", "running", "settling"):
            tool.run("cancel", row["session"])
            tool.run("wait", row["session"], "--timeout", "30")
    kill_marked(marker)


def _sessions(tool: CLI) -> list[dict[str, Any]]:
    db = tool.home / "settled.db"
    if not db.exists():
        return []
    import sqlite3

    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT session, state FROM sessions").fetchall()
    return [{"session": s, "state": st} for s, st in rows]


@pytest.fixture
def task(cli: CLI, tmp_path: Path) -> dict[str, Any]:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return cli.json("task", "new", "--workspace", str(workspace))


def test_exec_returns_while_the_command_runs_and_names_its_key(cli: CLI, task: dict) -> None:
    admitted = cli.json("exec", "--task", task["task"], "--", "sleep 1; echo finished")
    assert set(admitted) >= {"session", "task", "key", "digest", "reused", "state"}
    assert admitted["state"] == "running" and admitted["reused"] is False
    assert admitted["key"].startswith("k_")
    receipt = cli.json("wait", admitted["session"])
    assert receipt["exit"]["code"] == 0
    assert cli.run("logs", admitted["session"]).stdout == b"finished\n"


def test_a_session_is_recorded_after_every_cli_process_is_gone(cli: CLI, task: dict) -> None:
    admitted = cli.json("exec", "--task", task["task"], "--", "sleep 0.5; echo done")
    deadline = time.monotonic() + 30
    while cli.json("status", admitted["session"])["state"] != "settled":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    view = cli.json("status", admitted["session"])
    assert view["receipt"]["exit"]["code"] == 0
    assert view["receipt"]["death"]["proven"] is True


@pytest.mark.timeout(120)
def test_twenty_concurrent_identical_admissions_launch_once(
    cli: CLI, task: dict, tmp_path: Path
) -> None:
    args = ("exec", "--task", task["task"], "--key", "same", "--", "echo ran >> launches")

    def admit(_: int) -> dict[str, Any]:
        return cli.json(*args)

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(admit, range(20)))
    assert len({r["session"] for r in results}) == 1
    assert sorted(r["reused"] for r in results) == [False] + [True] * 19
    cli.json("wait", results[0]["session"])
    assert (tmp_path / "ws" / "launches").read_text() == "ran\n"


def test_same_key_with_another_command_is_a_conflict(cli: CLI, task: dict) -> None:
    first = cli.json("exec", "--task", task["task"], "--key", "k1", "--", "echo one")
    conflict = cli.json("exec", "--task", task["task"], "--key", "k1", "--", "echo two", code=4)
    assert conflict["error"] == "KeyConflict"
    assert conflict["existing_digest"] == first["digest"]
    assert conflict["requested_digest"] != first["digest"]
    assert (
        first["digest"] in conflict["message"]
        and conflict["requested_digest"] in conflict["message"]
    )
    assert len(cli.json("status", task["task"])["sessions"]) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--task", "t_nope"), "t_nope"),
        (("--cwd", "../.."), "../.."),
        (("--timeout", "-1"), "-1"),
        (("--grace", "nan"), "nan"),
        (("--env", "NOEQUALS"), "NOEQUALS"),
    ],
)
def test_bad_input_is_refused_naming_the_value_and_nothing_is_recorded(
    cli: CLI, task: dict, args: tuple[str, ...], needle: str
) -> None:
    argv = ["exec", *args] if args[0] == "--task" else ["exec", "--task", task["task"], *args]
    done = cli.run(*argv, "--", "echo never")
    assert done.returncode == 2, done
    assert needle in done.stderr.decode()
    assert _sessions(cli) == []


def test_an_unusable_home_is_refused(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    done = CLI(not_a_dir).run("task", "new")
    assert done.returncode == 2
    assert str(not_a_dir) in done.stderr.decode()


def test_an_explicit_boundary_the_machine_cannot_give_is_refused(
    cli: CLI, task: dict, tmp_path: Path
) -> None:
    done = cli.run(
        "exec",
        "--task",
        task["task"],
        "--boundary",
        "cgroup2",
        "--",
        "true",
        env={"SETTLED_CGROUP_ROOT": str(tmp_path)},
    )
    assert done.returncode == 2 and "cgroup2" in done.stderr.decode()
    assert _sessions(cli) == []


def test_a_command_that_cannot_start_gets_a_receipt_saying_why(
    cli: CLI, task: dict, tmp_path: Path
) -> None:
    missing = cli.json("exec", "--task", task["task"], "--wait", "--", "./no-such", "arg")
    assert missing["receipt"]["exit"]["reason"] == "not_started"
    assert missing["receipt"]["exit"]["code"] is None
    assert "No such file" in missing["receipt"]["exit"]["error"]
    script = tmp_path / "ws" / "not-executable"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(stat.S_IRUSR | stat.S_IWUSR)
    denied = cli.json("exec", "--task", task["task"], "--wait", "--", "./not-executable", "x")
    assert denied["receipt"]["exit"]["reason"] == "not_started"
    assert "Permission denied" in denied["receipt"]["exit"]["error"]


def test_logs_resume_from_a_cursor_follow_and_give_the_model_view(cli: CLI, task: dict) -> None:
    shell = "head -c 300000 /dev/zero | tr '\\0' a; printf END"
    admitted = cli.json("exec", "--task", task["task"], "--", shell)
    followed = cli.run("logs", admitted["session"], "--follow", "--timeout", "30").stdout
    assert followed == b"a" * 300000 + b"END"
    assert cli.run("logs", admitted["session"], "--from", "299998").stdout == b"aaEND"
    viewed = cli.run("logs", admitted["session"], "--view", "400")
    assert viewed.returncode == 0, viewed.stderr
    view = viewed.stdout
    assert len(view) <= 400 and view.endswith(b"END")
    assert b"omitted stdout bytes" in view
    too_far = cli.run("logs", admitted["session"], "--from", "999999")
    assert too_far.returncode == 2 and b"999999" in too_far.stderr


def test_wait_gives_up_on_its_own_clock_and_the_session_goes_on(cli: CLI, task: dict) -> None:
    admitted = cli.json("exec", "--task", task["task"], "--", "sleep 2")
    done = cli.run("wait", admitted["session"], "--timeout", "0.2")
    assert done.returncode == 3 and b"still running" in done.stderr
    assert cli.json("wait", admitted["session"])["exit"]["code"] == 0


def test_a_follow_that_runs_out_of_time_is_one_line_and_exit_3(cli: CLI, task: dict) -> None:
    admitted = cli.json("exec", "--task", task["task"], "--", "printf early; sleep 30")
    done = cli.run("logs", admitted["session"], "--follow", "--timeout", "0.5")
    assert done.returncode == 3, done.stderr
    assert done.stdout == b"early"
    assert b"Traceback" not in done.stderr and b"NotSettled" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_stdin_is_given_bytes_and_is_part_of_the_digest(cli: CLI, task: dict) -> None:
    data = bytes(range(256)) * 10
    one = cli.json(
        "exec", "--task", task["task"], "--stdin", "-", "--wait", "--", "cat", stdin=data
    )
    assert cli.run("logs", one["session"]).stdout == data
    other = cli.json("exec", "--task", task["task"], "--", "cat")
    assert other["digest"] != one["digest"]


def test_a_pgroup_session_is_never_proven_dead(cli: CLI, task: dict, marker: str) -> None:
    admitted = cli.json(
        "exec",
        "--task",
        task["task"],
        "--boundary",
        "pgroup",
        "--grace",
        "0.5",
        "--",
        ESCAPEE,
    )
    try:
        done = cli.run("wait", admitted["session"], "--json")
        assert done.returncode == 3
        receipt = json.loads(done.stdout)
        assert receipt["death"]["proven"] is False and receipt["death"]["boundary"] == "pgroup"
        assert receipt["output"]["drain"] == "incomplete"
        view = cli.json("status", admitted["session"])
        assert view["state"] == "unknown" and "setsid" in view["why"]
    finally:
        # the process group could not end the setsid escapee, and the receipt claims nothing;
        # the session's own pids cgroup (a resource wall) may have ended it at the owner's end
        kill_marked(marker, b"sleep")


def test_demo_runs_on_the_embedded_default(tmp_path: Path, marker: str) -> None:
    done = subprocess.run(
        [*SETTLED, "demo"],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        env={**os.environ, "TEST_SESSION_MARKER": marker, "TMPDIR": str(tmp_path)},
    )  # its home under the test's own directory, never the host's /tmp, even if it were kept
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert "4194304 bytes" in out and "(timeout)" in out and "stopped by TERM" in out
    assert "never started" in out and "reused=true" in out
    table = [line for line in out[out.index("| question") :].splitlines() if line.startswith("|")]
    assert len(table) == 11 and "2 launches" in table[2] and "1 launch" in table[2]
    assert "bit for bit" in table[4] and "late.txt restored from checkpoint" in table[8]
    assert kill_marked(marker, b"sleep") == []
    assert "settled-demo-" in out  # a fresh home of its own, not the user's
    home = out.splitlines()[0].removeprefix("home ")
    assert out.splitlines()[-1] == f"the demo's home {home} is removed (--keep-home keeps it)"
    assert not os.path.exists(home) and list(tmp_path.iterdir()) == []  # nothing left behind


def test_recover_settles_a_session_whose_owner_was_killed(cli: CLI, task: dict) -> None:
    from conftest import _skip_unavailable

    _skip_unavailable("cgroup2")
    admitted = cli.json(
        "exec", "--task", task["task"], "--boundary", "cgroup2", "--", "printf hi; sleep 300"
    )
    owner = admitted["owner_pid"]
    os.kill(owner, 9)
    deadline = time.monotonic() + 20
    while cli.json("status", admitted["session"])["state"] != "unknown":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    frozen = cli.run("exec", "--task", task["task"], "--", "true")
    assert frozen.returncode == 3 and admitted["session"].encode() in frozen.stderr
    recovered = cli.json("recover")
    assert recovered["sessions"][0]["state"] == "settled"
    receipt = cli.json("wait", admitted["session"])
    assert receipt["death"]["source"] == "recovery"
    assert cli.run("logs", admitted["session"]).stdout == b"hi"


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to nobody needs root")


@needs_root
def test_restore_names_the_setid_bits_it_drops_and_same_owner_restores_them(
    cli: CLI, task: dict, tmp_path: Path
) -> None:
    prog = Path(task["workspace"]) / "prog"
    prog.write_bytes(b"#!/bin/sh\nid\n")
    os.chown(prog, 65534, 65534)
    os.chmod(prog, 0o4755)
    cli.json("close", task["task"])
    mine = cli.json("restore", task["task"], str(tmp_path / "mine"))
    assert mine["setid_dropped"] == ["prog"] and mine["owners_restored"] is False
    assert stat.S_IMODE(os.stat(tmp_path / "mine" / "prog").st_mode) == 0o755
    done = cli.run("restore", task["task"], str(tmp_path / "text"))
    assert b"set-id bits dropped (not earned by this restore): prog" in done.stdout
    same = cli.json("restore", task["task"], str(tmp_path / "same"), "--same-owner")
    assert same["setid_dropped"] == [] and same["owners_restored"] is True
    st = os.stat(tmp_path / "same" / "prog")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (65534, 0o4755)


def test_restore_same_owner_is_refused_clearly_when_not_root(
    cli: CLI, task: dict, tmp_path: Path
) -> None:
    cli.json("close", task["task"])
    not_root = "import os, sys; os.geteuid = lambda: 1000; from settled.cli import main; "
    done = subprocess.run(
        [sys.executable, "-c", not_root + "sys.exit(main(sys.argv[1:]))",
         "restore", task["task"], str(tmp_path / "dest"), "--same-owner"],
        capture_output=True, timeout=60, env=cli.env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert b"SameOwnerNeedsRoot" in done.stderr and b"needs root" in done.stderr
    assert not (tmp_path / "dest").exists()


def test_restore_refuses_a_symlinked_destination_naming_it(
    cli: CLI, task: dict, tmp_path: Path
) -> None:
    cli.json("close", task["task"])
    (tmp_path / "target").mkdir()
    (tmp_path / "dest").symlink_to(tmp_path / "target")
    refused = cli.json("restore", task["task"], str(tmp_path / "dest"), code=1)
    assert refused["error"] == "DestinationIsSymlink"
    assert str(tmp_path / "target") in refused["message"]
    assert os.listdir(tmp_path / "target") == []
