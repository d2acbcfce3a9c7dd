"""drain: 1 GiB through settled (exec to receipt) against `head | cat > FILE && sync FILE`.

Like with like: settled fsyncs its log before the receipt, so the baseline fsyncs its file too,
on the same filesystem (both live in one scratch dir under /tmp). Each round runs baseline, then
settled in this process (`Runtime.exec` until `Runtime.wait` returns the receipt), then settled
through the CLI as an agent would (`settled exec --json` then `settled wait --json`, each a new
process); the page cache is flushed (`sync`) before each. A second part runs one 256 MiB line of
non-zero bytes to show the owner's memory stays flat without newlines. A third measures how long
a byte the command writes takes to reach a follower (`Runtime.follow`; `settled logs --follow` in
its own process; a follower that polls as the relay did before events, 2-50 ms doubling), against
the same byte read from a plain pipe.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from common import (
    distribution,
    end_process,
    fmt,
    fs_of,
    header,
    log,
    machine,
    md_table,
    median,
    percentile,
    settled_rig,
    source_revision,
)
from drain_raw import KINDS, drain_once

RATIO_TARGET = 1.1  # the goal, through the CLI
RSS_TARGET_MIB = 64
FULL = {
    "size": "1G", "bytes": 1 << 30, "runs": 9, "line": "256M", "line_bytes": 256 << 20,
    "wake_samples": 200, "wake_gap_s": 0.05, "raw_runs": 9,
}  # fmt: skip
QUICK = {
    "size": "64M", "bytes": 64 << 20, "runs": 3, "line": "16M", "line_bytes": 16 << 20,
    "wake_samples": 40, "wake_gap_s": 0.01, "raw_runs": 1,
}  # fmt: skip
WAIT_S = 600.0
CLI = os.path.join(os.path.dirname(sys.executable), "settled")


class IoSampler:
    """Samples /proc/PID/io of the owner every 10 ms: read syscalls and bytes, so the mean
    read size of the drain is known (the last sample falls just before the owner exits)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        if pid is not None:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with open(f"/proc/{self.pid}/io") as handle:
                    sample = dict(line.split(": ") for line in handle.read().splitlines())
            except (OSError, ValueError):
                return
            self.last = {k: int(v) for k, v in sample.items()}
            self._stop.wait(0.01)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        return self.last


def _load1() -> float:
    with open("/proc/loadavg") as handle:
        return float(handle.read().split()[0])


