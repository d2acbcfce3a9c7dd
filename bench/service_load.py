"""service_load: `/healthz` under 200 HTTP clients and 500 idle SSE followers, per backend.

`settled serve` runs as a real process over a home of each backend in turn (SQLite + a local
object directory; PostgreSQL + S3 from the test servers, tests/pg.py and tests/s3.py, when they
can start here). In each, one task holds ``LONG`` sessions that print one line and then block on
a shared flock gate the benchmark holds (idle, no CPU). Follower processes (``FOLLOWER_PROCS``,
raw sockets on asyncio) open the SSE streams and keep them open: ``SESSION_FOLLOWERS`` on
`/v1/sessions/{s}/events` of the gated sessions, ``LIVE_FOLLOWERS`` on `/v1/events?follow=1`.
A prober process asks `GET /healthz` on a new connection every ``PROBE_EVERY_S``: first with
the followers alone (phase ``idle``), then while ``CLIENTS`` client threads in
``CLIENT_PROCS`` processes each admit a short command (`true`) with a new key and long-poll its
receipt (`GET /v1/sessions/{s}?wait=60`), again and again (phase ``load``). Then the gate opens:
every session follower must end with its `end` event; then the server is stopped (SIGTERM) and
every live follower must end with a `stop` event (or, on a server that sends none, at least not
before the stop). A stream that ends otherwise ended early: counted, with how it ended.

Reported per backend: /healthz p50/p99/max per phase, the clients' admissions and receipts per
second and their latency, and every stream's ending. Nothing is asserted; the numbers are
absolute on a shared 2-core machine (the header shows its load).

    .venv/bin/python bench/run.py service_load [--quick]

Over 400 lines for a reason: the follower, client and prober processes are this file run with
a role (`python bench/service_load.py follower|clients|prober ...`), so the whole rig is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http.client
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from common import (
    _release_pods,
    _stop_journals,
    distribution,
    fmt,
    header,
    log,
    machine,
    md_table,
    scratch,
    source_revision,
)

TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
SRC_DIR = os.path.join(os.path.dirname(TESTS_DIR), "src")
FULL = {"long": 50, "session_followers": 450, "live_followers": 50, "clients": 200,
        "client_procs": 4, "follower_procs": 5, "idle_s": 10.0, "load_s": 60.0}  # fmt: skip
QUICK = {"long": 10, "session_followers": 90, "live_followers": 10, "clients": 40,
         "client_procs": 2, "follower_procs": 2, "idle_s": 5.0, "load_s": 15.0}  # fmt: skip
PROBE_EVERY_S = 0.05
PROBE_TIMEOUT_S = 30.0
PROBER_NICE = -10
START_S = 60.0
END_S = 90.0  # the gate opened: every session follower's end event within this
TOKEN = os.environ.setdefault("SETTLED_BENCH_TOKEN", "bench-service-load-" + secrets.token_hex(8))
SAMPLE_ENV = "SETTLED_BENCH_SAMPLE"  # a path: the server's thread stacks sampled into it
BACKENDS_ENV = "SETTLED_SERVICE_LOAD_BACKENDS"  # comma-separated: run only these


DESCRIPTION = (
    "`settled serve` as a process; {long} sessions blocked on a gate, followed by "
    "{session_followers} SSE streams (`/v1/sessions/{{s}}/events`) and {live_followers} "
    "live-view streams (`/v1/events?follow=1`) from {follower_procs} processes; phase `idle`: "
    "the followers alone for {idle_s:.0f} s; phase `load`: plus {clients} client threads in "
    "{client_procs} processes, each admitting `true` and long-polling its receipt, for "
    "{load_s:.0f} s. `/healthz` on a new connection every {probe_ms:.0f} ms. CPU: the server "
    "process's share of the machine's cores, the time its event loop waited runnable for a "
    "core, and the machine's idle share, over each phase. "
    "Then the gate opens (every session stream must end with `end`), the task is closed and "
    "the server is stopped (every live stream must end with `stop`)."
)


# -- a tiny HTTP client for SSE (the follower processes) ------------------------------------


async def _follow(host: str, port: int, path: str, ready: asyncio.Event) -> dict[str, Any]:
    """One SSE stream to its end: which events came, and how it ended (the last event, a
    clean end of the chunked body, or a cut connection)."""
    result: dict[str, Any] = {"path": path, "events": 0, "last": None, "how": None}
    try:
        reader, writer = await asyncio.open_connection(host, port)
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Accept: text/event-stream\r\n\r\n"
        )
        writer.write(request.encode())
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            result["how"] = f"status {status}"
            ready.set()
            return result
        buffer = b""
        while True:
            size_line = await reader.readline()
            if not size_line:
                result["how"] = "cut"
                break
            size = int(size_line.strip() or b"0", 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                result["how"] = "clean"
                break
            buffer += chunk[:-2]
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                if block.startswith(b":"):
                    continue
                result["events"] += 1
                name = next(
                    (ln[7:].decode() for ln in block.split(b"\n") if ln.startswith(b"event: ")),
                    "message",
                )
                result["last"] = name
                ready.set()
        writer.close()
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        result["how"] = result["how"] or f"error {type(exc).__name__}"
    result["ended_at"] = time.time()
    ready.set()
    return result


async def _followers(host: str, port: int, paths: list[str]) -> list[dict[str, Any]]:
    readies = [asyncio.Event() for _ in paths]
    tasks = [
        asyncio.create_task(_follow(host, port, p, r)) for p, r in zip(paths, readies, strict=True)
    ]
    await asyncio.gather(*(r.wait() for r in readies))
    print("ready", flush=True)
    await asyncio.gather(
        *(t for t, p in zip(tasks, paths, strict=True) if p.startswith("/v1/sessions/"))
    )
    print("sessions ended", flush=True)
    return list(await asyncio.gather(*tasks))


def follower_main(host: str, port: int, paths_file: str, out: str) -> None:
    with open(paths_file) as handle:
        paths = json.load(handle)
    results = asyncio.run(_followers(host, port, paths))
    with open(out, "w") as handle:
        json.dump(results, handle)


# -- clients and the prober ----------------------------------------------------------------


def _request(
    conn: http.client.HTTPConnection, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"null")


def _client(host: str, port: int, task: str, until: float, rows: list[dict[str, Any]]) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=120)
    while time.time() < until:
        row: dict[str, Any] = {}
        try:
            started = time.monotonic()
            key = secrets.token_hex(8)
            status, body = _request(
                conn, "POST", f"/v1/tasks/{task}/sessions", {"key": key, "argv": ["true"]}
            )
            row["admit_s"] = time.monotonic() - started
            if status not in (200, 201):
                row["error"] = f"admit {status}"
            else:
                status, view = _request(conn, "GET", f"/v1/sessions/{body['session']}?wait=60")
                row["receipt_s"] = time.monotonic() - started
                if status != 200 or "receipt" not in view:
                    row["error"] = f"receipt {status}"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            row["error"] = type(exc).__name__
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=120)
        rows.append(row)


def clients_main(host: str, port: int, task: str, threads: int, until: float, out: str) -> None:
    rows: list[dict[str, Any]] = []
    workers = [
        threading.Thread(target=_client, args=(host, port, task, until, rows), daemon=True)
        for _ in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=max(1.0, until - time.time() + 180))
    with open(out, "w") as handle:
        json.dump(rows, handle)


def prober_main(host: str, port: int, until: float, out: str) -> None:
    """`GET /healthz` on a new connection every PROBE_EVERY_S (as a health checker asks)."""
    samples: list[dict[str, Any]] = []
    with contextlib.suppress(PermissionError):  # measure the server, not this process's turn
        os.setpriority(os.PRIO_PROCESS, 0, PROBER_NICE)
    while time.time() < until:
        at, started = time.time(), time.monotonic()
        try:
            conn = http.client.HTTPConnection(host, port, timeout=PROBE_TIMEOUT_S)
            conn.connect()
            connected = time.monotonic() - started
            conn.request("GET", "/healthz")
            ok = conn.getresponse().status == 200
            conn.close()
        except (OSError, http.client.HTTPException):
            ok, connected = False, 0.0
        samples.append(
            {"at": at, "s": time.monotonic() - started, "ok": ok, "connect_s": connected}
        )
        time.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - started)))
    with open(out, "w") as handle:
        json.dump(samples, handle)


# -- one backend ---------------------------------------------------------------------------


def _child(role: str, *args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC_DIR}
    argv = [sys.executable, os.path.abspath(__file__), role, *map(str, args)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)


@contextlib.contextmanager
def _server(
    root: str, env: dict[str, str], label: str
) -> Iterator[tuple[subprocess.Popen[bytes], str, int]]:
    home, errors = os.path.join(root, "home"), os.path.join(root, "server.log")
    code = "import sys; from settled.server import serve; sys.exit(serve(sys.argv[1], port=0))"
    full = {**os.environ, **env, "SETTLED_TOKEN": TOKEN, "PYTHONPATH": SRC_DIR}
    sample = os.environ.get(SAMPLE_ENV)
    if sample:  # the server's stacks, sampled (bench/stack_sampler.py)
        full["PYTHONPATH"] += os.pathsep + os.path.dirname(os.path.abspath(__file__))
        code = f"import stack_sampler; stack_sampler.start({sample + '.' + label!r}); " + code
    with open(errors, "ab") as sink:
        server = subprocess.Popen(
            [sys.executable, "-c", code, home],
            env=full,
            stdout=sink,
            stderr=sink,
            start_new_session=True,  # a service of its own, as under a service manager
        )
    try:
        give_up = time.monotonic() + START_S
        while time.monotonic() < give_up:
            with open(errors, errors="replace") as handle:
                lines = [ln for ln in handle if "listening on http://" in ln]
            if lines:
                address = lines[0].split("listening on http://")[1].split()[0]
                host, _, port = address.rpartition(":")
                yield server, host, int(port)
                return
            if server.poll() is not None:
                break
            time.sleep(0.05)
        with open(errors, errors="replace") as handle:
            raise RuntimeError(f"the server did not start: {handle.read()[-2000:]}")
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _setup(host: str, port: int, root: str, sizes: dict[str, Any]) -> tuple[str, list[str]]:
    workspace = os.path.join(root, "workspace")
    os.makedirs(workspace)
    conn = http.client.HTTPConnection(host, port, timeout=120)
    status, task = _request(conn, "POST", "/v1/tasks", {"workspace": workspace})
    if status != 201:
        raise RuntimeError(f"task: {status} {task}")
    gate = os.path.join(root, "gate")
    command = f"echo started; flock -s {gate} true; echo done"
    sessions = []
    for i in range(sizes["long"]):
        status, body = _request(
            conn, "POST", f"/v1/tasks/{task['task']}/sessions", {"key": f"long-{i}",
            "argv": ["sh", "-c", command]},
        )  # fmt: skip
        if status != 201:
            raise RuntimeError(f"long session: {status} {body}")
        sessions.append(body["session"])
    return task["task"], sessions


def _paths(sessions: list[str], sizes: dict[str, Any]) -> list[str]:
    each = sizes["session_followers"] // len(sessions)
    paths = [f"/v1/sessions/{s}/events?stream=stdout" for s in sessions for _ in range(each)]
    return paths + ["/v1/events?follow=1"] * sizes["live_followers"]


def one_backend(name: str, env: dict[str, str], sizes: dict[str, Any]) -> dict[str, Any]:
    with scratch(f"service-{name}") as root, _server(root, env, name) as (server, host, port):
        gate_path = os.path.join(root, "gate")
        gate = os.open(gate_path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            task, sessions = _setup(host, port, root, sizes)
            paths = _paths(sessions, sizes)
            per = -(-len(paths) // sizes["follower_procs"])
            followers = []
            for n in range(sizes["follower_procs"]):
                listed = os.path.join(root, f"paths-{n}.json")
                with open(listed, "w") as handle:
                    json.dump(paths[n * per : (n + 1) * per], handle)
                out = os.path.join(root, f"followers-{n}.json")
                followers.append((_child("follower", host, port, listed, out), out))
            for child, _ in followers:
                assert child.stdout is not None
                child.stdout.readline()  # "ready": every stream answered its first event
            log(f"  {name}: {len(paths)} followers open")
            phases = {}
            for phase in ("idle", "load"):
                seconds = sizes[f"{phase}_s"]
                until = time.time() + seconds
                probe_out = os.path.join(root, f"probe-{phase}.json")
                before = _cpu(server.pid)
                waited = _run_queue_s(server.pid)
                prober = _child("prober", host, port, until, probe_out)
                clients = []
                if phase == "load":
                    per_proc = sizes["clients"] // sizes["client_procs"]
                    for n in range(sizes["client_procs"]):
                        out = os.path.join(root, f"clients-{n}.json")
                        clients.append((_child("clients", host, port, task, per_proc, until,
                                                out), out))  # fmt: skip
                prober.wait()
                rows = []
                for child, out in clients:
                    child.wait()
                    with open(out) as handle:
                        rows += json.load(handle)
                with open(probe_out) as handle:
                    phases[phase] = {"probes": json.load(handle), "clients": rows}
                after = _cpu(server.pid)
                phases[phase]["server_nice"] = _nices(server.pid)
                with open(f"/proc/{server.pid}/autogroup") as handle:
                    phases[phase]["server_group"] = handle.read().strip()
                phases[phase]["loop_run_queue_s"] = _run_queue_s(server.pid) - waited
                phases[phase]["server_cpu"] = (after[0] - before[0]) / (after[1] - before[1])
                phases[phase]["idle_cpu"] = (after[2] - before[2]) / (after[1] - before[1])
                log(f"  {name}: phase {phase} done")
            opened = time.time()
            fcntl.flock(gate, fcntl.LOCK_UN)
            give_up = time.monotonic() + END_S
            for child, _ in followers:
                assert child.stdout is not None
                left = max(0.0, give_up - time.monotonic())
                select.select([child.stdout], [], [], left)  # "sessions ended", or give up
            closed = _request(http.client.HTTPConnection(host, port, timeout=120), "POST",
                              f"/v1/tasks/{task}/close", {"deadline": 60})[0]  # fmt: skip
            log(f"  {name}: the task closed ({closed})")
            stopped = time.time()
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
            streams = []
            for child, out in followers:
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                if os.path.exists(out):
                    with open(out) as handle:
                        streams += json.load(handle)
        finally:
            os.close(gate)
            _stop_journals(os.path.join(root, "home"))
            _release_pods(os.path.join(root, "home"))
        return {"phases": phases, "streams": streams, "opened": opened, "stopped": stopped,
                "expected_streams": len(paths)}  # fmt: skip


def _run_queue_s(pid: int) -> float:
    """How long the server's main thread (its event loop) has waited for a core, runnable."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as handle:
        return int(handle.read().split()[1]) / 1e9


