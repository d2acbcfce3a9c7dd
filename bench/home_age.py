"""home_age: one session's admission and receipt as its home hosts more and more tasks.

Every command runs with every other task's workspace hidden (docs/TRUST.md): the planner keeps
the outermost of them, and the command's PID namespace init covers each one in its mount
namespace. A home an agent platform keeps for months hosts thousands of tasks, so this cost
must not grow with them faster than the covers themselves. Here: one task's `true`, `Runtime.exec`
until it returns (running) and until the receipt (`Runtime.wait`), through the warm launcher,
after the home gained more tasks, each with a workspace of its own beside the others (all of
them hidden from this task's commands). The ratio is each level's p50 over the p50 with one
other task, measured earlier in the same run; a bare `posix_spawn` + `waitpid` of `true`,
interleaved with every run, shows what the machine's other load did meanwhile. What each session
adds to the store is measured too: its row's receipt and isolation, and the database's pages in
use before and after the level's sessions, divided by their number.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
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


def _store_bytes(home: str) -> int:
    """Bytes of the embedded store's pages in use (its free pages left out)."""
    path = os.path.join(home, "settled.db")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        pages, free, size = (
            db.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_count", "freelist_count", "page_size")
        )
    return int((pages - free) * size)


def _row_bytes(home: str, session: str) -> int:
    """What the session's row holds of its receipt and of its isolation, as stored."""
    path = os.path.join(home, "settled.db")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        row = db.execute(
            "SELECT length(receipt) + length(coalesce(isolation, '')) FROM sessions "
            "WHERE session=?",
            (session,),
        ).fetchone()
    return int(row[0])


def _one(runtime: Any, task: str) -> tuple[float, float, int, str]:
    """(exec -> returned ms, exec -> receipt ms, directories the receipt says were hidden, the
    session)."""
    started = time.perf_counter()
    admission = runtime.exec(task, argv=[TRUE])
    returned = time.perf_counter()
    view = runtime.wait(admission.session, timeout=60)
    ended = time.perf_counter()
    receipt = view["receipt"]
    if receipt["exit"].get("code") != 0 or not receipt["death"]["proven"]:
        raise RuntimeError(f"session {admission.session}: {receipt['exit']} {receipt['death']}")
    hidden = len(receipt["isolation"]["hidden"]["dirs"])
    return (returned - started) * 1e3, (ended - started) * 1e3, hidden, admission.session


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
            store_before = _store_bytes(rig.runtime.home)
            for _ in range(p["warmup"]):
                _one(rig.runtime, rig.task)
            runs = []
            for _ in range(p["runs"]):
                base = _spawn_true_ms()
                running, receipt, hidden, session = _one(rig.runtime, rig.task)
                runs.append({"spawn_ms": base, "running_ms": running, "receipt_ms": receipt,
                             "hidden": hidden,
                             "row_bytes": _row_bytes(rig.runtime.home, session)})  # fmt: skip
            sessions = p["warmup"] + p["runs"]
            growth = (_store_bytes(rig.runtime.home) - store_before) / sessions
            data["levels"].append({"tasks": level, "runs": runs, "store_bytes": growth})
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
            "row_bytes": sum(r["row_bytes"] for r in runs) / len(runs),
            "store_bytes": level["store_bytes"],
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
         fmt(r["receipt_ratio"]), fmt(r["spawn_ms"]["p50"]), f"{r['row_bytes'] / 1024:.1f}",
         f"{r['store_bytes'] / 1024:.1f}"]
        for r in data["summary"]
    ]  # fmt: skip
    headers = ["other tasks", "hidden dirs (receipt)", "exec -> running p50 ms", "p90",
               "ratio to the first", "exec -> receipt p50 ms", "p90", "ratio to the first",
               "posix_spawn + wait p50 ms", "row: receipt + isolation KiB",
               "store growth a session KiB"]  # fmt: skip
    return "\n\n".join(
        [
            header("home_age: admission as a home hosts more tasks", data),
            __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
            md_table(headers, rows),
            f"{data['params']['runs']} runs a level. Source `{data['source']}`.",
        ]
    )
