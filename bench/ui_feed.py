"""ui_feed: what `/ui`'s live view costs (settled.server.feed) and how late it shows a settle.

The live view recomputes its board while anyone listens: every 0.25 s while a session is live
or a close runs, every 1 s otherwise (on SQLite; PostgreSQL's NOTIFY wakes it sooner). One
refresh is ``views.board``: the newest 50 tasks and, for every task not yet complete, its
sessions' four clocks (``Runtime.clocks``). Measured on a scratch home of 50 tasks (quick: 10),
each with 2 settled sessions, 80% of them closed (complete, so the feed holds them and does not
read them again) and one open task with a live ``sleep``. Interleaved per round: the baseline
``Runtime.list_tasks(50)`` (what `settled ls` reads), the feed's steady refresh (complete tasks
skipped), and a first refresh (every task read). Reported: ms per call, the ratio to the
baseline, and the share of one core the steady refresh takes at each polling rate.

Latency: through a real `settled serve` (a subprocess, port 0), a follower of
`GET /v1/events?follow=1` and a long poll `GET /v1/sessions/{s}?wait=60` (the baseline: how a
client that waits learns of a settle) watch the same sessions (`sleep` of 0.1-0.6 s, seeded, so
the settles do not beat with the polling; 40 in a row, quick: 8), both measured from the
receipt's `timings.settled_at` (the owner's clock, same host) to the moment each client has
the news: the long poll's answer, the first event whose process clock for the session is
settled.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from common import _stop_journals as stop_journals
from common import (
    await_exit,
    distribution,
    end_process,
    fmt,
    header,
    kill_marked,
    log,
    machine,
    marked,
    md_table,
    scratch,
)
from http_bench import ServerProcess

FULL = {"tasks": 50, "sessions": 2, "rounds": 200, "settles": 40}
QUICK = {"tasks": 10, "sessions": 2, "rounds": 30, "settles": 8}
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
    latency = _latency(sizes["settles"])
    left = int(latency.pop("left")[0])
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
        "latency_s": {name: distribution(values) for name, values in latency.items()},
        "latency_runs_s": latency,
        "left": left,
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
    lat = data["latency_s"]
    lat_rows = [
        [name, fmt(d["p50"], 3), fmt(d["p90"], 3), fmt(d["max"], 3),
         fmt(d["p50"] / max(lat["long poll"]["p50"], 1e-9)) + "x"]
        for name, d in (("long poll `?wait=60` (baseline)", lat["long poll"]),
                        ("live view `/v1/events?follow=1`", lat["live view"]))
    ]  # fmt: skip
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
            "How late a settle reaches a client of `settled serve` (s after the receipt's "
            f"`settled_at`, {len(data['latency_runs_s']['long poll'])} sessions):",
            md_table(["client", "p50 s", "p90 s", "max s", "p50 / baseline"], lat_rows),
            "Processes left carrying the benchmark's mark after the server stopped: "
            f"**{data['left']}** (must be 0).",
        ]
    )


# -- how late a settle reaches a page ---------------------------------------------------------


class Follower:
    """A reader of /v1/events?follow=1 on its own thread: when it first saw each session's
    process clock settled (wall clock)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.seen: dict[str, float] = {}
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the live view sent no snapshot in 30 s")

    def _read(self) -> None:
        try:
            with (
                self.server.client() as client,
                client.stream("GET", "/v1/events", params={"follow": "1"}) as stream,
            ):
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        self._note(json.loads(line[6:]), time.time())
                        self.ready.set()
        except httpx.HTTPError:
            return  # the server stopped: the end of the benchmark

    def _note(self, data: dict[str, Any], now: float) -> None:
        for task in data["tasks"]:
            for row in task["sessions"]:
                settled = row["clocks"]["process"]["state"] == "settled"
                if settled and row["session"] not in self.seen:
                    self.seen[row["session"]] = now

    def when(self, session: str, timeout: float = 30.0) -> float:
        give_up = time.monotonic() + timeout
        while session not in self.seen:
            if time.monotonic() > give_up:
                raise RuntimeError(f"the live view never showed {session} settled")
            time.sleep(0.005)
        return self.seen[session]


def _latency(settles: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"long poll": [], "live view": []}
    token, mark = secrets.token_urlsafe(24), secrets.token_hex(8)
    rng = random.Random(16)
    with scratch("ui-latency") as root:
        workspace = os.path.join(root, "workspace")
        os.mkdir(workspace)
        server = ServerProcess(root, os.path.join(root, "home"), token, mark)
        owners: list[int] = []
        try:
            follower = Follower(server)
            with server.client() as client:
                task = client.post("/v1/tasks", json={"workspace": workspace}).json()["task"]
                for n in range(settles):  # the length varies, or it would beat with the polling
                    pause = f"{0.1 + rng.random() * 0.5:.3f}"
                    body = {"key": f"k{n}", "argv": ["sleep", pause]}
                    admitted = client.post(f"/v1/tasks/{task}/sessions", json=body).json()
                    owners.append(admitted["owner_pid"])
                    session = admitted["session"]
                    view = client.get(f"/v1/sessions/{session}", params={"wait": 60}).json()
                    answered = time.time()
                    settled_at = float(view["receipt"]["timings"]["settled_at"])
                    out["long poll"].append(answered - settled_at)
                    out["live view"].append(follower.when(session) - settled_at)
                client.post(f"/v1/tasks/{task}/close", json={})  # ends its journal watch
        finally:
            server.stop()
            for pid in owners:
                end_process(pid, "session owner")
            stop_journals(os.path.join(root, "home"))  # the server's home started one
            for pid in marked(mark):  # a stopped journal releases its lock, then exits
                await_exit(pid, 5.0)
            left = kill_marked(mark)
            if left:
                log(f"warning: killed {len(left)} processes left with the benchmark's mark")
    out["left"] = [float(len(left))]
    return out