def _nices(pid: int) -> list[int]:
    """The distinct priorities (nice) of the server's threads."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat") as handle:
            found.add(int(handle.read().rsplit(")", 1)[1].split()[16]))
    return sorted(found)


def _cpu(pid: int) -> tuple[float, float, float]:
    """(the server's CPU seconds, the machine's wall seconds x cores, its idle CPU seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    with open("/proc/stat") as handle:
        cpu = [int(v) for v in handle.readline().split()[1:]]
    return (int(fields[11]) + int(fields[12])) / tick, sum(cpu) / tick, (cpu[3] + cpu[4]) / tick


# -- backends and the page -------------------------------------------------------------------


@contextlib.contextmanager
def _backends(root: str) -> Iterator[dict[str, dict[str, str]]]:
    sys.path.insert(0, TESTS_DIR)
    import pg
    import s3 as weed_server

    configs: dict[str, dict[str, str]] = {"sqlite+local": {}}
    cluster = weed = None
    try:
        if pg.missing_reason() is None and weed_server.weed_binary() is not None:
            cluster = pg.start_cluster()
            os.environ[pg.URL_ENV] = cluster.url()
            weed = weed_server.start(os.path.join(root, "weed"))
            weed_server.make_buckets(weed)
            configs["postgresql+s3"] = {
                "SETTLED_STORE": pg.url_for_directory(os.path.join(root, "pg")),
                "SETTLED_OBJECTS": f"s3://{weed_server.VERSIONED_BUCKET}/bench-service",
                **weed.env(),
            }
        else:
            log("  no PostgreSQL + S3 here: only sqlite+local")
        wanted = os.environ.get(BACKENDS_ENV)
        if wanted:
            configs = {k: v for k, v in configs.items() if k in wanted.split(",")}
        yield configs
    finally:
        if weed is not None:
            weed.stop()
        if cluster is not None:
            cluster.stop()


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for phase, data in result["phases"].items():
        probes = data["probes"]
        ok = [p["s"] * 1000 for p in probes if p["ok"]]
        rows = data["clients"]
        summary[phase] = {
            "healthz_ms": distribution(ok) if ok else {},
            "connect_ms": distribution([p["connect_s"] * 1000 for p in probes if p["ok"]]),
            "probes": len(probes),
            "probe_failures": sum(1 for p in probes if not p["ok"]),
            "server_cpu": data["server_cpu"],
            "idle_cpu": data["idle_cpu"],
            "server_nice": data["server_nice"],
            "loop_run_queue_s": data["loop_run_queue_s"],
            "server_group": data["server_group"],
            "receipts": sum(1 for r in rows if "receipt_s" in r and "error" not in r),
            "client_errors": sum(1 for r in rows if "error" in r),
            "receipt_ms": distribution([r["receipt_s"] * 1000 for r in rows if "receipt_s" in r])
            if rows
            else {},
        }
    endings: dict[str, dict[str, int]] = {}
    for stream in result["streams"]:
        kind = "session" if stream["path"].startswith("/v1/sessions/") else "live"
        ended_at = stream.get("ended_at", 0.0)
        if stream["last"] in ("end", "stop"):
            how = f"{stream['last']} event"
        elif ended_at >= result["stopped"]:
            how = f"at the server stop, no last event ({stream['how']})"
        else:
            how = f"EARLY: last {stream['last']}, {stream['how']}"
        endings.setdefault(kind, {}).setdefault(how, 0)
        endings[kind][how] += 1
    summary["endings"] = endings
    summary["streams"] = len(result["streams"])
    summary["expected_streams"] = result["expected_streams"]
    summary["early"] = sum(n for e in endings.values() for how, n in e.items() if "EARLY" in how)
    return summary


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "quick": quick, "sizes": sizes}
    data["revision"] = source_revision()
    with scratch("service-backends") as root, _backends(root) as configs:
        for name, env in configs.items():
            log(f"  backend {name}")
            data[name] = summarize(one_backend(name, env, sizes))
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    sizes = data["sizes"]
    backends = [k for k in ("sqlite+local", "postgresql+s3") if k in data]
    rows = []
    for name in backends:
        for phase in ("idle", "load"):
            s = data[name][phase]
            d = s["healthz_ms"]
            rows.append([name, phase, s["probes"], s["probe_failures"], fmt(d.get("p50")),
                         fmt(d.get("p99")), fmt(d.get("max")), s["receipts"],
                         s["client_errors"], fmt(s["receipt_ms"].get("p50")),
                         fmt(s["receipt_ms"].get("p99")), f"{s['server_cpu']:.0%}",
                         fmt(s.get("loop_run_queue_s"), 1), f"{s['idle_cpu']:.0%}"])  # fmt: skip
    endings = []
    for name in backends:
        for kind, hows in sorted(data[name]["endings"].items()):
            for how, count in sorted(hows.items()):
                endings.append([name, kind, how, count])
    return "\n\n".join(
        [
            "# service_load: /healthz under 200 clients and 500 idle SSE followers",
            header("service_load", data),
            DESCRIPTION.format(**sizes, probe_ms=PROBE_EVERY_S * 1000),
            md_table(
                [
                    "backend",
                    "phase",
                    "probes",
                    "failed",
                    "healthz p50 ms",
                    "p99 ms",
                    "max ms",
                    "receipts",
                    "client errors",
                    "receipt p50 ms",
                    "p99 ms",
                    "server CPU",
                    "loop waited for a core s",
                    "machine idle",
                ],
                rows,
            ),
            "**How each stream ended** (EARLY: before its session ended or the server stopped)",
            md_table(["backend", "stream", "ended", "count"], endings),
        ]
    )


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "follower":
        follower_main(args[0], int(args[1]), args[2], args[3])
    elif role == "clients":
        clients_main(args[0], int(args[1]), args[2], int(args[3]), float(args[4]), args[5])
    elif role == "prober":
        prober_main(args[0], int(args[1]), float(args[2]), args[3])
