"""Workspaces are checked (issue 12, item 6): `task new` refuses a workspace that cannot be
right, naming the path and why, and records nothing; overlapping another open task's workspace
is allowed only when asked for, and then both close receipts name each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from settled.errors import BadInput, WorkspaceOverlap
from settled.runtime import Runtime
from settled.workspace.placement import WorkspaceRefused, filesystem_type

SETTLED = [sys.executable, "-m", "settled.cli"]


def _tasks(rt: Runtime) -> int:
    return int(rt.store._db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])  # type: ignore[attr-defined]


def _refused(rt: Runtime, workspace: str, why: str) -> WorkspaceRefused:
    before = _tasks(rt)
    with pytest.raises(WorkspaceRefused) as caught:
        rt.new_task(workspace)
    assert workspace in str(caught.value) and why in str(caught.value), caught.value
    assert isinstance(caught.value, BadInput) and caught.value.exit_code == 2
    assert _tasks(rt) == before  # nothing recorded
    return caught.value


def _dir(tmp_path: Path, *parts: str) -> str:
    path = tmp_path.joinpath(*parts)
    path.mkdir(parents=True)
    return str(path)


# -- what cannot be right ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workspace", "why"),
    [("/proc", "/proc"), ("/proc/self/fdinfo", "/proc"), ("/dev", "/dev"), ("/sys", "/sys")],
)
def test_a_kernel_tree_is_refused(rt: Runtime, workspace: str, why: str) -> None:
    _refused(rt, workspace, why)


def test_the_cgroup_filesystem_is_refused(rt: Runtime) -> None:
    path = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    if not os.path.isdir(path):
        pytest.skip("no cgroup filesystem mounted at /sys/fs/cgroup on this machine")
    _refused(rt, path, "/sys")
    assert filesystem_type(path) in ("cgroup", "cgroup2", "tmpfs")


def test_dev_is_devtmpfs_and_proc_is_proc_by_mountinfo() -> None:
    assert filesystem_type("/proc/self") == "proc"
    if filesystem_type("/dev") != "devtmpfs":
        pytest.skip(f"/dev is {filesystem_type('/dev')} here, not devtmpfs")


@pytest.fixture
def proc_mount(tmp_path: Path) -> Iterator[str]:
    """A proc filesystem mounted outside the kernel trees, so only its type can refuse it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a proc filesystem needs root")
    point = _dir(tmp_path, "elsewhere", "proc")
    done = subprocess.run(["mount", "-t", "proc", "proc", point], capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount proc here: {done.stderr.decode().strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


def test_a_pseudo_filesystem_is_refused_by_its_type_wherever_it_is_mounted(
    rt: Runtime, proc_mount: str
) -> None:
    assert filesystem_type(proc_mount) == "proc"
    _refused(rt, proc_mount, "on a proc filesystem")
    _refused(rt, os.path.join(proc_mount, "self"), "on a proc filesystem")


def test_root_itself_is_refused(rt: Runtime) -> None:
    _refused(rt, "/", "it is / itself")


def test_the_home_is_refused(rt: Runtime) -> None:
    _refused(rt, rt.home, "it is the settled home")


@pytest.mark.parametrize("inside", ["sessions", "run", "mine", "workspaces"])
def test_a_path_inside_the_home_is_refused(rt: Runtime, inside: str) -> None:
    path = os.path.join(rt.home, inside)
    os.makedirs(path, exist_ok=True)
    _refused(rt, path, "inside the settled home")


def test_a_path_deeper_in_the_default_workspaces_is_refused(rt: Runtime) -> None:
    default = rt.new_task().workspace
    _refused(rt, _dir(Path(default), "sub"), "inside the settled home")


def test_a_path_containing_the_home_is_refused(rt: Runtime, tmp_path: Path) -> None:
    _refused(rt, str(tmp_path), "it contains the settled home")


def test_the_default_workspace_is_made_in_the_home_and_allowed(rt: Runtime) -> None:
    task = rt.new_task()
    assert os.path.dirname(task.workspace) == os.path.join(rt.home, "workspaces")
    assert os.path.isdir(task.workspace)
    assert rt.new_task().workspace != task.workspace  # each its own


def test_a_symlink_to_a_refused_place_is_refused_by_where_it_leads(
    rt: Runtime, tmp_path: Path
) -> None:
    link = tmp_path / "innocent"
    link.symlink_to("/proc")
    _refused(rt, str(link), "/proc")


# -- overlapping another open task ------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside", "containing"])
def test_overlapping_an_open_tasks_workspace_is_refused_naming_it(
    rt: Runtime, tmp_path: Path, where: str
) -> None:
    outer = _dir(tmp_path, "outer")
    inner = _dir(tmp_path, "outer", "inner")
    first = rt.new_task({"same": outer, "inside": outer, "containing": inner}[where])
    second = {"same": outer, "inside": inner, "containing": outer}[where]
    before = _tasks(rt)
    with pytest.raises(WorkspaceOverlap) as caught:
        rt.new_task(second)
    message = str(caught.value)
    assert second in message and first.task in message and "--shared-workspace" in message
    assert caught.value.to_json()["overlaps"] == [
        {"task": first.task, "workspace": first.workspace}
    ]
    assert _tasks(rt) == before


def test_a_sibling_with_a_common_prefix_does_not_overlap(rt: Runtime, tmp_path: Path) -> None:
    rt.new_task(_dir(tmp_path, "ws"))
    rt.new_task(_dir(tmp_path, "ws2"))  # /…/ws2 is not inside /…/ws


def test_the_same_key_again_returns_its_task_not_an_overlap(rt: Runtime, tmp_path: Path) -> None:
    workspace = _dir(tmp_path, "ws")
    first = rt.new_task(workspace, "k1")
    assert rt.new_task(workspace, "k1") == first


@pytest.mark.timeout(120)
def test_the_workspace_is_free_again_once_the_other_task_closed(
    rt: Runtime, tmp_path: Path
) -> None:
    workspace = _dir(tmp_path, "ws")
    first = rt.new_task(workspace)
    with pytest.raises(WorkspaceOverlap):
        rt.new_task(workspace)
    assert rt.close_task(first.task).complete
    second = rt.new_task(workspace)
    assert second.task != first.task and second.shared_workspace is False
    receipt = rt.close_task(second.task).receipt
    assert receipt is not None and receipt["workspace"]["shared_with"] == []


def test_two_tasks_racing_for_one_workspace_get_one(tmp_path: Path, rt: Runtime) -> None:
    workspace = _dir(tmp_path, "ws")
    results: list[object] = [None] * 4
    barrier = threading.Barrier(4)

    def create(index: int) -> None:
        with Runtime(rt.home) as runtime:
            barrier.wait(timeout=30)
            try:
                results[index] = runtime.new_task(workspace)
            except WorkspaceOverlap as exc:
                results[index] = exc

    threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(not isinstance(r, WorkspaceOverlap) for r in results) == 1, results


@pytest.mark.timeout(180)
def test_a_shared_workspace_is_accepted_and_both_close_receipts_name_each_other(
    rt: Runtime, tmp_path: Path
) -> None:
    outer = _dir(tmp_path, "outer")
    first = rt.new_task(outer)
    second = rt.new_task(_dir(tmp_path, "outer", "inner"), shared_workspace=True)
    assert second.shared_workspace is True and first.shared_workspace is False
    third = rt.new_task(_dir(tmp_path, "alone"))
    for task in (first, second):
        rt.wait(rt.exec(task.task, shell=f"echo {task.task} > {task.task}").session)
    one, two, alone = (rt.close_task(t.task).receipt for t in (first, second, third))
    assert one is not None and two is not None and alone is not None
    assert one["workspace"] == {
        "path": first.workspace,
        "shared_workspace": False,
        "shared_with": [second.task],
    }
    assert two["workspace"]["shared_with"] == [first.task]
    assert two["workspace"]["shared_workspace"] is True
    assert alone["workspace"]["shared_with"] == []
    words = rt.explain(first.task)["words"]
    assert f"shared with task(s) {second.task}" in words


# -- the faces --------------------------------------------------------------------------------


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SETTLED_HOME": str(home)}
    return subprocess.run([*SETTLED, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.timeout(180)
def test_the_cli_refuses_with_exit_2_and_takes_shared_workspace(tmp_path: Path) -> None:
    home = tmp_path / "home"
    workspace = _dir(tmp_path, "ws")
    refused = _cli(home, "task", "new", "--workspace", "/proc", "--json")
    assert refused.returncode == 2
    body = json.loads(refused.stdout)
    assert body["error"] == "WorkspaceRefused" and body["workspace"] == "/proc"
    first = json.loads(_cli(home, "task", "new", "--workspace", workspace, "--json").stdout)
    overlap = _cli(home, "task", "new", "--workspace", workspace, "--json")
    assert overlap.returncode == 2 and json.loads(overlap.stdout)["error"] == "WorkspaceOverlap"
    shared = _cli(home, "task", "new", "--workspace", workspace, "--shared-workspace", "--json")
    assert shared.returncode == 0, shared.stderr
    second = json.loads(shared.stdout)
    assert second["shared_workspace"] is True
    closed = json.loads(_cli(home, "close", second["task"], "--json").stdout)
    assert closed["workspace"]["shared_with"] == [first["task"]]
    closed = json.loads(_cli(home, "close", first["task"], "--json").stdout)
    assert closed["workspace"]["shared_with"] == [second["task"]]
