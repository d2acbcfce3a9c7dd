"""Grants and limits as every face takes them: checked before anything is recorded.

A grant (`--writable`, `--readable`) is the one way a caller opens a session's wall, so one that
would open `/`, the settled home, another task's workspace or a store directory is refused
naming it, and nothing is launched; a limit (`--memory`, `--pids`, `--cpus`) outside its
grammar is refused naming the field. Task defaults are stored with the task and apply to every
command of it (grants added to an exec's own, limits replaced by an exec's own), inside the
command's digest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from settled import grammar, grants
from settled.errors import BadInput
from settled.identity import CommandSpec
from settled.records import TaskRecord
from settled.runtime import Runtime

# -- the grammar of limits ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4M", 4 << 20),
        ("512M", 512 << 20),
        ("512m", 512 << 20),
        ("2G", 2 << 30),
        ("2GiB", 2 << 30),
        ("1gb", 1 << 30),
        ("1073741824", 1 << 30),
        ("4194304B", 4 << 20),
        ("1T", 1 << 40),
    ],
)
def test_a_memory_size_is_bytes_or_a_binary_suffix(text: str, value: int) -> None:
    assert grammar.parse_memory("--memory", text) == value


@pytest.mark.parametrize(
    "text", ["", "3M", "1.5G", "-1", "512X", "٣G", "0x10M", "1e9", "inf", "2 G", "1M", "9" * 50]
)
def test_a_memory_size_outside_the_grammar_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(grammar.BadNumber, match="--memory"):
        grammar.parse_memory("--memory", text)


@pytest.mark.parametrize("value", [True, 1.5e9, "512M", -1, 0, 3 << 20, (1 << 50) + 1])
def test_memory_in_json_is_an_integer_count_of_bytes_within_bounds(value: object) -> None:
    with pytest.raises(grammar.BadNumber, match="memory"):
        grammar.check_memory("memory", value)


def test_pids_and_cpus_have_their_bounds() -> None:
    assert grammar.check_pids("pids", 1) == 1
    assert grammar.parse_cpus("--cpus", "0.5") == 0.5
    assert grammar.check_cpus("cpus", 2) == 2.0
    for bad in (0, grammar.MAX_PIDS + 1, True, 2.0):
        with pytest.raises(grammar.BadNumber, match="pids"):
            grammar.check_pids("pids", bad)
    for bad_cpus in (0, 0.001, 1025, float("nan"), float("inf"), False):
        with pytest.raises(grammar.BadNumber, match="cpus"):
            grammar.check_cpus("cpus", bad_cpus)
    for text in ("-1", "1e2", "½", ".5"):
        with pytest.raises(grammar.BadNumber, match="--cpus"):
            grammar.parse_cpus("--cpus", text)


# -- the digest ---------------------------------------------------------------------------------


def test_walls_are_in_the_digest_and_absent_ones_leave_older_digests_alone() -> None:
    plain = CommandSpec(argv=("true",))
    assert set(plain.to_json()) == {
        "v", "argv", "shell", "cwd", "env", "stdin", "timeout", "grace", "boundary", "service",
    }  # fmt: skip
    walled = CommandSpec(
        argv=("true",), readable=("/opt", "/opt"), memory=512 << 20, pids=64, cpus=2
    )
    assert walled.to_json()["readable"] == ["/opt"]
    assert (walled.memory, walled.pids, walled.cpus) == (512 << 20, 64, 2.0)
    assert len({plain.digest, walled.digest, walled.replace(pids=65).digest}) == 3
    assert CommandSpec.from_json(walled.to_json()) == walled
    assert (
        CommandSpec(argv=("true",), cpus=2).digest == CommandSpec(argv=("true",), cpus=2.0).digest
    )


# -- which grants a command may be given --------------------------------------------------------


def test_a_grant_must_be_an_existing_directory_and_never_the_whole_host(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    assert grants.resolve("readable", [str(tmp_path / "link")]) == (str(tmp_path / "dir"),)
    for path, why in (
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "file", "is not a directory"),
        (Path("/"), "the whole host"),
        (tmp_path / "dir" / ".." / "..", None),
    ):
        if why is None:
            continue
        with pytest.raises(grants.BadGrant, match=f"--readable .*{why}"):
            grants.resolve("readable", [str(path)])
    with pytest.raises(grants.BadGrant, match="whole host"):
        grants.resolve("writable", ["/tmp/.."])
    with pytest.raises(BadInput, match="absolute"):
        grants.resolve("writable", ["relative/dir"])


def test_a_grant_that_opens_what_settled_holds_is_refused_naming_it(tmp_path: Path) -> None:
    home, mine, other = tmp_path / "home", tmp_path / "mine", tmp_path / "work" / "other"
    store_dir = tmp_path / "shared-store"
    for path in (home / "pods", mine / "src", other, store_dir):
        path.mkdir(parents=True)

    def refused(path: Path) -> str:
        with pytest.raises(grants.BadGrant) as caught:
            grants.refuse_held(
                "writable", [str(path)], home=str(home), workspace=str(mine),
                workspaces=[str(mine), str(other)], evidence_dirs=[str(store_dir)],
            )  # fmt: skip
        return str(caught.value)

    assert "the settled home" in refused(home)
    assert "the settled home" in refused(home / "pods")
    assert "the settled home" in refused(tmp_path)  # it holds the home
    assert "another task's workspace" in refused(other)
    assert "another task's workspace" in refused(tmp_path / "work")  # it holds one
    assert "store or object directory" in refused(store_dir)
    for allowed in (mine, mine / "src"):  # the task's own workspace, or inside it
        grants.refuse_held(
            "readable", [str(allowed)], home=str(home), workspace=str(mine),
            workspaces=[str(mine), str(other)], evidence_dirs=[str(store_dir)],
        )  # fmt: skip


def test_evidence_dirs_are_a_sqlite_stores_directory_and_a_local_object_store() -> None:
    found = grants.evidence_dirs("sqlite:///srv/stores/one.db", "file:///srv/objects")
    assert found == ["/srv/stores", "/srv/objects"]
    assert grants.evidence_dirs("postgresql://h/db", "s3://bucket/prefix") == []


# -- through the Runtime: refused before anything is recorded ------------------------------------


def test_a_bad_grant_launches_nothing_and_records_nothing(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    (tmp_path / "other-ws").mkdir()
    other = rt.new_task(str(tmp_path / "other-ws"))
    for asked, field in (
        ({"writable": ["/"]}, "--writable '/'"),
        ({"readable": [str(tmp_path / "nowhere")]}, "does not exist"),
        ({"readable": [rt.home]}, "the settled home"),
        ({"writable": [other.workspace]}, "another task's workspace"),
    ):
        with pytest.raises(grants.BadGrant, match=field):
            rt.exec(task.task, shell="true", key=f"k-{field}", **asked)  # type: ignore[arg-type]
    assert rt.store.list_sessions(task.task) == []


def test_task_defaults_apply_to_every_command_and_an_exec_adds_or_replaces(
    rt: Runtime, tmp_path: Path
) -> None:
    (tmp_path / "ws").mkdir()
    shared, extra = tmp_path / "shared", tmp_path / "extra"
    shared.mkdir()
    extra.mkdir()
    record = rt.new_task(str(tmp_path / "ws"), readable=[str(shared)], memory=256 << 20, pids=100)
    assert record.defaults == {"readable": [str(shared)], "memory": 256 << 20, "pids": 100}
    assert rt.store.get_task(record.task).defaults == record.defaults  # stored, read back
    first = rt.exec(record.task, shell="true", key="defaults-only")
    spec = CommandSpec.from_json(rt.store.get_session(first.session).spec)
    assert (spec.readable, spec.memory, spec.pids, spec.cpus) == (
        (str(shared),),
        256 << 20,
        100,
        None,
    )
    second = rt.exec(record.task, shell="true", key="own", readable=[str(extra)], pids=10, cpus=0.5)
    spec = CommandSpec.from_json(rt.store.get_session(second.session).spec)
    assert spec.readable == tuple(sorted((str(shared), str(extra))))
    assert (spec.memory, spec.pids, spec.cpus, spec.network) == (256 << 20, 10, 0.5, "proxy")
    rt.wait(first.session)
    rt.wait(second.session)


def test_task_new_refuses_a_bad_default_and_leaves_no_task(rt: Runtime, tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    with pytest.raises(grants.BadGrant, match="the settled home"):
        rt.new_task(str(tmp_path / "ws"), writable=[rt.home])
    with pytest.raises(grammar.BadNumber, match="pids"):
        rt.new_task(str(tmp_path / "ws"), pids=0)
    assert rt.store.list_tasks(10) == []


# -- the faces ----------------------------------------------------------------------------------


def _cli(home: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SETTLED_HOME": home}
    return subprocess.run(
        [sys.executable, "-m", "settled", *args], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_the_cli_refuses_a_bad_limit_or_grant_with_exit_2_naming_it(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    for args, named in (
        (("--memory", "3M"), "--memory"),
        (("--memory", "lots"), "--memory"),
        (("--pids", "0"), "--pids"),
        (("--cpus", "-1"), "--cpus"),
        (("--writable", "/"), "whole host"),
        (("--readable", str(tmp_path / "nowhere")), "does not exist"),
    ):
        done = _cli(rt.home, "exec", "--task", task.task, *args, "--", "true")
        assert done.returncode == 2, done
        assert named in done.stderr and len(done.stderr.strip().splitlines()) == 1
    (tmp_path / "ws2").mkdir()
    made = _cli(rt.home, "task", "new", "--workspace", str(tmp_path / "ws2"), "--pids", "64",
                "--memory", "1G", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["defaults"] == {"pids": 64, "memory": 1 << 30}
    assert rt.store.list_sessions(task.task) == []


def test_the_body_grammar_refuses_limits_that_are_not_numbers() -> None:
    from settled.requests import ExecRequest, TaskRequest

    base = {"key": "k", "shell": "true"}
    for field, value in (("memory", "512M"), ("pids", 1.0), ("cpus", "2"), ("memory", True)):
        with pytest.raises(grammar.BadNumber, match=field):
            ExecRequest.from_json({**base, field: value})
    with pytest.raises(grammar.BadText, match="network"):
        ExecRequest.from_json({**base, "network": "wifi"})
    assert ExecRequest.from_json({**base, "memory": 1 << 30}).memory == 1 << 30
    assert TaskRequest.from_json({"readable": ["/opt"], "cpus": 1}).readable == ["/opt"]
    with pytest.raises(BadInput, match="readable"):
        TaskRequest.from_json({"readable": "/opt"})
