"""receipt: one tool call through the warm service, `true` from admission to its process receipt
(issue 15, goal 2: p50 <= 3x and p99 <= 10x the baseline).

Each run, over one kept-alive connection to `settled serve` (a subprocess on a free port, its warm
launcher shared by every worker): `POST /v1/tasks/{t}/sessions` with a new key and argv `true`,
then `GET /v1/sessions/{s}?wait=30` until the answer carries the receipt. The baseline, measured
in the same loop and interleaved with it: one HTTP round trip of the same server on the same
connection (`GET /healthz`), plus `os.posix_spawn` of `true` and `waitpid` in this process, which
is what a tool call costs with no proof at all. The receipt's own `timings` split each run.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from typing import Any

from common import (
    distribution,
    fmt,
    header,
    kill_marked,
    log,
    machine,
    md_table,
    settled_rig,
    source_revision,
)
from http_bench import ServerProcess

FULL = {"runs": 400, "warmup": 20}
QUICK = {"runs": 40, "warmup": 5}
TARGETS = {"p50": 3.0, "p99": 10.0}
TRUE = "/bin/true"
HEADERS = ["ms", "n", "p50", "p90", "p99", "max", "p50 / baseline", "p99 / baseline"]


def _spawn_true() -> float:
    started = time.perf_counter()
    pid = os.posix_spawn(TRUE, [TRUE], {})
    os.waitpid(pid, 0)
    return time.perf_counter() - started


def _baseline(client: Any) -> float:
    started = time.perf_counter()
    answer = client.get("/healthz")
    http_s = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"healthz: {answer.status_code}")
    return http_s + _spawn_true()


def _exec_to_receipt(client: Any, task: str) -> tuple[float, dict[str, Any]]:
    """(seconds from the POST to the answer carrying the receipt, the receipt; its `timings`
    gain `asked_at` and `answered_at`, this process's wall clock around the call)."""
    asked_at = time.time()
    started = time.perf_counter()
    admitted = client.post(
        f"/v1/tasks/{task}/sessions", json={"key": secrets.token_hex(8), "argv": ["true"]}
    )
    if admitted.status_code != 201:
        raise RuntimeError(f"admission: {admitted.status_code} {admitted.text}")
    session = admitted.json()["session"]
    answer = client.get(f"/v1/sessions/{session}", params={"wait": 30})
    elapsed = time.perf_counter() - started
    answered_at = time.time()
    view = answer.json()
    if answer.status_code != 200 or "receipt" not in view:
        raise RuntimeError(f"session {session}: {answer.status_code} {answer.text}")
    if not view["receipt"]["death"]["proven"]:
        raise RuntimeError(f"session {session} settled without death evidence")
    receipt: dict[str, Any] = view["receipt"]
    receipt["timings"] = {**receipt.get("timings", {}), "asked_at": asked_at,
                          "answered_at": answered_at}  # fmt: skip
    return elapsed, receipt


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    mark = f"receipt-{os.getpid()}-{secrets.token_hex(4)}"
    data: dict[str, Any] = {
        "benchmark": "receipt",
        "quick": quick,
        "machine": machine(),
        "source": source_revision(),
        "params": dict(p),
    }
    with settled_rig("receipt", launcher="warm") as rig:
        server = ServerProcess(rig.root, rig.runtime.home, secrets.token_urlsafe(32), mark)
        try:
            with server.client() as client:
                for _ in range(p["warmup"]):  # the zygote, the worker Runtimes, the caches
                    _exec_to_receipt(client, rig.task)
                    _baseline(client)
                runs = []
                for n in range(p["runs"]):
                    base = _baseline(client)
                    took, receipt = _exec_to_receipt(client, rig.task)
                    runs.append({"baseline_s": base, "settled_s": took,
                                 "timings": receipt.get("timings", {})})  # fmt: skip
                    if (n + 1) % 100 == 0:
                        log(f"receipt {n + 1}/{p['runs']}")
            data["runs"] = runs
            rig.runtime.close_task(rig.task, deadline=120.0)
        finally:
            server.stop()
            data["left"] = len(kill_marked(mark))
    data["summary"] = _summary(data["runs"])
    return data, render(data)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    base = distribution([r["baseline_s"] * 1e3 for r in runs])
    ours = distribution([r["settled_s"] * 1e3 for r in runs])
    return {
        "baseline_ms": base,
        "settled_ms": ours,
        "p50_ratio": ours["p50"] / base["p50"],
        "p99_ratio": ours["p99"] / base["p99"],
        "phases_ms": _phases(runs),
    }


# Each run's instants, in order: the client's (asked, answered) around the receipt's own.
STEPS = ("asked_at", "admitted_at", "launched_at", "owner_at", "claimed_at", "orders_at",
         "spawned_at", "supervised_at", "settled_at", "answered_at")  # fmt: skip
STEP_WORDS = {
    "asked_at -> admitted_at": "HTTP request, admission committed",
    "admitted_at -> launched_at": "the launch asked of the zygote",
    "launched_at -> owner_at": "the owner says its pid (a spare, or a fork)",
    "owner_at -> claimed_at": "the claim committed (fsync)",
    "claimed_at -> orders_at": "the orders read by the owner",
    "orders_at -> spawned_at": "boundary, last words, logs created",
    "spawned_at -> supervised_at": "clone3 into cgroup + PID ns, isolation, exec; session loaded",
    "supervised_at -> settled_at": "exit seen, death evidence, logs closed, journal barrier",
    "settled_at -> answered_at": "receipt committed (fsync), waiter woken, status, HTTP answer",
}


def _phases(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The receipt's own wall-clock instants, as consecutive parts of each run."""
    steps = STEPS
    parts: dict[str, list[float]] = {}
    for r in runs:
        t = r["timings"]
        for a, b in itertools.pairwise(steps):
            if a in t and b in t:
                parts.setdefault(f"{a} -> {b}", []).append((t[b] - t[a]) * 1e3)
    return {name: distribution(values) for name, values in parts.items()}


def render(data: dict[str, Any]) -> str:
    s = data["summary"]
    b, o = s["baseline_ms"], s["settled_ms"]
    verdict = {k: ("met" if s[f"{k}_ratio"] <= v else "**missed**") for k, v in TARGETS.items()}
    rows = [
        ["baseline: `GET /healthz` + posix_spawn/waitpid of `true`", b["n"], fmt(b["p50"]),
         fmt(b["p90"]), fmt(b["p99"]), fmt(b["max"]), "1.00", "1.00"],
        ["settled: `POST .../sessions` + `GET /v1/sessions/{s}?wait` until the receipt",
         o["n"], fmt(o["p50"]), fmt(o["p90"]), fmt(o["p99"]), fmt(o["max"]),
         f"{fmt(s['p50_ratio'])} ({verdict['p50']}, target <= {TARGETS['p50']:g})",
         f"{fmt(s['p99_ratio'])} ({verdict['p99']}, target <= {TARGETS['p99']:g})"],
    ]  # fmt: skip
    phase_rows = [
        [name, STEP_WORDS.get(name, ""), fmt(d["p50"]), fmt(d["p90"]), fmt(d["p99"]),
         fmt(d["max"])]
        for name, d in s["phases_ms"].items()
    ]  # fmt: skip
    return "\n\n".join(
        [
            header("receipt", data),
            __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
            md_table(HEADERS, rows),
            "Where a run goes, from the receipt's `timings` (ms):",
            md_table(["phase", "what", "p50", "p90", "p99", "max"], phase_rows),
            f"Processes left carrying the benchmark's mark: **{data['left']}** (must be 0). "
            f"Source `{data['source']}`.",
        ]
    )
