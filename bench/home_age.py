"""home_age: one session's admission and receipt as its home hosts more and more tasks.

Every command runs with every other task's workspace hidden (docs/TRUST.md): the planner keeps
the outermost of them, and the command's PID namespace init covers each one in its mount
namespace. A home an agent platform keeps for months hosts thousands of tasks, so this cost
must not grow with them faster than the covers themselves. Here: one task's `true`, `Runtime.exec`
until it returns (running) and until the receipt (`Runtime.wait`), through the warm launcher,
after the home gained more tasks, each with a workspace of its own beside the others (all of
them hidden from this task's commands). The ratio is each level's p50 over the p50 with one
other task, measured earlier in the same run; a bare `posix_spawn` + `waitpid` of `true`,
interleaved with every run, shows what the machine's other load did meanwhile.
"""

from __future__ import annotations

import os
import time
from typing import Any

from common import distribution, fmt, header, log, machine, md_table, settled_rig, source_revision

FULL = {"levels": [1, 100, 500, 1000], "runs": 30, "warmup": 3}
QUICK = {"levels": [1, 50, 200], "runs": 8, "warmup": 2}
TRUE = "/bin/true"


def _spawn_true_ms() -> float:
    started = time.perf_counter()
    os.waitpid(os.posix_spawn(TRUE, [TRUE], {}), 0)
    return (time.perf_counter() - started) * 1e3


def _one(runtime: Any, task: str) -> tuple[float, float, int]:
    """(exec -> returned ms, exec -> receipt ms, directories the receipt says were hidden)."""
    started = time.perf_counter()
    admission = runtime.exec(task, argv=[TRUE])
    returned = time.perf_counter()
    view = runtime.wait(admission.session, timeout=60)
    ended = time.perf_counter()
    receipt = view["receipt"]
    if receipt["exit"].get("code") != 0 or not receipt["death"]["proven"]:
        raise RuntimeError(f"session {admission.session}: {receipt['exit']} {receipt['death']}")
    hidden = len(receipt["isolation"]["hidden"]["dirs"])
    return (returned - started) * 1e3, (ended - started) * 1e3, hidden


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    data: dict[str, Any] = {
        "benchmark": "home_age",
        "quick": quick,
        "machine": machine(),
        "source": source_revision(),
        "params": dict(p),
        "levels": [],
    }
    with settled_rig("home_age", launcher="warm") as rig:
        others = os.path.join(rig.root, "others")
        os.mkdir(others)
        made = 0
        for level in p["levels"]:
            while made < level:
                workspace = os.path.join(others, f"w{made}")
                os.mkdir(workspace)
                rig.runtime.new_task(workspace)
                made += 1
            for _ in range(p["warmup"]):
                _one(rig.runtime, rig.task)
            runs = []
            for _ in range(p["runs"]):
                base = _spawn_true_ms()
                running, receipt, hidden = _one(rig.runtime, rig.task)
                runs.append({"spawn_ms": base, "running_ms": running, "receipt_ms": receipt,
                             "hidden": hidden})  # fmt: skip
            data["levels"].append({"tasks": level, "runs": runs})
            log(f"home_age: {level} other tasks done")
    data["summary"] = _summary(data["levels"])
    return data, render(data)


def _summary(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for level in levels:
        runs = level["runs"]
        rows.append({
            "tasks": level["tasks"],
            "hidden": max(r["hidden"] for r in runs),
            "running_ms": distribution([r["running_ms"] for r in runs]),
            "receipt_ms": distribution([r["receipt_ms"] for r in runs]),
            "spawn_ms": distribution([r["spawn_ms"] for r in runs]),
        })  # fmt: skip
    first = rows[0]
    for row in rows:
        row["running_ratio"] = row["running_ms"]["p50"] / first["running_ms"]["p50"]
        row["receipt_ratio"] = row["receipt_ms"]["p50"] / first["receipt_ms"]["p50"]
    return rows


def render(data: dict[str, Any]) -> str:
    rows = [
        [r["tasks"], r["hidden"], fmt(r["running_ms"]["p50"]), fmt(r["running_ms"]["p90"]),
         fmt(r["running_ratio"]), fmt(r["receipt_ms"]["p50"]), fmt(r["receipt_ms"]["p90"]),
         fmt(r["receipt_ratio"]), fmt(r["spawn_ms"]["p50"])]
        for r in data["summary"]
    ]  # fmt: skip
    headers = ["other tasks", "hidden dirs (receipt)", "exec -> running p50 ms", "p90",
               "ratio to the first", "exec -> receipt p50 ms", "p90", "ratio to the first",
               "posix_spawn + wait p50 ms"]  # fmt: skip
    return "\n\n".join(
        [
            header("home_age: admission as a home hosts more tasks", data),
            __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
            md_table(headers, rows),
            f"{data['params']['runs']} runs a level. Source `{data['source']}`.",
        ]
    )
