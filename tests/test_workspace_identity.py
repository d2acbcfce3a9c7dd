"""The workspace is the directory that was bound, and overlap is by identity, not by path.

Issue 36: `task new` records the root's device and inode and those of the directories that hold
it (workspace/rootid.py). A root replaced since (a symlink to elsewhere, another directory
renamed into its place) fails the close's final scan with WorkspaceReplaced and refuses a
command's launch, until the directory is back; a bind mount of a task's workspace (or of a
subdirectory of it), a symlinked path to it or a second mount of its filesystem is refused
as an overlap unless `--shared-workspace`, and then both close receipts name each other.

Real mounts as root (`mount --bind`, a tmpfs), each unmounted in a `finally`, all under tmp_path.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import mounted_tmpfs

from settled.errors import EXIT_BLOCKED, WorkspaceOverlap, WorkspaceReplaced
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.workspace import rootid
from settled.workspace.scan import scan

SETTLED = [sys.executable, "-m", "settled.cli"]
MOUNT_TIMEOUT_S = 30


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=MOUNT_TIMEOUT_S)


@contextlib.contextmanager
def bound(source: Path, target: Path) -> Iterator[Path]:
    """`source` bind-mounted at `target` (made here), unmounted whatever happens."""
    target.mkdir(parents=True, exist_ok=True)
    _run("mount", "--bind", str(source), str(target))
    try:
        yield target
    finally:
        _run("umount", str(target))


@pytest.fixture(params=["ext4", "tmpfs"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """Where the workspaces are made: tmp_path itself (ext4 here), or a tmpfs mounted in it."""
    if request.param == "ext4":
        yield tmp_path / "on-disk"
        return
    with mounted_tmpfs(tmp_path / "tmpfs", "16m") as mounted:
        yield mounted


def close(rt: Runtime, task: TaskRecord) -> dict[str, Any]:
    result = rt.close_task(task.task, deadline=20)
    assert result.complete, result.blocked_on
    assert result.receipt is not None
    return result.receipt


def new_workspace(at: Path) -> str:
    at.mkdir(parents=True)
    (at / "work.txt").write_text("the task's own")
    return str(at)


# --- the root is the directory that was bound ------------------------------------------------


def test_task_new_records_the_roots_identity_and_what_holds_it(rt: Runtime, tmp_path: Path) -> None:
    workspace = new_workspace(tmp_path / "ws")
    task = rt.new_task(workspace)
    st = os.stat(workspace)
    assert task.workspace_identity is not None
    assert (task.workspace_identity["dev"], task.workspace_identity["ino"]) == (
        st.st_dev,
        st.st_ino,
    )
    held_by = [tuple(pair) for pair in task.workspace_identity["ancestors"]]
    for above in (tmp_path, Path("/")):
        assert (os.stat(above).st_dev, os.stat(above).st_ino) in held_by
    assert rt.store.get_task(task.task).workspace_identity == task.workspace_identity


def test_a_workspace_replaced_by_a_symlink_fails_the_close_until_it_is_back(
    rt: Runtime, tmp_path: Path
) -> None:
    workspace = new_workspace(tmp_path / "ws")
    elsewhere = new_workspace(tmp_path / "elsewhere")
    task = rt.new_task(workspace)
    os.rename(workspace, tmp_path / "kept")
    os.symlink(elsewhere, workspace)
    with pytest.raises(WorkspaceReplaced) as caught:
        rt.close_task(task.task, deadline=20)
    assert caught.value.workspace == workspace and caught.value.why == "a symlink"
    assert workspace in str(caught.value) and caught.value.exit_code == EXIT_BLOCKED
    assert "final_scan" not in rt.store.close_steps(task.task)  # the close stays there
    os.unlink(workspace)
    os.rename(tmp_path / "kept", workspace)
    receipt = close(rt, task)  # the same close, resumed at its final scan
    assert receipt["final_scan"]["entries"] >= 1


def test_a_workspace_replaced_by_another_directory_fails_the_close_until_it_is_back(
    rt: Runtime, tmp_path: Path
) -> None:
    workspace = new_workspace(tmp_path / "ws")
    task = rt.new_task(workspace)
    os.rename(workspace, tmp_path / "kept")
    impostor = new_workspace(tmp_path / "impostor")
    os.rename(impostor, workspace)
    with pytest.raises(WorkspaceReplaced) as caught:
        rt.close_task(task.task, deadline=20)
    st = os.stat(workspace)
    assert caught.value.found == (st.st_dev, st.st_ino)
    assert caught.value.why == "another directory"
    assert caught.value.to_json()["recorded"] == {
        "dev": task.workspace_identity["dev"],  # type: ignore[index]
        "ino": task.workspace_identity["ino"],  # type: ignore[index]
    }
    os.rename(workspace, tmp_path / "impostor")
    os.rename(tmp_path / "kept", workspace)
    assert close(rt, task)["outcome"]["complete"] is True


def test_the_cli_close_of_a_replaced_workspace_exits_blocked_naming_it(
    rt: Runtime, tmp_path: Path
) -> None:
    workspace = new_workspace(tmp_path / "ws")
    task = rt.new_task(workspace)
    os.rename(workspace, tmp_path / "kept")
    os.mkdir(workspace)
    done = subprocess.run(
        [*SETTLED, "--home", rt.home, "close", task.task, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_BLOCKED, done.stderr
    answer = json.loads(done.stdout or done.stderr)
    assert answer["error"] == "WorkspaceReplaced" and answer["workspace"] == workspace


def test_a_command_is_not_launched_in_a_replaced_workspace(rt: Runtime, tmp_path: Path) -> None:
    workspace = new_workspace(tmp_path / "ws")
    task = rt.new_task(workspace)
    os.rename(workspace, tmp_path / "kept")
    os.rename(new_workspace(tmp_path / "impostor"), workspace)
    admission = rt.exec(task.task, shell="echo written > out.txt", key="in-the-impostor")
    session = rt.wait(admission.session, timeout=60)
    exit_fact = session["receipt"]["exit"]
    if exit_fact.get("stage") != "isolation":
        pytest.skip(f"no mount namespace here: {exit_fact}")
    assert exit_fact["reason"] == "not_started" and workspace in exit_fact["error"]
    assert "not the directory bound at task new" in exit_fact["error"]
    assert not Path(workspace, "out.txt").exists()


def test_a_scan_given_the_recorded_identity_scans_that_directory_or_nothing(
    tmp_path: Path,
) -> None:
    workspace = new_workspace(tmp_path / "ws")
    identity = rootid.recorded(rootid.read(workspace))
    assert identity is not None
    assert scan(workspace, expect=identity).index.count >= 1
    other = new_workspace(tmp_path / "other")
    with pytest.raises(WorkspaceReplaced, match="another directory"):
        scan(other, expect=identity)
    link = tmp_path / "link"
    link.symlink_to(workspace)
    with pytest.raises(WorkspaceReplaced, match="a symlink"):
        scan(str(link), expect=identity)
    with pytest.raises(WorkspaceReplaced, match="found nothing;"):
        scan(str(tmp_path / "gone"), expect=identity)
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(WorkspaceReplaced, match="found not a directory;"):
        scan(str(tmp_path / "a-file"), expect=identity)


# --- overlap by identity ---------------------------------------------------------------------


def test_a_bind_mount_of_a_tasks_workspace_is_refused_as_an_overlap(
    rt: Runtime, base: Path
) -> None:
    first = rt.new_task(new_workspace(base / "a"))
    with bound(Path(first.workspace), base / "bound") as other:
        with pytest.raises(WorkspaceOverlap) as caught:
            rt.new_task(str(other))
        assert caught.value.others == [(first.task, first.workspace)]
        assert first.task in str(caught.value)


def test_a_shared_bind_mount_is_allowed_and_both_close_receipts_name_the_other(
    rt: Runtime, base: Path
) -> None:
    first = rt.new_task(new_workspace(base / "a"))
    with bound(Path(first.workspace), base / "bound") as other:
        second = rt.new_task(str(other), shared_workspace=True)
        second_receipt = close(rt, second)
    first_receipt = close(rt, first)
    assert second_receipt["workspace"]["shared_with"] == [first.task]
    assert first_receipt["workspace"]["shared_with"] == [second.task]


def test_a_symlinked_path_to_a_tasks_workspace_is_refused_as_an_overlap(
    rt: Runtime, base: Path
) -> None:
    first = rt.new_task(new_workspace(base / "a"))
    link = base / "link"
    link.symlink_to(first.workspace)
    with pytest.raises(WorkspaceOverlap) as caught:
        rt.new_task(str(link))
    assert caught.value.others == [(first.task, first.workspace)]


def test_a_bind_mount_of_a_subdirectory_of_a_tasks_workspace_is_refused(
    rt: Runtime, base: Path
) -> None:
    first = rt.new_task(new_workspace(base / "a"))
    inner = Path(first.workspace, "deep", "inner")
    inner.mkdir(parents=True)
    with bound(inner, base / "bound-inner") as other, pytest.raises(WorkspaceOverlap) as caught:
        rt.new_task(str(other))
    assert caught.value.others == [(first.task, first.workspace)]


def test_a_directory_holding_a_bind_mounted_tasks_workspace_is_refused(
    rt: Runtime, base: Path
) -> None:
    """Task A's workspace is reached through a bind mount of a directory elsewhere: a new task
    on the directory that really holds it overlaps, though no path says so."""
    (base / "data" / "a").mkdir(parents=True)
    with bound(base / "data" / "a", base / "mnt" / "a") as seen:
        first = rt.new_task(str(seen))
        with pytest.raises(WorkspaceOverlap) as caught:
            rt.new_task(str(base / "data"))
        assert caught.value.others == [(first.task, first.workspace)]
        rt.close_task(first.task, deadline=20)


def test_a_second_mount_of_the_same_tmpfs_is_refused_as_an_overlap(
    rt: Runtime, tmp_path: Path
) -> None:
    with mounted_tmpfs(tmp_path / "fs", "16m") as mounted:
        first = rt.new_task(new_workspace(mounted / "a"))
        with bound(mounted, tmp_path / "again") as again:
            with pytest.raises(WorkspaceOverlap):
                rt.new_task(str(again / "a"))
            with pytest.raises(WorkspaceOverlap):
                rt.new_task(str(again))
        close(rt, first)


def test_disjoint_directories_of_one_filesystem_do_not_overlap(rt: Runtime, base: Path) -> None:
    first = rt.new_task(new_workspace(base / "a"))
    second = rt.new_task(new_workspace(base / "b"))
    assert rt.store.workspace_shares(first.task) == rt.store.workspace_shares(second.task) == []
