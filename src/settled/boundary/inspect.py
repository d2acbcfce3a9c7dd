"""Inspecting and killing a boundary whose owner is gone: the evidence recovery can get.

A cgroup that still exists is killed and watched to `populated 0`, then removed; a cgroup that
no longer exists was removed after it was empty (the kernel refuses to rmdir a populated one).
A PID-namespace init recorded by pid and start time is killed; once it is a zombie or gone, the
kernel has killed every member. A subreaper or a process group whose owner died gives nothing:
its orphans went to init, and no one can enumerate them.
"""

from __future__ import annotations

import contextlib
import errno
import json
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


# What a cgroup file answers once its cgroup was removed while we held its path (its owner, or
# another recovery, removed it first): ENOENT on open, ENODEV on a read of an open file.
_GONE = (errno.ENOENT, errno.ENODEV)


def _gone(path: str) -> Evidence:
    return Evidence(
        "cgroup2",
        True,
        f"cgroup {path} no longer exists: it was removed after it was empty, and the kernel "
        "refuses to remove a populated cgroup",
        {"cgroup": path, "existed": False},
    )


def _kill_once(path: str) -> bool | None:
    """Write cgroup.kill once; whether the cgroup is still populated, or None once it is gone."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as handle:
            handle.write("1")
        return _populated(path)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise


def kill_cgroup(path: str) -> Evidence:
    """Kill everything in the cgroup and remove it. A cgroup removed by someone else meanwhile
    (its owner settling, a second destroy) is the same evidence as one already gone: the
    kernel removes only an empty cgroup."""
    if not os.path.isdir(path):
        return _gone(path)
    started = time.monotonic()
    rounds = 0
    while True:
        rounds += 1
        populated = _kill_once(path)
        if populated is None:
            return _gone(path)
        if not populated:
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
    """Remove the cgroup and any child cgroups (a task's sandbox holds its sessions'). A child
    that its own owner removed meanwhile is skipped: only `path` itself being gone means done
    (taking a vanished child for it left the task's cgroup behind and claimed its rmdir)."""
    for _ in range(500):
        try:
            for below, dirs, _files in os.walk(path, topdown=False):
                for name in dirs:
                    with contextlib.suppress(FileNotFoundError):
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
    return kill_init(pid, start)


def kill_init(pid: int, start: int | None) -> Evidence:
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


def _namespace_init_in(path: str) -> tuple[int | None, int | None]:
    """The process of this cgroup that is pid 1 of its own PID namespace (NSpid ends in 1)."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as handle:
            pids = [int(p) for p in handle.read().split()]
    except FileNotFoundError:
        return None, None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as handle:
                nspid = next((line.split()[1:] for line in handle if line.startswith("NSpid:")), [])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if len(nspid) > 1 and nspid[-1] == "1":
            return pid, procfs.start_time(pid)
    return None, None


def kill_cgroup_pidns(ref: str | None, fallback_path: str | None) -> Evidence:
    """Both halves of a cgroup2+pidns session: its namespace's init killed (the kernel kills
    every member before init's exit completes, wherever their cgroup is) and its cgroup killed
    to `populated 0` and removed. Init joins the cgroup before it forks anything, so an init
    the owner died before recording is found in the cgroup; a cgroup with no init in it held
    no process of the command, or none left."""
    fields = json.loads(ref) if ref else {}
    path = fields.get("cgroup") or fallback_path
    if path is None:
        return Evidence("cgroup2+pidns", False, None, {"why": "cgroup2 is not available"})
    init, start = fields.get("init"), fields.get("start")
    if init is None:
        init, start = _namespace_init_in(path)
    pidns = kill_init(init, start) if init is not None else None
    cgroup = kill_cgroup(path)
    proven = cgroup.proven and (pidns is None or pidns.proven)
    words = [e.evidence for e in (pidns, cgroup) if e is not None and e.evidence]
    observed = {**(pidns.observed if pidns else {"init_pid": None}), **cgroup.observed}
    return Evidence("cgroup2+pidns", proven, "; ".join(words) if proven else None, observed)
