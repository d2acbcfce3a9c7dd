"""The close says what a task's pod held, outside its checkpoint, and then ends the pod.

A task's sessions share its own /tmp, /var/tmp, /dev/shm and HOME and its IPC, UTS, network and
user namespaces (tests/test_view.py, tests/test_podns.py). None of it is the workspace, so the
close receipt states what each held and that it was discarded, and the pod is released: no
directory, namespace mount or record of it is left to be used again. What a command left there
is hostile: names that are not UTF-8 cannot stop a close, and a flood of files cannot hold it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import COMMAND_PYTHON

from settled.boundary import pod as pod_module
from settled.boundary import poddirs, podhost
from settled.records import TaskRecord
from settled.runtime import Runtime

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pods need root")

MSGGET = (
    "import ctypes; libc = ctypes.CDLL(None); "
    "assert libc.msgget(0x5e77, 0o1600) >= 0"  # IPC_CREAT | 0600
)


def run(rt: Runtime, task: TaskRecord, shell: str) -> None:
    admission = rt.exec(task.task, shell=shell)
    view = rt.wait(admission.session, timeout=60)
    assert view["receipt"]["exit"]["code"] == 0, rt.read(admission.session, "stderr")


def test_the_close_names_what_the_pod_held_and_then_ends_it(rt: Runtime, task: TaskRecord) -> None:
    run(
        rt,
        task,
        "printf 12345 > /tmp/left.txt && mkdir -p $HOME/.cache && printf 678 > $HOME/.cache/c "
        f"&& : > /dev/shm/seg && {COMMAND_PYTHON} -c '{MSGGET}' && touch in-workspace",
    )
    assert podhost.find(rt.home, task.task) is not None
    receipt = rt.close_task(task.task).receipt
    assert receipt is not None
    held = receipt["pod"]
    assert held["covered_by_checkpoint"] is False and "discarded" in held["fate"]
    directories = held["directories"]
    # (the workspace lies under the host's /tmp here, so its mount point is made in the pod's)
    assert "left.txt" in directories["/tmp"]["names"] and directories["/tmp"]["bytes"] == 5
    assert directories["HOME"]["bytes"] == 3 and directories["HOME"]["entries"] == 2
    assert directories["/dev/shm"]["names"] == ["seg"]
    assert all(d["complete"] for d in directories.values())
    assert held["namespaces"]["sysv"]["message_queues"] == 1
    assert held["namespaces"]["hostname"] == task.task
    # ended: nothing of the pod is left to be used again; the workspace is the checkpoint's
    assert not os.path.exists(poddirs.pod_path(rt.home, task.task))
    assert podhost.find(rt.home, task.task) is None
    assert not [line for line in podhost.mounts(rt.home) if f"/{task.task}/" in line]
    assert Path(task.workspace, "in-workspace").exists()
    again = rt.close_task(task.task).receipt  # a retried close: the same receipt
    assert again == receipt


def test_names_that_are_not_text_and_a_flood_of_files_cannot_hold_the_close(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pod_module, "WALK_BUDGET", 50)
    run(
        rt,
        task,
        "printf x > \"/tmp/$(printf 'bad\\377name')\" && mkdir /tmp/flood && "
        "for i in $(seq 1 200); do : > /tmp/flood/f$i; done",
    )
    closed = rt.close_task(task.task)
    assert closed.complete
    tmp = closed.receipt["pod"]["directories"]["/tmp"]  # type: ignore[index]
    assert "bad\\xffname" in tmp["names"]
    assert tmp["complete"] is False and tmp["entries"] == 50


def test_task_destroy_ends_the_pods_namespaces_and_keeps_its_files_until_close(
    rt: Runtime, task: TaskRecord
) -> None:
    run(rt, task, f"echo kept > /tmp/kept && {COMMAND_PYTHON} -c '{MSGGET}'")
    rt.destroy_task(task.task)
    assert podhost.find(rt.home, task.task) is None  # released: a next session gets a new one
    assert Path(poddirs.pod_path(rt.home, task.task), "tmp", "kept").read_text() == "kept\n"
    admission = rt.exec(task.task, shell="cat /tmp/kept; ipcs -q | grep -c 0x00005e77 || true")
    rt.wait(admission.session, timeout=60)
    assert rt.read(admission.session, "stdout") == b"kept\n0\n"
    receipt = rt.store.get_session(admission.session).receipt
    assert receipt is not None and receipt["isolation"]["pod"]["state"] == "recreated"


def test_a_home_whose_tasks_are_all_closed_keeps_no_mount(rt: Runtime, tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, two = rt.new_task(str(tmp_path / "one")), rt.new_task(str(tmp_path / "two"))
    run(rt, one, "true")
    run(rt, two, "true")
    pin = podhost.pin_path(rt.home)
    assert rt.close_task(one.task).complete
    assert podhost.mounts(rt.home), "task two still holds its pod: the namespace stays"
    assert rt.close_task(two.task).complete
    assert podhost.mounts(rt.home) == []
    with open("/proc/self/mountinfo") as handle:
        assert not [line for line in handle if rt.home in line.split()[4]], pin
