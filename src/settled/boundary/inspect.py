"""Inspecting and killing a boundary whose owner is gone: the evidence recovery can get.

A cgroup that still exists is killed and watched to `populated 0`, then removed; a cgroup that
no longer exists was removed after it was empty (the kernel refuses to rmdir a populated one).
A PID-namespace init recorded by pid and start time is killed; once it is a zombie or gone, the
kernel has killed every member. A subreaper or a process group whose owner died gives nothing:
its orphans went to init, and no one can enumerate them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from settled.boundary import procfs
from settled.boundary.base import Evidence
from settled.boundary.cgroup2 import ROOT_DIR_NAME, find_hierarchy

KILL_TIMEOUT_S = 30.0


def cgroup_path_of(task: str, session: str) -> str | None:
    """Where an owner of this session would have made its cgroup (also before it recorded it)."""
    try:
        return os.path.join(find_hierarchy(), ROOT_DIR_NAME, task, session)
    except Exception:
        return None


def _populated(path: str) -> bool:
    with open(os.path.join(path, "cgroup.events")) as handle:
        return "populated 1" in handle.read()


def kill_cgroup(path: str) -> Evidence:
    if not os.path.isdir(path):
        return Evidence(
            "cgroup2",
            True,
            f"cgroup {path} no longer exists: it was removed after it was empty, and the kernel "
            "refuses to remove a populated cgroup",
            {"cgroup": path, "existed": False},
        )
    started = time.monotonic()
    rounds = 0
    while True:
        rounds += 1
        with open(os.path.join(path, "cgroup.kill"), "w") as handle:
            handle.write("1")
        if not _populated(path):
            break
        if time.monotonic() - started > KILL_TIMEOUT_S:
            return Evidence("cgroup2", False, None, {"cgroup": path, "populated": 1})
        time.sleep(0.001)
    removed = _rmdir_retrying(path)
    for parent in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        with contextlib.suppress(OSError):
            os.rmdir(parent)
    return Evidence(
        "cgroup2",
        removed,
        f"recovery: cgroup.kill x{rounds}; cgroup.events populated 0; rmdir {path}"
        if removed
        else None,
        {
            "cgroup": path,
            "existed": True,
            "kill_rounds": rounds,
            "kill_to_empty_ms": round((time.monotonic() - started) * 1000, 3),
            "rmdir": removed,
        },
    )


def _rmdir_retrying(path: str) -> bool:
    """Remove the cgroup and any child cgroups (a task's sandbox holds its sessions')."""
    for _ in range(500):
        try:
            for below, dirs, _files in os.walk(path, topdown=False):
                for name in dirs:
                    os.rmdir(os.path.join(below, name))
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.002)
    return False


def parse_pidns_ref(ref: str) -> tuple[int, int | None]:
    fields = dict(part.split("=", 1) for part in ref.split(":")[1:])
    start = fields.get("start")
    return int(fields["init"]), (int(start) if start and start != "None" else None)


def kill_pidns_init(ref: str) -> Evidence:
    pid, start = parse_pidns_ref(ref)
    observed: dict[str, object] = {"init_pid": pid, "init_start_time": start}
    if start is None:
        return Evidence("pidns", False, None, {**observed, "why": "init start time unrecorded"})
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while procfs.start_time(pid) == start and procfs.state_of(pid) != "Z":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return Evidence("pidns", False, None, observed)
        time.sleep(0.002)
    return Evidence(
        "pidns",
        True,
        f"recovery: init {pid} (start {start}) of the PID namespace is dead; the kernel kills "
        "every member before init's exit completes",
        observed,
    )
