"""ui_feed: what one refresh of `/ui`'s live view costs (settled.server.feed), against `settled ls`.

The live view recomputes its board while anyone listens: every 0.25 s while a session is live
or a close runs, every 1 s otherwise (on SQLite; PostgreSQL's NOTIFY wakes it sooner). One
refresh is ``views.board``: the newest 50 tasks and, for every task not yet complete, its
sessions' four clocks (``Runtime.clocks``). Measured on a scratch home of 50 tasks (quick: 10),
each with 2 settled sessions, 80% of them closed (complete, so the feed holds them and does not
read them again) and one open task with a live ``sleep``. Interleaved per round: the baseline
``Runtime.list_tasks(50)`` (what `settled ls` reads), the feed's steady refresh (complete tasks
skipped), and a first refresh (every task read). Reported: ms per call, the ratio to the
baseline, and the share of one core the steady refresh takes at each polling rate.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from common import _stop_journals as stop_journals
from common import distribution, end_process, fmt, header, log, machine, md_table, scratch

FULL = {"tasks": 50, "sessions": 2, "rounds": 200}
QUICK = {"tasks": 10, "sessions": 2, "rounds": 30}
CLOSED_SHARE = 0.8


def _populate(rt: Any, root: str, sizes: dict[str, int]) -> tuple[list[str], list[int], str]:
    """(every task, every owner pid, the live session) of a home built for the benchmark."""
    tasks, owners = [], []
    closed = int(sizes["tasks"] * CLOSED_SHARE)
    for n in range(sizes["tasks"]):
        workspace = os.path.join(root, f"w{n}")
        os.mkdir(workspace)
        task = rt.new_task(workspace).task
        tasks.append(task)
        for k in range(sizes["sessions"]):
            admission = rt.exec(task, shell=f"echo {k} > f{k}", key=f"k{k}")
            owners.append(admission.owner_pid)
            rt.wait(admission.session, timeout=60)
        if n < closed:
            rt.close_task(task)
    live = rt.exec(tasks[-1], argv=["sleep", "600"], key="live")
    owners.append(live.owner_pid)
    return tasks, owners, live.session


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def run(quick: bool) -> tuple[dict[str, Any], str]:
    from settled.runtime import Runtime
    from settled.server import views
    from settled.server.feed import BOARD_LIMIT, FAST_S, IDLE_S

    sizes = QUICK if quick else FULL
    times: dict[str, list[float]] = {"ls": [], "steady": [], "first": []}
    with scratch("ui-feed") as root:
        rt = Runtime(os.path.join(root, "home"))
        owners: list[int] = []
        live = None
        try:
            log(f"ui_feed: {sizes['tasks']} tasks x {sizes['sessions']} sessions")
            _, owners, live = _populate(rt, root, sizes)
            order, first = views.board(rt, BOARD_LIMIT, frozenset(), frozenset())
            final = frozenset(t for t, v in first.items() if v["final"])
            for _ in range(sizes["rounds"]):
                times["ls"].append(_timed(lambda: rt.list_tasks(BOARD_LIMIT)))
                times["steady"].append(
                    _timed(lambda: views.board(rt, BOARD_LIMIT, frozenset(), final))
                )
                times["first"].append(
                    _timed(lambda: views.board(rt, BOARD_LIMIT, frozenset(), frozenset()))
                )
        finally:
            if live is not None:
                rt.cancel(live, "benchmark ended")
                rt.wait(live, timeout=30)
            for task in rt.list_tasks(1000):
                if task["state"] != "complete":
                    rt.close_task(task["task"])  # stops each task's journal watch
            for pid in owners:
                end_process(pid, "session owner")
            rt.close()
            stop_journals(os.path.join(root, "home"))
    dist = {name: distribution(values) for name, values in times.items()}
    base = dist["ls"]["p50"]
    data: dict[str, Any] = {
        "machine": machine(),
        "quick": quick,
        "sizes": sizes,
        "complete_tasks": len(final),
        "shown_tasks": len(order),
        "polling_s": {"busy": FAST_S, "idle": IDLE_S},
        "ms": dist,
        "runs_ms": times,
        "ratio_p50": {name: d["p50"] / base for name, d in dist.items()},
        "core_share_steady": {
            "busy": dist["steady"]["p50"] / 1000.0 / FAST_S,
            "idle": dist["steady"]["p50"] / 1000.0 / IDLE_S,
        },
    }
    return data, _markdown(data)


def _markdown(data: dict[str, Any]) -> str:
    rows = []
    for name, what in (
        ("ls", "`Runtime.list_tasks(50)` (`settled ls`): baseline"),
        ("steady", "live view refresh, complete tasks held (the feed's every tick)"),
        ("first", "live view refresh, every task read (a new server's first)"),
    ):
        d = data["ms"][name]
        rows.append([what, fmt(d["p50"]), fmt(d["p90"]), fmt(d["max"]),
                     fmt(data["ratio_p50"][name]) + "x"])  # fmt: skip
    share = data["core_share_steady"]
    sizes = data["sizes"]
    return "\n\n".join(
        [
            header("ui_feed: one refresh of /ui's live view", data),
            f"{data['shown_tasks']} tasks shown ({data['complete_tasks']} complete), "
            f"{sizes['sessions']} sessions each, one live session; {sizes['rounds']} "
            "interleaved rounds.",
            md_table(["call", "p50 ms", "p90 ms", "max ms", "p50 / baseline"], rows),
            f"The steady refresh takes {share['busy'] * 100:.1f}% of one core while a session "
            f"is live (every {data['polling_s']['busy']} s) and {share['idle'] * 100:.1f}% when "
            f"nothing moves (every {data['polling_s']['idle']} s), only while a page listens.",
        ]
    )
