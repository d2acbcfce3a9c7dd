"""kill: kill-to-evidence for a fork storm (`sh` starting N `sleep 1000`), per boundary.

Settled: the storm runs with a small timeout and grace 0; once the storm is up (counted in /proc)
the owner's deadline fires, and the receipt says how long stop-to-evidence took
(`timings.stop_to_evidence_s`, and for cgroup2 `death.observed.kill_to_empty_ms`).
Raw baselines in the same run, interleaved: cgroup2 — our own cgroup under the same hierarchy,
`cgroup.kill`, poll `cgroup.events` until `populated 0`, rmdir; pidns — `unshare --pid --fork
--kill-child`, SIGKILL the namespace's init, until it is reaped; subreaper — a helper process
that is a subreaper kills and reaps every descendant until ECHILD (bench/raw_subreaper.py).
Every storm carries a marker in its environment; after each run /proc is scanned for it and any
straggler is killed and counted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from common import (
    BENCH_DIR,
    MARK_ENV,
    distribution,
    end_process,
    fmt,
    header,
    kill_marked,
    log,
    machine,
    marked,
    md_table,
    median,
    settled_rig,
)

KINDS = ("cgroup2", "pidns", "subreaper")
FULL = {"storm": 500, "runs": 5, "timeout_s": 2.0, "grace_s": 0.0}
QUICK = {"storm": 100, "runs": 2, "timeout_s": 2.0, "grace_s": 0.0}
SLEEP_CMDLINE = b"sleep\x001000\x00"
UP_LIMIT_S = 60.0
JOIN_AND_EXEC = ("/bin/sh", "-c", 'echo 0 > "$1/cgroup.procs" && exec /bin/sh -c "$2"', "sh")


def storm_command(n: int) -> str:
    return f"for i in $(seq {n}); do sleep 1000 & done; wait"


def _token(kind: str, i: int, side: str) -> str:
    return f"{os.getpid()}-{kind}-{side}-{i}-{os.urandom(4).hex()}"


def _await_up(count: Callable[[], int], n: int, limit: float) -> float | None:
    """Seconds until count() reaches n, or None if it did not within `limit`."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if count() >= n:
            return time.monotonic() - started
        time.sleep(0.01)
    return None


def _leftovers(token: str) -> int:
    found = kill_marked(token)
    if found:
        log(f"warning: {len(found)} marked process(es) outlived the run; killed them: {found[:10]}")
    return len(found)


# -- settled ----------------------------------------------------------------------------


def _settled_run(rig: Any, kind: str, i: int, p: dict[str, Any]) -> dict[str, Any]:
    token = _token(kind, i, "settled")
    n, timeout = p["storm"], p["timeout_s"]
    try:
        wall0 = time.time()
        admission = rig.exec(
            shell=storm_command(n),
            timeout=timeout,
            grace=p["grace_s"],
            boundary=kind,
            env={MARK_ENV: token},
        )
        up_after = _await_up(
            lambda: len(marked(token, SLEEP_CMDLINE)), n, timeout + 1.0
        )  # a storm not up by the deadline is reported, not hidden
        up_wall = time.time() if up_after is not None else None
        view = rig.runtime.wait(admission.session, timeout=timeout + 120.0)
        done = time.time()
        receipt = view["receipt"]
    finally:
        left = _leftovers(token)
    end_process(receipt["owner"]["pid"], "session owner")
    t = receipt["timings"]
    observed = dict(receipt["death"]["observed"])
    if "reaped_orphans" in observed:
        observed["reaped_orphans"] = len(observed["reaped_orphans"])  # a count, not 100 pids
    up_s = None if up_wall is None else up_wall - t["spawned_at"]
    return {
        "run": i + 1,
        "session": admission.session,
        "storm_up_s_after_spawn": up_s,
        "storm_up_before_timeout": up_s is not None and up_s < timeout,
        "exit": receipt["exit"],
        "death_proven": receipt["death"]["proven"],
        "evidence": receipt["death"]["evidence"],
        "observed": observed,
        "stop_to_evidence_ms": t.get("stop_to_evidence_s", float("nan")) * 1e3,
        "kill_to_empty_ms": observed.get("kill_to_empty_ms"),
        "exec_to_receipt_s": done - wall0,
        "stragglers_in_receipt": len(receipt["stragglers"]),
        "left_after_run": left,
        "owner_maxrss_kib": receipt["owner"]["maxrss_kib"],
        "owner_cpu_s": receipt["owner"]["cpu_s"],
    }


