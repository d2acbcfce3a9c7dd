"""drain: 1 GiB through settled (exec to receipt) against `head | cat > FILE && sync FILE`.

Like with like: settled fsyncs its log before the receipt, so the baseline fsyncs its file too,
on the same filesystem (both live in one scratch dir under /tmp). Runs interleave baseline,
settled, baseline, settled, ... and the page cache is flushed (`sync`) before each. A second
part runs one 256 MiB line of non-zero bytes to show the owner's memory stays flat without
newlines.
"""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
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
    settled_rig,
)

RATIO_TARGET = 1.25
RSS_TARGET_MIB = 64
FULL = {"size": "1G", "bytes": 1 << 30, "runs": 9, "line": "256M", "line_bytes": 256 << 20}
QUICK = {"size": "64M", "bytes": 64 << 20, "runs": 3, "line": "16M", "line_bytes": 16 << 20}
WAIT_S = 600.0


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


def _settled(rig: Any, expect: int, **command: Any) -> dict[str, Any]:
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
    out = receipt["output"]["stdout"]
    problems = []
    if receipt["exit"].get("code") != 0:
        problems.append(f"exit {receipt['exit']}")
    if out["cursor"] != expect or out["drained"] != expect:
        problems.append(f"stdout cursor {out['cursor']} drained {out['drained']} != {expect}")
    if receipt["output"]["drain"] != "complete" or not receipt["death"]["proven"]:
        problems.append("drain incomplete or death not proven")
    if problems:
        raise RuntimeError(f"session {admission.session}: {'; '.join(problems)}")
    end_process(receipt["owner"]["pid"], "session owner")
    rig.forget_logs(admission.session)
    return {
        "session": admission.session,
        "exec_to_receipt_s": elapsed,
        "exec_return_s": returned - started,
        "exec_to_settled_at_s": receipt["timings"]["settled_at"] - wall0,
        "boundary": receipt["death"]["boundary"],
        "owner_maxrss_kib": receipt["owner"]["maxrss_kib"],
        "owner_cpu_s": receipt["owner"]["cpu_s"],
        "stdout_bytes": out["cursor"],
        "owner_read_syscalls": io.get("syscr"),
        "owner_mean_read_kib": io["rchar"] / io["syscr"] / 1024 if io.get("syscr") else None,
    }


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    data: dict[str, Any] = {"benchmark": "drain", "quick": quick, "machine": machine(), "params": p}
    with settled_rig("drain") as rig:
        target = os.path.join(rig.root, "baseline.out")
        home_fs, base_fs = fs_of(rig.runtime.home), fs_of(rig.root)
        data["filesystem"] = {"settled_home": home_fs, "baseline_file": base_fs}
        if os.stat(rig.runtime.home).st_dev != os.stat(rig.root).st_dev:
            raise RuntimeError("the settled home and the baseline file are on different devices")
        flood = f"head -c {p['size']} /dev/zero | cat > {target} && sync {target}"
        runs = []
        for i in range(p["runs"]):
            load = _load1()
            base, base_cpu = _baseline(flood, target, p["bytes"])
            got = _settled(rig, p["bytes"], argv=["head", "-c", p["size"], "/dev/zero"])
            got.update(
                run=i + 1,
                load1=load,
                baseline_s=base,
                baseline_cpu_s=base_cpu,
                ratio=got["exec_to_receipt_s"] / base,
                ratio_to_settled_at=got["exec_to_settled_at_s"] / base,
                ratio_after_admission=(got["exec_to_receipt_s"] - got["exec_return_s"]) / base,
            )
            runs.append(got)
            log(
                f"drain {i + 1}/{p['runs']}: baseline {base:.3f} s, settled "
                f"{got['exec_to_receipt_s']:.3f} s (x{got['ratio']:.2f}), owner RSS "
                f"{got['owner_maxrss_kib'] / 1024:.1f} MiB"
            )
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
    ratios = [r["ratio"] for r in runs]
    rss = [r["owner_maxrss_kib"] for r in runs] + [line["owner_maxrss_kib"]]
    data["runs"] = runs
    data["giant_line"] = line
    data["summary"] = {
        "baseline_s": distribution([r["baseline_s"] for r in runs]),
        "settled_s": distribution([r["exec_to_receipt_s"] for r in runs]),
        "ratio": distribution(ratios),
        "median_ratio": median(ratios),
        "ratio_of_medians": median([r["exec_to_receipt_s"] for r in runs])
        / median([r["baseline_s"] for r in runs]),
        "median_ratio_to_settled_at": median([r["ratio_to_settled_at"] for r in runs]),
        "median_ratio_after_admission": median([r["ratio_after_admission"] for r in runs]),
        "exec_return_s": distribution([r["exec_return_s"] for r in runs]),
        "ratio_target": RATIO_TARGET,
        "ratio_met": median(ratios) <= RATIO_TARGET,
        "owner_maxrss_kib_max": max(rss),
        "rss_target_mib": RSS_TARGET_MIB,
        "rss_met": max(rss) < RSS_TARGET_MIB * 1024,
    }
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    p, s, fs = data["params"], data["summary"], data["filesystem"]
    gbs = p["bytes"] / 1e9
    rows = [
        [
            r["run"],
            fmt(r["baseline_s"], 3),
            fmt(r["exec_to_receipt_s"], 3),
            fmt(r["exec_to_settled_at_s"], 3),
            fmt(r["ratio"]),
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
    return "\n\n".join(
        [
            header("drain", data),
            f"`head -c {p['size']} /dev/zero` through settled (`Runtime.exec` call until "
            f"`Runtime.wait` returns the receipt; boundary `{data['runs'][0]['boundary']}`) "
            f"against `head -c {p['size']} /dev/zero | cat > FILE && sync FILE`, interleaved "
            f"(baseline first), `sync` before each run. Home on `{fs['settled_home']['mount']}` "
            f"({fs['settled_home']['type']}, {fs['settled_home']['device']}), baseline file on "
            f"the same device.",
            md_table(
                [
                    "run",
                    "baseline s",
                    "settled s",
                    "settled s (to settled_at)",
                    "ratio",
                    "baseline GB/s",
                    "settled GB/s",
                    "owner peak RSS MiB",
                    "owner CPU s",
                    "baseline pipeline CPU s",
                    "owner mean read KiB",
                    "load (1 min)",
                ],
                rows,
            ),
            md_table(
                ["summary", "value", "target"],
                [
                    ["median baseline s", fmt(s["baseline_s"]["p50"], 3), ""],
                    ["median settled s", fmt(s["settled_s"]["p50"], 3), ""],
                    [
                        "median ratio settled/baseline",
                        fmt(s["median_ratio"]),
                        f"≤ {s['ratio_target']} ({verdict_ratio})",
                    ],
                    ["ratio of medians", fmt(s["ratio_of_medians"]), ""],
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
                        "median exec -> returned s (admission)",
                        fmt(s["exec_return_s"]["p50"], 3),
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
        ]
    )
