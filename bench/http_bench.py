"""http: output and admission through `settled serve` over loopback, against the local Runtime.

Streaming: one session writes 1 GiB of /dev/urandom (quick: 64 MiB) to its stdout log; then, in
each run and interleaved in the same loop, the same log is read to its final cursor (a) locally
with a `Runtime.read` loop of 1 MiB (what `settled logs` does; the baseline), (b) over HTTP from
`GET /v1/sessions/{s}/output` with httpx, (c) the same with curl (a C client: the server's own
ceiling, when curl is installed) and (d) from `GET /v1/sessions/{s}/events` (SSE, base64, ids
= cursors) with httpx, decoding every event. Every read runs from the page cache (the log was
just written and is re-read every run), so all four compare like with like. A verification pass
after the timed runs checks that (b) and (d) return the log's blake3 digest from the receipt.

Admission: `POST /v1/tasks/{t}/sessions` with a new key each time and argv `true`, until the
response arrives, at concurrency 1 and 32 (32 client threads, each its own connection),
interleaved in blocks with the local baseline: `Runtime.exec` in this process with the warm
launcher (concurrency 32: 32 threads, each its own Runtime, sharing one warm launcher, as the
server does). Every session is waited to its receipt (untimed) and its owner awaited.

The server is a subprocess (`settled.server.serve`, port 0) carrying the benchmark mark; after
it is stopped, /proc is scanned for the mark and stragglers are killed and counted (`left`).
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from common import (
    MARK_ENV,
    MIB,
    distribution,
    end_process,
    fmt,
    header,
    kill_marked,
    log,
    machine,
    md_table,
    median,
    settled_rig,
    source_revision,
)

FULL = {"size": 1 << 30, "stream_runs": 5, "admissions": 320, "blocks": 5}
QUICK = {"size": 64 << 20, "stream_runs": 3, "admissions": 50, "blocks": 5}
CONCURRENCY = (1, 32)
READ_CHUNK = MIB
SERVER_CODE = "import sys; from settled.server import serve; sys.exit(serve(sys.argv[1], port=0))"
START_S = 60.0
READ_TIMEOUT_S = 600.0


# -- the server -------------------------------------------------------------------------------


class ServerProcess:
    def __init__(self, root: str, home: str, token: str, mark: str) -> None:
        self.log_path = os.path.join(root, "server.log")
        env = {**os.environ, "SETTLED_TOKEN": token, MARK_ENV: mark}
        with open(self.log_path, "ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-c", SERVER_CODE, home],
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
            )
        self.url = self._listening()
        self.headers = {"Authorization": f"Bearer {token}"}

    def _listening(self) -> str:
        give_up = time.monotonic() + START_S
        while time.monotonic() < give_up:
            with open(self.log_path, errors="replace") as handle:
                for line in handle:
                    if "listening on http://" in line:
                        url = line.split("listening on ")[1].split()[0]
                        if self._healthy(url):
                            return url
            if self.process.poll() is not None:
                raise RuntimeError(f"settled serve exited {self.process.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"settled serve did not start in {START_S} s; see {self.log_path}")

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=READ_TIMEOUT_S)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log("warning: settled serve ignored SIGTERM for 30 s; killing it")
                self.process.kill()
                self.process.wait(timeout=10)


# -- streaming --------------------------------------------------------------------------------


def _timed(read: Callable[[], int], expect: int, what: str) -> float:
    started = time.perf_counter()
    got = read()
    elapsed = time.perf_counter() - started
    if got != expect:
        raise RuntimeError(f"{what} read {got} bytes, expected {expect}")
    return elapsed


def _local(rt: Any, session: str) -> int:
    cursor = 0
    while chunk := rt.read(session, "stdout", cursor, READ_CHUNK):
        cursor += len(chunk)
    return cursor


def _raw(server: ServerProcess, session: str, sink: Callable[[bytes], None] | None = None) -> int:
    total = 0
    with (
        server.client() as client,
        client.stream("GET", f"/v1/sessions/{session}/output") as response,
    ):
        response.raise_for_status()
        for chunk in response.iter_raw():
            total += len(chunk)
            if sink is not None:
                sink(chunk)
    return total


def _curl(server: ServerProcess, session: str) -> int:
    done = subprocess.run(
        [
            *("curl", "-sS", "--fail", "-o", "/dev/null", "-w", "%{size_download}"),
            *("-H", f"Authorization: {server.headers['Authorization']}"),
            f"{server.url}/v1/sessions/{session}/output",
        ],
        capture_output=True,
        text=True,
        timeout=READ_TIMEOUT_S,
        check=True,
    )
    return int(done.stdout.strip())


def _sse(server: ServerProcess, session: str, sink: Callable[[bytes], None] | None = None) -> int:
    events = SseCounter(sink)
    with (
        server.client() as client,
        client.stream("GET", f"/v1/sessions/{session}/events") as response,
    ):
        response.raise_for_status()
        for chunk in response.iter_raw():
            events.feed(chunk)
    if not events.ended:
        raise RuntimeError("the event stream ended without `event: end`")
    return events.total


class SseCounter:
    """A byte-level SSE client (as a real one would be): lines found with a one-byte search,
    events dispatched on the blank line, every `data` base64-decoded and every `id` checked to
    be the cursor after its chunk."""

    def __init__(self, sink: Callable[[bytes], None] | None) -> None:
        self.sink, self.total, self.ended = sink, 0, False
        self._buffer = bytearray()
        self._kind, self._id, self._data = b"", b"", b""

    def feed(self, chunk: bytes) -> None:
        buffer = self._buffer
        buffer += chunk
        pos = 0
        while (newline := buffer.find(b"\n", pos)) >= 0:
            self._line(bytes(buffer[pos:newline]))
            pos = newline + 1
        del buffer[:pos]

    def _line(self, line: bytes) -> None:
        if not line:
            self._dispatch()
        elif line.startswith(b"data: "):
            self._data = line[6:]
        elif line.startswith(b"id: "):
            self._id = line[4:]
        elif line.startswith(b"event: "):
            self._kind = line[7:]

    def _dispatch(self) -> None:
        kind, event_id, data = self._kind, self._id, self._data
        self._kind, self._id, self._data = b"", b"", b""
        if not data:
            return  # a keep-alive comment
        if kind == b"end":
            self.ended = True
            return
        if kind == b"error":
            raise RuntimeError(f"the event stream reported an error: {data.decode()}")
        chunk = base64.b64decode(data)
        self.total += len(chunk)
        if int(event_id) != self.total:
            raise RuntimeError(f"event id {event_id!r} is not the cursor {self.total}")
        if self.sink is not None:
            self.sink(chunk)


def _verify(server: ServerProcess, session: str, digest: str) -> dict[str, bool]:
    import blake3

    out = {}
    for name, read in (("raw", _raw), ("sse", _sse)):
        hasher = blake3.blake3()
        read(server, session, hasher.update)
        out[name] = "blake3:" + hasher.hexdigest() == digest
    return out


def _streaming(rig: Any, server: ServerProcess, p: dict[str, Any]) -> dict[str, Any]:
    size = p["size"]
    admission = rig.exec(argv=["head", "-c", str(size), "/dev/urandom"])
    receipt = rig.runtime.wait(admission.session, timeout=READ_TIMEOUT_S)["receipt"]
    end_process(receipt["owner"]["pid"], "session owner")
    if receipt["output"]["stdout"]["cursor"] != size:
        raise RuntimeError(f"the log holds {receipt['output']['stdout']['cursor']} bytes")
    session, curl = admission.session, shutil.which("curl") is not None
    runs = []
    for i in range(p["stream_runs"]):
        row: dict[str, Any] = {"run": i + 1}
        row["local_s"] = _timed(lambda: _local(rig.runtime, session), size, "local")
        row["raw_s"] = _timed(lambda: _raw(server, session), size, "raw httpx")
        row["curl_s"] = _timed(lambda: _curl(server, session), size, "curl") if curl else None
        row["sse_s"] = _timed(lambda: _sse(server, session), size, "sse")
        row["raw_ratio"] = row["local_s"] / row["raw_s"]
        row["sse_ratio"] = row["local_s"] / row["sse_s"]
        runs.append(row)
        log(
            f"http stream {i + 1}/{p['stream_runs']}: local {size / row['local_s'] / 1e9:.2f} "
            f"GB/s, raw {size / row['raw_s'] / 1e9:.2f} GB/s, sse "
            f"{size / row['sse_s'] / 1e9:.2f} GB/s"
        )
    verified = _verify(server, session, receipt["output"]["stdout"]["digest"])
    rig.forget_logs(session)
    return {"session": session, "runs": runs, "verified": verified, "curl": curl}


# -- admission --------------------------------------------------------------------------------


def _http_worker(server: ServerProcess, task: str, keys: list[str], out: list[Any]) -> None:
    with server.client() as client:
        for key in keys:
            body = {"key": key, "argv": ["true"]}
            started = time.perf_counter()
            answer = client.post(f"/v1/tasks/{task}/sessions", json=body)
            elapsed = time.perf_counter() - started
            if answer.status_code != 201:
                raise RuntimeError(f"admission {key}: {answer.status_code} {answer.text}")
            out.append((elapsed, answer.json()["session"], answer.json()["owner_pid"]))


def _local_worker(home: str, launcher: Any, task: str, keys: list[str], out: list[Any]) -> None:
    from settled.runtime import Runtime

    with Runtime(home, shared_launcher=launcher) as rt:
        for key in keys:
            started = time.perf_counter()
            admission = rt.exec(task, argv=["true"], key=key)
            out.append((time.perf_counter() - started, admission.session, admission.owner_pid))


def _block(target: Callable[..., None], args: tuple[Any, ...], n: int, width: int) -> list[Any]:
    """`n` admissions split over `width` threads; [(seconds, session, owner pid)]."""
    tag = secrets.token_hex(4)
    keys = [f"bench-{tag}-{i}" for i in range(n)]
    out: list[Any] = []
    errors: list[BaseException] = []

    def body(share: list[str]) -> None:
        try:
            target(*args, share, out)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(keys[w::width],)) for w in range(width)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=READ_TIMEOUT_S)
    if errors:
        raise errors[0]
    return out


def _settle(rig: Any, results: list[Any]) -> None:
    for _, session, owner in results:
        rig.sessions.append(session)
        view = rig.runtime.wait(session, timeout=60.0)
        if view["receipt"]["exit"].get("code") != 0:
            raise RuntimeError(f"session {session}: {view['receipt']['exit']}")
        end_process(owner, "session owner")


def _admissions(rig: Any, server: ServerProcess, p: dict[str, Any]) -> dict[str, Any]:
    from settled.owner.zygote import WarmLauncher

    launcher = WarmLauncher()
    out: dict[str, Any] = {}
    try:
        for width in CONCURRENCY:
            http_s, local_s = [], []
            # at least two admissions per thread per block, so all `width` threads overlap
            blocks = max(1, min(p["blocks"], p["admissions"] // (2 * width)))
            per_block = p["admissions"] // blocks
            for b in range(blocks):
                local_args = (rig.runtime.home, launcher, rig.task)
                for name, target, args, sink in (
                    ("http", _http_worker, (server, rig.task), http_s),
                    ("local", _local_worker, local_args, local_s),
                ):
                    t0 = time.perf_counter()
                    results = _block(target, args, per_block, width)
                    wall = time.perf_counter() - t0
                    sink.extend(r[0] for r in results)
                    out.setdefault(f"{name}_{width}_wall_s", []).append(wall)
                    _settle(rig, results)
                log(f"http admission c={width} block {b + 1}/{blocks}")
            out[str(width)] = {
                "http_s": http_s,
                "local_s": local_s,
                "blocks": blocks,
                "per_block": per_block,
            }
    finally:
        launcher.close()
    return out


# -- the benchmark ----------------------------------------------------------------------------


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    mark = f"http-{os.getpid()}-{secrets.token_hex(4)}"
    data: dict[str, Any] = {
        "benchmark": "http",
        "quick": quick,
        "machine": machine(),
        "source": source_revision(),
        "params": {**p, "concurrency": list(CONCURRENCY), "read_chunk": READ_CHUNK},
    }
    with settled_rig("http", launcher="warm") as rig:
        server = ServerProcess(rig.root, rig.runtime.home, secrets.token_urlsafe(32), mark)
        try:
            data["streaming"] = _streaming(rig, server, p)
            data["admission"] = _admissions(rig, server, p)
            rig.runtime.close_task(rig.task, deadline=120.0)  # stops the task's journal
        finally:
            server.stop()
            data["left"] = len(kill_marked(mark))
    data["summary"] = _summary(data)
    return data, render(data)


def _summary(data: dict[str, Any]) -> dict[str, Any]:
    size, runs = data["params"]["size"], data["streaming"]["runs"]
    gbs = {
        name: median([size / r[f"{name}_s"] / 1e9 for r in runs if r[f"{name}_s"]] or [0.0])
        for name in ("local", "raw", "curl", "sse")
    }
    admission = {}
    for width in CONCURRENCY:
        a = data["admission"][str(width)]
        http_d, local_d = distribution(a["http_s"]), distribution(a["local_s"])
        admission[str(width)] = {
            "http_ms": {k: v * 1e3 if k != "n" else v for k, v in http_d.items()},
            "local_ms": {k: v * 1e3 if k != "n" else v for k, v in local_d.items()},
            "p50_ratio": http_d["p50"] / local_d["p50"],
            "p99_ratio": http_d["p99"] / local_d["p99"],
            "http_per_s": len(a["http_s"]) / sum(data["admission"][f"http_{width}_wall_s"]),
            "local_per_s": len(a["local_s"]) / sum(data["admission"][f"local_{width}_wall_s"]),
        }
    return {
        "median_gb_s": gbs,
        "raw_over_local": gbs["raw"] / gbs["local"],
        "curl_over_local": gbs["curl"] / gbs["local"] if gbs["curl"] else None,
        "sse_over_local": gbs["sse"] / gbs["local"],
        "admission": admission,
    }


def render(data: dict[str, Any]) -> str:
    p, s, st = data["params"], data["summary"], data["streaming"]
    size = p["size"]
    mib = size // MIB
    stream_rows = [
        [
            r["run"],
            fmt(size / r["local_s"] / 1e9),
            fmt(size / r["raw_s"] / 1e9),
            fmt(size / r["curl_s"] / 1e9) if r["curl_s"] else "-",
            fmt(size / r["sse_s"] / 1e9),
            fmt(r["raw_ratio"]),
            fmt(r["sse_ratio"]),
        ]
        for r in st["runs"]
    ]
    g = s["median_gb_s"]
    stream_rows.append(
        [
            "median",
            fmt(g["local"]),
            fmt(g["raw"]),
            fmt(g["curl"]) if g["curl"] else "-",
            fmt(g["sse"]),
            fmt(s["raw_over_local"]),
            fmt(s["sse_over_local"]),
        ]
    )
    adm_rows = []
    for width in CONCURRENCY:
        a = s["admission"][str(width)]
        h, lo = a["http_ms"], a["local_ms"]
        adm_rows.append(
            [
                width,
                h["n"],
                fmt(h["p50"]),
                fmt(h["p90"]),
                fmt(h["p99"]),
                fmt(h["max"]),
                fmt(lo["p50"]),
                fmt(lo["p99"]),
                fmt(a["p50_ratio"]),
                fmt(a["p99_ratio"]),
                fmt(a["http_per_s"], 0),
                fmt(a["local_per_s"], 0),
            ]
        )
    verified = ", ".join(f"{k} {'ok' if v else '**MISMATCH**'}" for k, v in st["verified"].items())
    return "\n\n".join(
        [
            header("http", data),
            f"Streaming one {mib} MiB stdout log (random bytes) to its final cursor, "
            f"{p['stream_runs']} runs, interleaved local, raw httpx, raw curl, SSE; all from the "
            "page cache, server and client on the same machine (they share its CPUs). Ratio = "
            "HTTP throughput / local throughput (1.00 = as fast as reading locally). Digest "
            f"check of the bytes received (blake3 vs the receipt): {verified}.",
            md_table(
                [
                    "run",
                    "local `Runtime.read` GB/s",
                    "raw httpx GB/s",
                    "raw curl GB/s",
                    "SSE httpx GB/s (decoded bytes)",
                    "raw/local",
                    "SSE/local",
                ],
                stream_rows,
            ),
            "Admission round trip of `true` (new key each time): HTTP `POST .../sessions` until "
            "the response, against `Runtime.exec` in-process with the warm launcher, in "
            "interleaved blocks (HTTP, local, HTTP, ...; "
            + ", ".join(
                f"c={w}: {data['admission'][str(w)]['blocks']} x "
                f"{data['admission'][str(w)]['per_block']}"
                for w in CONCURRENCY
            )
            + "); ms; throughput = admissions / wall time of the blocks.",
            md_table(
                [
                    "concurrency",
                    "n",
                    "HTTP p50",
                    "HTTP p90",
                    "HTTP p99",
                    "HTTP max",
                    "local p50",
                    "local p99",
                    "p50 HTTP/local",
                    "p99 HTTP/local",
                    "HTTP adm/s",
                    "local adm/s",
                ],
                adm_rows,
            ),
            f"Processes left carrying the benchmark's mark after the server stopped: "
            f"**{data['left']}** (must be 0). Source `{data['source']}`.",
        ]
    )