# -- raw baselines ----------------------------------------------------------------------


def _wait_exit(proc: subprocess.Popen[bytes], limit: float) -> None:
    """Block until the child exits (a pidfd, not Popen.wait(timeout)'s 50 ms sleep-poll)."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        if not select.select([pidfd], [], [], limit)[0]:
            raise RuntimeError(f"pid {proc.pid} did not exit within {limit} s")
    finally:
        os.close(pidfd)
    proc.wait(timeout=1)


def _wait_populated_0(events_path: str, limit: float, rekill: Callable[[], None]) -> float:
    """Poll cgroup.events (POLLPRI wakes on change) until `populated 0`; perf_counter then."""
    started = time.perf_counter()
    fd = os.open(events_path, os.O_RDONLY)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        next_rekill = started + 1.0
        while True:
            os.lseek(fd, 0, os.SEEK_SET)
            if b"populated 0" in os.read(fd, 4096):
                return time.perf_counter()
            now = time.perf_counter()
            if now - started > limit:
                raise RuntimeError(f"{events_path} still populated after {limit} s")
            if now >= next_rekill:  # kernels < 6.14: a forking process could escape one kill
                rekill()
                next_rekill = now + 1.0
            poller.poll(50)
    finally:
        os.close(fd)


def _rmdir(path: str, limit: float = 5.0) -> None:
    give_up = time.monotonic() + limit
    while True:
        try:
            os.rmdir(path)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > give_up:
                raise
            time.sleep(0.0005)


def _raw_cgroup2(hierarchy: str, i: int, n: int) -> dict[str, Any]:
    token = _token("cgroup2", i, "raw")
    path = os.path.join(hierarchy, f"settled-bench-raw-{os.getpid()}-{i}")
    os.mkdir(path)
    proc = None
    try:
        proc = subprocess.Popen(
            [*JOIN_AND_EXEC, path, storm_command(n)],
            env={**os.environ, MARK_ENV: token},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def members() -> int:
            with open(os.path.join(path, "cgroup.procs")) as handle:
                return len(handle.read().split())

        up = _await_up(members, n + 1, UP_LIMIT_S)
        if up is None:
            raise RuntimeError(f"raw cgroup2 storm did not come up within {UP_LIMIT_S} s")

        def kill() -> None:
            with open(os.path.join(path, "cgroup.kill"), "w") as handle:
                handle.write("1")

        t0 = time.perf_counter()
        kill()
        empty = _wait_populated_0(os.path.join(path, "cgroup.events"), 30.0, kill) - t0
        _wait_exit(proc, 10.0)
        reaped = time.perf_counter() - t0
        _rmdir(path)
        removed = time.perf_counter() - t0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        left = _leftovers(token)
        if os.path.isdir(path):
            with contextlib.suppress(OSError):
                with open(os.path.join(path, "cgroup.kill"), "w") as handle:
                    handle.write("1")
                _wait_populated_0(os.path.join(path, "cgroup.events"), 10.0, lambda: None)
                _rmdir(path)
            if os.path.isdir(path):
                log(f"warning: could not remove raw cgroup {path}")
    return {
        "run": i + 1,
        "storm_up_s": up,
        "kill_to_empty_ms": empty * 1e3,
        "kill_to_reaped_ms": reaped * 1e3,
        "kill_to_rmdir_ms": removed * 1e3,
        "left_after_run": left,
    }


def _raw_pidns(i: int, n: int) -> dict[str, Any]:
    from settled.boundary import procfs

    token = _token("pidns", i, "raw")
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "/bin/sh", "-c", storm_command(n)],
        env={**os.environ, MARK_ENV: token},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        up = _await_up(lambda: len(marked(token, SLEEP_CMDLINE)), n, UP_LIMIT_S)
        if up is None:
            raise RuntimeError(f"raw pidns storm did not come up within {UP_LIMIT_S} s")
        init = procfs.children(proc.pid)
        if len(init) != 1:
            raise RuntimeError(f"unshare {proc.pid} has children {init}, expected one init")
        t0 = time.perf_counter()
        os.kill(init[0], signal.SIGKILL)
        _wait_exit(proc, 30.0)  # unshare exits once it reaped the init
        reaped = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        left = _leftovers(token)
    return {
        "run": i + 1,
        "storm_up_s": up,
        "kill_to_empty_ms": reaped * 1e3,
        "left_after_run": left,
    }


def _raw_subreaper(i: int, n: int) -> dict[str, Any]:
    token = _token("subreaper", i, "raw")
    helper = os.path.join(BENCH_DIR, "raw_subreaper.py")
    try:
        proc = subprocess.run(
            [sys.executable, "-I", helper, str(n), token, MARK_ENV],
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        left = _leftovers(token)
    if proc.returncode != 0:
        raise RuntimeError(f"raw subreaper helper failed: {proc.stdout} {proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return {"run": i + 1, **result, "left_after_run": left}


# -- the benchmark ----------------------------------------------------------------------


def run(quick: bool) -> tuple[dict[str, Any], str]:
    from settled.boundary import availability
    from settled.boundary.cgroup2 import find_hierarchy

    p = QUICK if quick else FULL
    reasons = availability()
    if reasons.get("pidns") is None and shutil.which("unshare") is None:
        reasons["pidns (raw baseline)"] = "no `unshare` binary for the raw baseline"
    data: dict[str, Any] = {
        "benchmark": "kill",
        "quick": quick,
        "machine": machine(),
        "params": {**p, "command": storm_command(p["storm"])},
        "availability": reasons,
        "boundaries": {},
    }
    with settled_rig("kill") as rig:
        for kind in KINDS:
            if reasons.get(kind) is not None:
                log(f"kill: skipping {kind}: {reasons[kind]}")
                data["boundaries"][kind] = {"skipped": reasons[kind]}
                continue
            settled_runs, raw_runs = [], []
            for i in range(p["runs"]):
                if kind == "cgroup2":
                    raw = _raw_cgroup2(find_hierarchy(), i, p["storm"])
                elif kind == "pidns":
                    raw = _raw_pidns(i, p["storm"])
                else:
                    raw = _raw_subreaper(i, p["storm"])
                raw_runs.append(raw)
                got = _settled_run(rig, kind, i, p)
                settled_runs.append(got)
                log(
                    f"kill {kind} {i + 1}/{p['runs']}: settled stop-to-evidence "
                    f"{got['stop_to_evidence_ms']:.1f} ms (storm up "
                    f"{fmt(got['storm_up_s_after_spawn'])} s after spawn), raw kill-to-empty "
                    f"{raw['kill_to_empty_ms']:.1f} ms, left {got['left_after_run']}"
                    f"+{raw['left_after_run']}"
                )
            data["boundaries"][kind] = _summarize(kind, settled_runs, raw_runs)
    return data, render(data)


def _summarize(kind: str, settled: list[dict[str, Any]], raw: list[dict[str, Any]]) -> dict:
    valid = [r for r in settled if r["storm_up_before_timeout"] and r["death_proven"]]
    stop = [r["stop_to_evidence_ms"] for r in valid]
    k2e = [r["kill_to_empty_ms"] for r in valid if r["kill_to_empty_ms"] is not None]
    raw_empty = [r["kill_to_empty_ms"] for r in raw]
    summary: dict[str, Any] = {
        "settled_runs": settled,
        "raw_runs": raw,
        "valid_settled_runs": len(valid),
        "settled_stop_to_evidence_ms": distribution(stop),
        "settled_kill_to_empty_ms": distribution(k2e),
        "raw_kill_to_empty_ms": distribution(raw_empty),
        "settled_exec_to_receipt_s": distribution([r["exec_to_receipt_s"] for r in valid]),
        "left_after_runs": sum(r["left_after_run"] for r in settled + raw),
        "exit_reasons": sorted({r["exit"]["reason"] for r in settled}),
    }
    if stop and raw_empty:
        summary["ratio_stop_to_evidence_over_raw"] = median(stop) / median(raw_empty)
    if kind == "cgroup2":
        raw_rmdir = [r["kill_to_rmdir_ms"] for r in raw]
        summary["raw_kill_to_rmdir_ms"] = distribution(raw_rmdir)
        if stop:
            summary["ratio_stop_to_evidence_over_raw_rmdir"] = median(stop) / median(raw_rmdir)
        if k2e:
            summary["ratio_kill_to_empty_over_raw"] = median(k2e) / median(raw_empty)
    return summary


RAW_LABEL = {
    "cgroup2": "cgroup.kill → populated 0 (rmdir after)",
    "pidns": "SIGKILL ns init → init reaped (unshare exits)",
    "subreaper": "SIGKILL all descendants + reap → ECHILD, none left",
}


def render(data: dict[str, Any]) -> str:
    p = data["params"]
    rows, detail = [], []
    for kind in KINDS:
        b = data["boundaries"].get(kind, {})
        if "skipped" in b:
            rows.append([kind, "skipped: " + b["skipped"], *[""] * 8])
            continue
        if not b:
            continue
        stop, raw = b["settled_stop_to_evidence_ms"], b["raw_kill_to_empty_ms"]
        k2e = b["settled_kill_to_empty_ms"]
        raw_extra = ""
        if kind == "cgroup2":
            raw_extra = f" (→ rmdir {fmt(b['raw_kill_to_rmdir_ms']['p50'], 1)})"
        rows.append(
            [
                kind,
                f"{b['valid_settled_runs']}/{len(b['settled_runs'])}",
                fmt(stop.get("p50"), 1),
                fmt(stop.get("max"), 1),
                fmt(k2e.get("p50"), 1) if k2e["n"] else "-",
                f"{fmt(raw.get('p50'), 1)}{raw_extra}",
                fmt(raw.get("max"), 1),
                fmt(b.get("ratio_stop_to_evidence_over_raw")),
                fmt(b["settled_exec_to_receipt_s"].get("p50"), 2),
                b["left_after_runs"],
            ]
        )
        for r, w in zip(b["settled_runs"], b["raw_runs"], strict=True):
            detail.append(
                [
                    kind,
                    r["run"],
                    fmt(r["storm_up_s_after_spawn"]),
                    "yes" if r["storm_up_before_timeout"] else "**no**",
                    r["exit"]["reason"],
                    fmt(r["stop_to_evidence_ms"], 1),
                    fmt(r["kill_to_empty_ms"], 1) if r["kill_to_empty_ms"] is not None else "-",
                    r["stragglers_in_receipt"],
                    fmt(w["storm_up_s"]),
                    fmt(w["kill_to_empty_ms"], 1),
                    r["left_after_run"] + w["left_after_run"],
                ]
            )
    notes = [f"- raw `{k}`: {v}" for k, v in RAW_LABEL.items()]
    return "\n\n".join(
        [
            header("kill", data),
            f"A fork storm `{p['command']}` under settled with `timeout={p['timeout_s']}` s, "
            f"`grace={p['grace_s']}` s; stop-to-evidence is the receipt's "
            f"`timings.stop_to_evidence_s` (deadline fired → TERM to all → KILL → evidence), "
            f"kill-to-empty is `death.observed.kill_to_empty_ms` (cgroup2 only). Raw baselines "
            f"run in the same process, interleaved, {p['runs']} runs each. ms unless noted; "
            f"ratio = settled stop-to-evidence p50 / raw p50. 'left' counts marked processes "
            f"found alive after a run (and killed): it must be 0.",
            md_table(
                [
                    "boundary",
                    "valid runs",
                    "settled stop→evidence p50",
                    "max",
                    "settled kill→empty p50",
                    "raw p50",
                    "raw max",
                    "ratio",
                    "exec→receipt s p50",
                    "left",
                ],
                rows,
            ),
            "\n".join(notes),
            "Every run:",
            md_table(
                [
                    "boundary",
                    "run",
                    "storm up s after spawn",
                    "up before timeout",
                    "exit",
                    "stop→evidence",
                    "kill→empty",
                    "stragglers in receipt",
                    "raw storm up s",
                    "raw kill→empty",
                    "left",
                ],
                detail,
            ),
        ]
    )
