"""soak: `settled soak` against its budget, 1,000 crashes in under 10 minutes on this machine.

Each soak runs as CI runs it, `settled soak --crashes N --seed S --lanes L --json` in a process
of its own (its wall time includes its start, its standing server and its cleanup). Full: 200
crashes at 1, 2, 3 and 4 lanes (what a lane buys), then the CI line (1,000 crashes, 3 lanes);
quick: 60 at 3 lanes and 30 at 1. Before and after every soak, interleaved, a batch of the
baseline: a plain session of the kind a cycle runs (`Runtime(launcher="warm").exec` of a
command that logs its launch, prints and writes a file, waited for its receipt) in a home of its
own. The ratio is seconds per crash over seconds per plain session (the median of the two
batches around it): what a crash cycle, its recovery, its retries and every check cost, in plain
sessions. The soak's own per-point seconds (each attempt's whole cycle in its lane) give the
time per family. Nothing is asserted; the 10-minute budget is reported met or missed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from common import fmt, header, log, machine, md_table, median, settled_rig, source_revision

FULL = {"runs": [(200, 1), (200, 2), (200, 3), (200, 4), (1000, 3)], "baseline": 20}
QUICK = {"runs": [(60, 3), (30, 1)], "baseline": 8}
SEED = 16
BUDGET = (1000, 600.0)  # crashes, seconds: issue 16's CI budget
PLAIN = "echo k >> .launches; i=0; while [ $i -lt 64 ]; do printf 'k.%04d\\n' $i; i=$((i+1)); done"


def _baseline(count: int) -> list[float]:
    """Seconds from exec to receipt of `count` plain sessions, one after another."""
    with settled_rig("soak-baseline", launcher="warm") as rig:
        rig.runtime.wait(rig.exec(shell="true", key="warm-up").session, timeout=60.0)
        times = []
        for n in range(count):
            started = time.perf_counter()
            admission = rig.exec(shell=f"{PLAIN}; echo k > out{n}", key=f"plain-{n}")
            rig.runtime.wait(admission.session, timeout=60.0)
            times.append(time.perf_counter() - started)
        return times


def _soak(crashes: int, lanes: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "settled.cli", "soak", "--crashes", str(crashes)]
    argv += ["--seed", str(SEED), "--lanes", str(lanes), "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(timeout=3600)
    except BaseException:  # Ctrl-C or a timeout: the soak ends what it started, then us
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=180)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        raise
    wall = time.perf_counter() - started
    if process.returncode != 0:
        log(f"warning: soak exited {process.returncode}: {err.decode()[-2000:]}")
    report: dict[str, Any] = json.loads(out) if out.strip() else {}
    return {"crashes_asked": crashes, "lanes": lanes, "exit": process.returncode, "wall_s": wall,
            "report": report}  # fmt: skip


def _families(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    families: dict[str, dict[str, float]] = {}
    for point, counts in report.get("points", {}).items():
        entry = families.setdefault(point.partition(".")[0], {"attempts": 0, "seconds": 0.0})
        entry["attempts"] += counts["crashes"] + counts["not_reached"]
        entry["seconds"] += counts["seconds"]
    return families


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"benchmark": "soak", "quick": quick, "machine": machine(),
                            "source": source_revision(), "seed": SEED, "baselines": [],
                            "soaks": []}  # fmt: skip
    data["baselines"].append(_baseline(sizes["baseline"]))
    for crashes, lanes in sizes["runs"]:
        log(f"soak: {crashes} crashes, {lanes} lanes")
        data["soaks"].append(_soak(crashes, lanes))
        data["baselines"].append(_baseline(sizes["baseline"]))
    return data, _markdown(data)


def _markdown(data: dict[str, Any]) -> str:
    rows, family_rows = [], []
    for n, soak in enumerate(data["soaks"]):
        report = soak["report"]
        around = data["baselines"][n] + data["baselines"][n + 1]
        plain = median(around)
        crashes = report.get("crashes", 0)
        per_crash = soak["wall_s"] / crashes if crashes else None
        projected = per_crash * BUDGET[0] if per_crash else None
        verdict = "-" if projected is None else ("met" if projected < BUDGET[1] else "**missed**")
        rows.append((
            soak["lanes"], crashes, soak["exit"], fmt(soak["wall_s"], 1),
            fmt(report.get("crashes_per_second")), fmt(per_crash and per_crash * 1000, 0),
            fmt(plain * 1000, 1), fmt(per_crash and per_crash / plain, 1),
            fmt(projected, 0), verdict, len(report.get("violations", [])),
            report.get("ended", {}).get("processes_left"),
        ))  # fmt: skip
        for family, entry in sorted(_families(report).items()):
            each = entry["seconds"] / entry["attempts"] if entry["attempts"] else 0.0
            family_rows.append((soak["lanes"], family, int(entry["attempts"]), fmt(each, 2)))
    runs = md_table(
        ["lanes", "crashes", "exit", "wall s", "crashes/s (soak's own clock)", "ms per crash",
         "plain session ms (baseline)", "ratio", "1,000 crashes would take s", "< 600 s",
         "violations", "left"],
        rows,
    )  # fmt: skip
    families = md_table(["lanes", "family", "attempts", "s per attempt (in its lane)"],
                        family_rows)  # fmt: skip
    return (
        header("soak", data)
        + f"\n\n`settled soak --seed {data['seed']} --crashes N --lanes L --json`, each run "
        "between two batches of the baseline (a plain warm session, exec to receipt). `ms per "
        "crash` is the soak process's wall time (start, lanes, standing server, cleanup) over "
        "its crashes; `ratio` is that over the plain session's median; `left` counts the run's "
        "processes found after it ended.\n\n"
        + runs
        + "\n\nWhere a lane's time goes, per family of fault points (each attempt's whole "
        "cycle: the crash, the retry or recovery, every check):\n\n" + families
    )