def _baseline(pipeline: str, path: str, expect: int) -> tuple[float, float]:
    """(seconds, CPU seconds of the whole pipeline: sh, head, cat, sync)."""
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(["/bin/sh", "-c", pipeline], check=True, timeout=WAIT_S)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    size = os.stat(path).st_size
    os.unlink(path)
    if size != expect:
        raise RuntimeError(f"baseline wrote {size} bytes, expected {expect}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


def _check(session: str, receipt: dict[str, Any], expect: int) -> None:
    out = receipt["output"]["stdout"]
    problems = []
    if receipt["exit"].get("code") != 0:
        problems.append(f"exit {receipt['exit']}")
    if out["cursor"] != expect or out["drained"] != expect:
        problems.append(f"stdout cursor {out['cursor']} drained {out['drained']} != {expect}")
    if receipt["output"]["drain"] != "complete" or not receipt["death"]["proven"]:
        problems.append("drain incomplete or death not proven")
    if problems:
        raise RuntimeError(f"session {session}: {'; '.join(problems)}")


def _facts(receipt: dict[str, Any], wall0: float) -> dict[str, Any]:
    return {
        "exec_to_settled_at_s": receipt["timings"]["settled_at"] - wall0,
        "boundary": receipt["death"]["boundary"],
        "owner_maxrss_kib": receipt["owner"]["maxrss_kib"],
        "owner_cpu_s": receipt["owner"]["cpu_s"],
        "stdout_bytes": receipt["output"]["stdout"]["cursor"],
    }


def _settled(
    rig: Any, expect: int, owner_env: dict[str, str] | None = None, **command: Any
) -> dict[str, Any]:
    """In this process; `owner_env` is set for the owner, which inherits it as it starts
    (SETTLED_LOG_FLUSH=0: no fsyncs behind the drain; SETTLED_LOG_SPLICE=0: read and write)."""
    if owner_env:
        os.environ.update(owner_env)
        try:
            return _settled(rig, expect, **command)
        finally:
            for name in owner_env:
                del os.environ[name]
    os.sync()
    wall0 = time.time()
    started = time.perf_counter()
    admission = rig.exec(**command, boundary="auto")
    returned = time.perf_counter()
    sampler = IoSampler(admission.owner_pid)
    try:
        view = rig.runtime.wait(admission.session, timeout=WAIT_S)
        elapsed = time.perf_counter() - started
    finally:
        io = sampler.stop()
    receipt = view["receipt"]
    _check(admission.session, receipt, expect)
    end_process(receipt["owner"]["pid"], "session owner")
    rig.forget_logs(admission.session)
    return {
        "session": admission.session,
        "exec_to_receipt_s": elapsed,
        "exec_return_s": returned - started,
        **_facts(receipt, wall0),
        "owner_read_syscalls": io.get("syscr"),
        "owner_mean_read_kib": io["rchar"] / io["syscr"] / 1024 if io.get("syscr") else None,
    }


def _cli(rig: Any, args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "SETTLED_HOME": rig.runtime.home}
    done = subprocess.run([CLI, *args], env=env, capture_output=True, timeout=WAIT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"settled {' '.join(args)}: exit {done.returncode}: {done.stderr!r}")
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def _settled_cli(rig: Any, expect: int, size: str) -> dict[str, Any]:
    """`settled exec --json -- head -c SIZE /dev/zero`, then `settled wait --json`: two new
    processes, timed from before the first starts until the second exits."""
    os.sync()
    wall0 = time.time()
    started = time.perf_counter()
    admitted = _cli(rig, ["exec", "--task", rig.task, "--json", "--", "head", "-c", size,
                          "/dev/zero"])  # fmt: skip
    returned = time.perf_counter()
    rig.sessions.append(admitted["session"])
    receipt = _cli(rig, ["wait", admitted["session"], "--json"])
    elapsed = time.perf_counter() - started
    _check(admitted["session"], receipt, expect)
    end_process(receipt["owner"]["pid"], "session owner")
    rig.forget_logs(admitted["session"])
    return {
        "session": admitted["session"],
        "cli_to_receipt_s": elapsed,
        "cli_exec_return_s": returned - started,
        **_facts(receipt, wall0),
    }


# -- follower wake-up --------------------------------------------------------------------------

# Writes `n` stamps (CLOCK_MONOTONIC, which every process here shares), one write each, `gap`
# seconds apart; the reader's latency is its clock at receipt minus the stamp.
STAMPER = (
    "import os, sys, time\n"
    "n, gap = int(sys.argv[1]), float(sys.argv[2])\n"
    "time.sleep(0.3)\n"
    "for _ in range(n):\n"
    "    os.write(1, b'%.9f\\n' % time.monotonic())\n"
    "    time.sleep(gap)\n"
)


class Stamps:
    """Parses stamps out of the bytes a reader receives, each timed at its arrival."""

    def __init__(self) -> None:
        self.pending = b""
        self.latencies: list[float] = []

    def feed(self, data: bytes) -> None:
        now = time.monotonic()
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        self.latencies += [now - float(line) for line in lines if line]


def _pipe_wake(samples: int, gap: float) -> list[float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", STAMPER, str(samples), str(gap)], stdout=subprocess.PIPE
    )
    stamps = Stamps()
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while data := os.read(fd, 65536):
        stamps.feed(data)
    proc.wait(timeout=60)
    return stamps.latencies


def _old_poll_follow(rig: Any, session: str, feed: Callable[[bytes], None]) -> None:
    """What `settled run` did before events: read; when nothing came, sleep 2 ms doubling to
    50 ms, back to 2 ms after a byte."""
    cursor, pause = 0, 0.002
    while True:
        chunk = rig.runtime.read(session, "stdout", cursor)
        if chunk:
            feed(chunk)
            cursor += len(chunk)
            pause = 0.002
            continue
        if rig.runtime.final_cursor(session, "stdout") is not None:
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _bare_follow(rig: Any, session: str, samples: int, stamps: Stamps) -> None:
    """The floor under an evented follower: the log's inotify watch and pread, no store, no
    final cursor (it stops at the number of stamps it expects)."""
    from settled.home import log_path, session_dir
    from settled.log.watch import LogWatch

    watch = LogWatch(session_dir(rig.runtime.home, session))
    path, cursor, fd = log_path(rig.runtime.home, session, "stdout"), 0, -1
    try:
        watch_fd, _ = watch.arm()
        assert watch_fd is not None, watch.unavailable
        while len(stamps.latencies) < samples:
            if fd < 0 and os.path.exists(path):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(fd, 1 << 20, cursor) if fd >= 0 else b""
            if data:
                stamps.feed(data)
                cursor += len(data)
                continue
            select.select([watch_fd], [], [], 1.0)
            watch.clear()
    finally:
        watch.close()
        if fd >= 0:
            os.close(fd)


def _settled_wake(rig: Any, samples: int, gap: float, how: str) -> list[float]:
    admission = rig.exec(argv=[sys.executable, "-c", STAMPER, str(samples), str(gap)])
    stamps = Stamps()
    if how == "runtime":
        for chunk in rig.runtime.follow(admission.session, "stdout", 0, timeout=WAIT_S):
            stamps.feed(chunk)
    elif how == "poll":
        _old_poll_follow(rig, admission.session, stamps.feed)
    elif how == "bare":
        _bare_follow(rig, admission.session, samples, stamps)
    else:
        env = {**os.environ, "SETTLED_HOME": rig.runtime.home}
        argv = [CLI, "logs", admission.session, "--stream", "stdout", "--follow"]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while data := os.read(fd, 65536):
            stamps.feed(data)
        proc.wait(timeout=60)
    receipt = rig.runtime.wait(admission.session, timeout=WAIT_S)["receipt"]
    end_process(receipt["owner"]["pid"], "session owner")
    if len(stamps.latencies) != samples:
        raise RuntimeError(f"{how} follower got {len(stamps.latencies)} of {samples} stamps")
    return stamps.latencies


WAKE_KINDS = {
    "pipe": "plain pipe, blocking os.read (baseline)",
    "runtime": "settled: `Runtime.follow` (inotify + pidfd)",
    "cli": "settled: `settled logs --follow`, its stdout read through a pipe",
    "bare": "settled's log, read on its inotify wake-up alone (no store, no pause)",
    "poll": "settled, polled as before events (2-50 ms doubling)",
}


def _wake(rig: Any, p: dict[str, Any]) -> dict[str, Any]:
    """Each kind in turn, twice, interleaved; every latency kept."""
    got: dict[str, list[float]] = {kind: [] for kind in WAKE_KINDS}
    for round_ in range(2):
        for kind in WAKE_KINDS:
            samples, gap = p["wake_samples"] // 2, p["wake_gap_s"]
            if kind == "pipe":
                got[kind] += _pipe_wake(samples, gap)
            else:
                got[kind] += _settled_wake(rig, samples, gap, kind)
            log(f"wake {kind} round {round_ + 1}: p50 {median(got[kind]) * 1e3:.3f} ms")
    return {kind: [round(v, 9) for v in values] for kind, values in got.items()}


def _round(rig: Any, p: dict[str, Any], flood: str, target: str, i: int) -> dict[str, Any]:
    """One interleaved round: baseline, settled in this process, settled through the CLI."""
    load = _load1()
    base, base_cpu = _baseline(flood, target, p["bytes"])
    got = _settled(rig, p["bytes"], argv=["head", "-c", p["size"], "/dev/zero"])
    cli = _settled_cli(rig, p["bytes"], p["size"])
    flood = ["head", "-c", p["size"], "/dev/zero"]
    spliced = _settled(rig, p["bytes"], {"SETTLED_LOG_SPLICE": "1"}, argv=flood)
    unflushed = _settled(rig, p["bytes"], {"SETTLED_LOG_FLUSH": "0"}, argv=flood)  # as before
    got.update(
        run=i + 1,
        load1=load,
        baseline_s=base,
        baseline_cpu_s=base_cpu,
        ratio=got["exec_to_receipt_s"] / base,
        ratio_to_settled_at=got["exec_to_settled_at_s"] / base,
        ratio_after_admission=(got["exec_to_receipt_s"] - got["exec_return_s"]) / base,
        cli_s=cli["cli_to_receipt_s"],
        cli_exec_return_s=cli["cli_exec_return_s"],
        cli_ratio=cli["cli_to_receipt_s"] / base,
        cli_owner_cpu_s=cli["owner_cpu_s"],
        cli_owner_maxrss_kib=cli["owner_maxrss_kib"],
        splice_s=spliced["exec_to_receipt_s"],
        splice_ratio=spliced["exec_to_receipt_s"] / base,
        splice_owner_cpu_s=spliced["owner_cpu_s"],
        no_flush_s=unflushed["exec_to_receipt_s"],
        no_flush_ratio=unflushed["exec_to_receipt_s"] / base,
        no_flush_owner_cpu_s=unflushed["owner_cpu_s"],
    )
    log(
        f"drain {i + 1}/{p['runs']}: baseline {base:.3f} s, settled {got['exec_to_receipt_s']:.3f}"
        f" s (x{got['ratio']:.2f}), CLI {cli['cli_to_receipt_s']:.3f} s (x{got['cli_ratio']:.2f})"
        f", splice {got['splice_s']:.3f} s (x{got['splice_ratio']:.2f})"
        f", as before {got['no_flush_s']:.3f} s (x{got['no_flush_ratio']:.2f})"
        f", owner RSS {got['owner_maxrss_kib'] / 1024:.1f} MiB, load {load:.1f}"
    )
    return got


def _raw(p: dict[str, Any], flood: str, target: str) -> list[dict[str, Any]]:
    """Part four: drain strategies in a bare process (drain_raw.py), interleaved with the
    baseline; each strategy's digest must be the others' (they hash the same bytes)."""
    rounds = []
    for i in range(p["raw_runs"]):
        base, _ = _baseline(flood, target, p["bytes"])
        got = {kind: drain_once(kind, p["size"], target) for kind in KINDS}
        digests = {r["digest"] for r in got.values()}
        if len(digests) != 1 or any(r["bytes"] != p["bytes"] for r in got.values()):
            raise RuntimeError(f"raw drainers disagree: {got}")
        rounds.append({"baseline_s": base, **got})
        log(f"raw {i + 1}/{p['raw_runs']}: baseline {base:.3f} s, " + ", ".join(
            f"{k} {r['s']:.3f} s" for k, r in got.items()))  # fmt: skip
    return rounds


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    data: dict[str, Any] = {
        "benchmark": "drain", "quick": quick, "machine": machine(), "params": p,
        "source": source_revision(),
    }  # fmt: skip
    with settled_rig("drain") as rig:
        target = os.path.join(rig.root, "baseline.out")
        home_fs, base_fs = fs_of(rig.runtime.home), fs_of(rig.root)
        data["filesystem"] = {"settled_home": home_fs, "baseline_file": base_fs}
        if os.stat(rig.runtime.home).st_dev != os.stat(rig.root).st_dev:
            raise RuntimeError("the settled home and the baseline file are on different devices")
        flood = f"head -c {p['size']} /dev/zero | cat > {target} && sync {target}"
        runs = [_round(rig, p, flood, target, i) for i in range(p["runs"])]
        line_cmd = f"head -c {p['line']} /dev/zero | tr '\\0' x"
        line_base, _ = _baseline(
            f"{line_cmd} | cat > {target} && sync {target}", target, p["line_bytes"]
        )
        line = _settled(rig, p["line_bytes"], shell=line_cmd)
        line.update(baseline_s=line_base, ratio=line["exec_to_receipt_s"] / line_base)
        log(
            f"drain one {p['line']} line: baseline {line_base:.3f} s, settled "
            f"{line['exec_to_receipt_s']:.3f} s, owner RSS "
            f"{line['owner_maxrss_kib'] / 1024:.1f} MiB"
        )
        wake = _wake(rig, p)
        raw = _raw(p, flood, target)
    data["runs"] = runs
    data["raw"] = raw
    data["giant_line"] = line
    data["wake_latency_s"] = wake
    data["summary"] = _summary(runs, line, wake)
    data["summary"]["raw"] = _raw_summary(raw)
    return data, render(data)


def _summary(
    runs: list[dict[str, Any]], line: dict[str, Any], wake: dict[str, list[float]]
) -> dict[str, Any]:
    ratios = [r["ratio"] for r in runs]
    cli_ratios = [r["cli_ratio"] for r in runs]
    rss = [r["owner_maxrss_kib"] for r in runs] + [line["owner_maxrss_kib"]]
    pipe_p50 = median(wake["pipe"])
    return {
        "baseline_s": distribution([r["baseline_s"] for r in runs]),
        "settled_s": distribution([r["exec_to_receipt_s"] for r in runs]),
        "cli_s": distribution([r["cli_s"] for r in runs]),
        "ratio": distribution(ratios),
        "cli_ratio": distribution(cli_ratios),
        "median_ratio": median(ratios),
        "median_cli_ratio": median(cli_ratios),
        "no_flush_ratio": distribution([r["no_flush_ratio"] for r in runs]),
        "splice_ratio": distribution([r["splice_ratio"] for r in runs]),
        "splice_over_read_write": median([r["splice_s"] / r["exec_to_receipt_s"] for r in runs]),
        "before_over_now": median([r["no_flush_s"] / r["exec_to_receipt_s"] for r in runs]),
        "ratio_of_medians": median([r["exec_to_receipt_s"] for r in runs])
        / median([r["baseline_s"] for r in runs]),
        "median_ratio_to_settled_at": median([r["ratio_to_settled_at"] for r in runs]),
        "median_ratio_after_admission": median([r["ratio_after_admission"] for r in runs]),
        "exec_return_s": distribution([r["exec_return_s"] for r in runs]),
        "cli_exec_return_s": distribution([r["cli_exec_return_s"] for r in runs]),
        "ratio_target": RATIO_TARGET,
        "ratio_met": median(cli_ratios) <= RATIO_TARGET,
        "owner_maxrss_kib_max": max(rss),
        "rss_target_mib": RSS_TARGET_MIB,
        "rss_met": max(rss) < RSS_TARGET_MIB * 1024,
        "wake": {
            kind: {
                "n": len(values),
                "p50_ms": median(values) * 1e3,
                "p99_ms": percentile(values, 99) * 1e3,
                "max_ms": max(values) * 1e3,
                "p50_over_pipe": median(values) / pipe_p50,
            }
            for kind, values in wake.items()
        },
    }


def _raw_summary(raw: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        kind: {
            "median_s": median([r[kind]["s"] for r in raw]),
            "median_ratio": median([r[kind]["s"] / r["baseline_s"] for r in raw]),
            "ratios": [r[kind]["s"] / r["baseline_s"] for r in raw],
            "median_cpu_s": median([r[kind]["cpu_s"] for r in raw]),
            "mean_read_kib": median([r[kind]["bytes"] / r[kind]["reads"] / 1024 for r in raw]),
        }
        for kind in KINDS
    }


RAW_WORDS = {
    "inline": "readv + write + hash, one fsync at the end (the owner before)",
    "behind": "readv + write + hash, fsync every 8 MiB in a thread (the owner now)",
    "splice": "splice pipe -> file; hash read back + fsync every 8 MiB in a thread",
}

RUN_COLUMNS = [
    "run", "baseline s", "settled s", "ratio", "CLI s", "CLI ratio", "splice s", "splice ratio",
    "as before s", "as before ratio", "baseline GB/s",
    "settled GB/s", "owner peak RSS MiB", "owner CPU s", "baseline pipeline CPU s",
    "owner mean read KiB", "load (1 min)",
]  # fmt: skip


def render(data: dict[str, Any]) -> str:
    p, s, fs = data["params"], data["summary"], data["filesystem"]
    gbs = p["bytes"] / 1e9
    rows = [
        [
            r["run"],
            fmt(r["baseline_s"], 3),
            fmt(r["exec_to_receipt_s"], 3),
            fmt(r["ratio"]),
            fmt(r["cli_s"], 3),
            fmt(r["cli_ratio"]),
            fmt(r["splice_s"], 3),
            fmt(r["splice_ratio"]),
            fmt(r["no_flush_s"], 3),
            fmt(r["no_flush_ratio"]),
            fmt(gbs / r["baseline_s"]),
            fmt(gbs / r["exec_to_receipt_s"]),
            fmt(r["owner_maxrss_kib"] / 1024, 1),
            fmt(r["owner_cpu_s"]),
            fmt(r["baseline_cpu_s"]),
            fmt(r["owner_mean_read_kib"], 0),
            fmt(r["load1"], 1),
        ]
        for r in data["runs"]
    ]
    line = data["giant_line"]
    verdict_ratio = "met" if s["ratio_met"] else "**missed**"
    verdict_rss = "met" if s["rss_met"] else "**missed**"
    spread = s["cli_ratio"]
    wake_rows = [
        [
            WAKE_KINDS[kind],
            w["n"],
            fmt(w["p50_ms"], 3),
            fmt(w["p99_ms"], 3),
            fmt(w["max_ms"], 3),
            fmt(w["p50_over_pipe"]),
        ]
        for kind, w in s["wake"].items()
    ]
    return "\n\n".join(
        [
            header("drain", data),
            f"Source `{data.get('source', '?')}`. `head -c {p['size']} /dev/zero` through settled, "
            f"in this process (`Runtime.exec` call until `Runtime.wait` returns the receipt) and "
            f"through the CLI (`settled exec --json -- head -c {p['size']} /dev/zero`, then "
            f"`settled wait S --json`: two new processes, timed until the second exits); "
            f"boundary `{data['runs'][0]['boundary']}`; against `head -c {p['size']} /dev/zero | "
            f"cat > FILE && sync FILE`, interleaved (baseline, in-process, CLI, in-process with "
            f"splice, in-process as before this branch: no fsyncs behind the drain), `sync` before "
            f"each run. Home on "
            f"`{fs['settled_home']['mount']}` ({fs['settled_home']['type']}, "
            f"{fs['settled_home']['device']}), baseline file on the same device.",
            md_table(RUN_COLUMNS, rows),
            md_table(
                ["summary", "value", "target"],
                [
                    ["median baseline s", fmt(s["baseline_s"]["p50"], 3), ""],
                    ["median settled s (in-process)", fmt(s["settled_s"]["p50"], 3), ""],
                    ["median settled s (CLI exec + wait)", fmt(s["cli_s"]["p50"], 3), ""],
                    [
                        "median ratio CLI/baseline (spread min-max)",
                        f"{fmt(s['median_cli_ratio'])} ({fmt(spread['min'])}-{fmt(spread['max'])})",
                        f"≤ {s['ratio_target']} ({verdict_ratio})",
                    ],
                    [
                        "median ratio in-process/baseline (spread min-max)",
                        f"{fmt(s['median_ratio'])} ({fmt(s['ratio']['min'])}-"
                        f"{fmt(s['ratio']['max'])})",
                        "",
                    ],
                    [
                        "median ratio in-process with splice (SETTLED_LOG_SPLICE=1; spread); "
                        "paired median splice / read+write",
                        f"{fmt(s['splice_ratio']['p50'])} ({fmt(s['splice_ratio']['min'])}-"
                        f"{fmt(s['splice_ratio']['max'])}); {fmt(s['splice_over_read_write'])}",
                        "",
                    ],
                    [
                        "median ratio in-process as before this branch (no fsyncs behind the "
                        "drain: SETTLED_LOG_FLUSH=0; spread); paired median before / now",
                        f"{fmt(s['no_flush_ratio']['p50'])} ({fmt(s['no_flush_ratio']['min'])}-"
                        f"{fmt(s['no_flush_ratio']['max'])}); {fmt(s['before_over_now'])}",
                        "",
                    ],
                    ["ratio of medians (in-process)", fmt(s["ratio_of_medians"]), ""],
                    [
                        "median ratio, settled timed to the receipt's settled_at",
                        fmt(s["median_ratio_to_settled_at"]),
                        "",
                    ],
                    [
                        "median ratio, settled timed from exec's return (drain only)",
                        fmt(s["median_ratio_after_admission"]),
                        "",
                    ],
                    [
                        "median exec -> returned s (in-process; CLI)",
                        f"{fmt(s['exec_return_s']['p50'], 3)}; "
                        f"{fmt(s['cli_exec_return_s']['p50'], 3)}",
                        "",
                    ],
                    [
                        "owner peak RSS, all runs incl. giant line (MiB)",
                        fmt(s["owner_maxrss_kib_max"] / 1024, 1),
                        f"< {s['rss_target_mib']} ({verdict_rss})",
                    ],
                ],
            ),
            f"One line of {p['line']} non-zero bytes (`head -c {p['line']} /dev/zero | tr '\\0' "
            f"x`, no newline anywhere): settled {fmt(line['exec_to_receipt_s'], 3)} s against "
            f"{fmt(line['baseline_s'], 3)} s for the same pipeline `| cat > FILE && sync FILE` "
            f"(ratio {fmt(line['ratio'])}); owner peak RSS "
            f"{fmt(line['owner_maxrss_kib'] / 1024, 1)} MiB, owner CPU "
            f"{fmt(line['owner_cpu_s'])} s.",
            f"Follower wake-up: a command writes a CLOCK_MONOTONIC stamp every "
            f"{p['wake_gap_s'] * 1e3:.0f} ms ({p['wake_samples']} per kind, two interleaved "
            f"rounds); latency is the reader's clock when the bytes arrive minus the stamp.",
            md_table(["reader", "n", "p50 ms", "p99 ms", "max ms", "p50 / pipe p50"], wake_rows),
            f"Drain strategies in a bare process (bench/drain_raw.py, no settled around them), "
            f"{len(data['raw'])} interleaved rounds with the baseline; every strategy's BLAKE3 "
            f"digest checked equal:",
            md_table(
                ["strategy", "median s", "median ratio (all)", "median CPU s", "mean read KiB"],
                [
                    [
                        RAW_WORDS[kind],
                        fmt(r["median_s"], 3),
                        f"{fmt(r['median_ratio'])} ({', '.join(fmt(x) for x in r['ratios'])})",
                        fmt(r["median_cpu_s"]),
                        fmt(r["mean_read_kib"], 0),
                    ]
                    for kind, r in s["raw"].items()
                ],
            ),
        ]
    )
