"""store_ops: one session's store round trip (admit, claim, receipt) on SQLite and PostgreSQL.

The same process drives both stores, interleaved in one loop: for each run a fresh key is
admitted, claimed and settled with a sealed receipt on the SQLite store of a scratch home
(WAL, synchronous=FULL) and then on a PostgreSQL store (its own schema). Times are per call,
in ms, and the ratio is PostgreSQL's p50 over SQLite's. Opening a store is measured as well (an
owner opens one per session). PostgreSQL is the server at SETTLED_BENCH_PG_URL if set, else a
throw-away cluster started from the machine's binaries (tests/pg.py) with fsync ON, so both
stores flush each commit to the same disk; it listens on 127.0.0.1 with SCRAM password auth.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from common import BENCH_DIR, distribution, fmt, header, log, machine, md_table, scratch

sys.path.insert(0, os.path.join(BENCH_DIR, "..", "tests"))

import pg  # tests/pg.py: the cluster of the tests, reused

from settled.receipts import seal
from settled.records import OwnerInfo
from settled.store import Store
from settled.store.postgres import open_postgres
from settled.store.sqlite import open_sqlite

FULL = {"runs": 400, "open_runs": 60}
QUICK = {"runs": 40, "open_runs": 10}
URL_ENV = "SETTLED_BENCH_PG_URL"
OPS = ("admit", "claim", "receipt", "round trip")
DIGEST = "sha256:" + "a" * 64
SPEC = {"v": "settled.command/v1", "argv": ["true"], "cwd": ".", "timeout": None}
OWNER = OwnerInfo(pid=os.getpid(), start_time=1, boot_id="bench", lease_until=2e9)


@contextlib.contextmanager
def _postgres_url() -> Iterator[tuple[str, str]]:
    """(base URL, where it came from)."""
    given = os.environ.get(URL_ENV)
    if given:
        yield given, f"the server at ${URL_ENV}"
        return
    reason = pg.missing_reason()
    if reason is not None:
        raise RuntimeError(f"store_ops needs PostgreSQL: {reason}, or set {URL_ENV}")
    cluster = pg.start_cluster(durable=True)
    try:
        yield cluster.url(), "a local PostgreSQL 15 cluster (fsync on), TCP + SCRAM"
    finally:
        cluster.stop()


def _receipt(session: str, n: int) -> dict[str, Any]:
    return seal(
        {
            "kind": "process",
            "v": 1,
            "session": session,
            "exit": {"code": 0, "signal": None, "reason": "exit"},
            "output": {"stdout": {"cursor": n}, "stderr": {"cursor": 0}, "drain": "complete"},
        }
    )


def _round_trip(store: Store, task: str, n: int) -> dict[str, float]:
    """ms per call of one admit, claim and receipt of a new key."""
    t0 = time.perf_counter()
    record, _ = store.admit(task, f"key-{n}", DIGEST, SPEC)
    t1 = time.perf_counter()
    store.claim(record.session, record.generation, OWNER)
    t2 = time.perf_counter()
    store.write_receipt(record.session, record.generation, _receipt(record.session, n))
    t3 = time.perf_counter()
    ms = 1000.0
    return {
        "admit": (t1 - t0) * ms,
        "claim": (t2 - t1) * ms,
        "receipt": (t3 - t2) * ms,
        "round trip": (t3 - t0) * ms,
    }


def _open_ms(opener: Callable[[], Store]) -> float:
    """An open and the first read (PostgreSQL's pool connects in the background meanwhile)."""
    started = time.perf_counter()
    store = opener()
    store.workspaces()
    elapsed = (time.perf_counter() - started) * 1000.0
    store.close()
    return elapsed


def run(quick: bool) -> tuple[dict[str, Any], str]:
    params = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "quick": quick, "params": params}
    samples: dict[str, dict[str, list[float]]] = {
        name: {op: [] for op in (*OPS, "open")} for name in ("sqlite", "postgresql")
    }
    with scratch("store-ops") as home, _postgres_url() as (base, source):
        url = f"{base}?options=-csearch_path%3Dbench_{os.getpid()}_{int(time.time())}"
        stores: dict[str, Store] = {"sqlite": open_sqlite(home), "postgresql": open_postgres(url)}
        try:
            tasks = {
                name: store.create_task(f"bench-{name}", f"/bench-{name}")[0].task
                for name, store in stores.items()
            }
            for name, store in stores.items():  # warm: prepared statements, the pool filled
                for n in range(5):
                    _round_trip(store, tasks[name], -1 - n)
            for n in range(params["runs"]):
                for name, store in stores.items():
                    for op, ms in _round_trip(store, tasks[name], n).items():
                        samples[name][op].append(ms)
            for _ in range(params["open_runs"]):
                samples["sqlite"]["open"].append(_open_ms(lambda: open_sqlite(home)))
                samples["postgresql"]["open"].append(_open_ms(lambda: open_postgres(url)))
        finally:
            for store in stores.values():
                store.close()
    data["source"] = source
    data["results"] = {
        name: {op: distribution(values) for op, values in by_op.items()}
        for name, by_op in samples.items()
    }
    log(f"store_ops: {params['runs']} round trips on each store against {source}")
    return data, _markdown(data)


def _markdown(data: dict[str, Any]) -> str:
    results = data["results"]
    rows = []
    for op in (*OPS, "open"):
        lite, post = results["sqlite"][op], results["postgresql"][op]
        rows.append(
            [
                op,
                lite["n"],
                fmt(lite["p50"], 3),
                fmt(lite["p99"], 3),
                fmt(post["p50"], 3),
                fmt(post["p99"], 3),
                fmt(post["p50"] / lite["p50"], 2),
            ]
        )
    return "\n\n".join(
        [
            header("store_ops", data),
            "One session's store calls on SQLite (WAL, synchronous=FULL, a scratch home under "
            f"/tmp) and PostgreSQL ({data['source']}), interleaved in one process: admit a new "
            "key, claim it, write its sealed receipt. `open` is opening a store and its first "
            "read. Times in ms; the last column is PostgreSQL p50 over SQLite p50.",
            md_table(
                ["call", "n", "SQLite p50", "SQLite p99", "PG p50", "PG p99", "PG / SQLite"],
                rows,
            ),
        ]
    )


if __name__ == "__main__":
    _data, text = run("--quick" in sys.argv)
    print(text)
