"""netproxy: what settled's proxy costs a command, measured inside real sessions.

Three figures, each against a baseline of the same run:
- a download of `size` bytes from an HTTP server on the host's loopback (this process, a
  thread), by curl in the session: through the proxy (`--network proxy`, the server granted
  with --allow-host) against a direct download (`--network host`); curl's own `time_total`,
  so the session's start is not in it. Interleaved runs; the ratio of p50s.
- the added cost of a connection: one session makes `requests` sequential plain-HTTP requests
  of a small body with Python's http.client, each on a new connection, through the proxy and
  directly; the per-request p50 difference.
- admission: `true` admitted with `--network proxy` (the task's listener already made) against
  `--network none` (the same namespace, no proxy to ask), exec to its return, interleaved.
The proxy daemon is the home's, stopped at the end.
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import socket
import threading
from typing import Any

from common import (
    comparison_rows,
    distribution,
    fmt,
    header,
    interleaved,
    log,
    machine,
    md_table,
    settled_rig,
    source_revision,
    timed_admission,
)

FULL = {"size": 256 << 20, "downloads": 7, "requests": 400, "admissions": 100}
QUICK = {"size": 32 << 20, "downloads": 2, "requests": 40, "admissions": 10}
CHUNK = b"\0" * (1 << 20)

REQUESTS = """
import http.client, json, os, sys, time
port, n, via = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
times = []
for _ in range(n):
    start = time.perf_counter()
    if via == "proxy":
        conn = http.client.HTTPConnection("127.0.0.1", 3128, timeout=10)
        conn.request("GET", f"http://127.0.0.1:{port}/small")
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/small")
    body = conn.getresponse().read()
    conn.close()
    assert len(body) == 16, body
    times.append((time.perf_counter() - start) * 1000)
print(json.dumps(times))
"""


class _Server(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    size = 0

    def do_GET(self) -> None:  # http.server's name
        size = 16 if self.path == "/small" else self.size
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Connection", "close")
        self.end_headers()
        left = size
        while left > 0:
            self.wfile.write(CHUNK[: min(left, len(CHUNK))])
            left -= min(left, len(CHUNK))
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def _run(rig: Any, shell: str, **kwargs: Any) -> str:
    admission = rig.exec(shell=shell, timeout=600, **kwargs)
    view = rig.runtime.wait(admission.session, timeout=660)
    out = rig.runtime.read(admission.session, "stdout").decode()
    receipt = view["receipt"]
    assert receipt["exit"]["code"] == 0, (receipt["exit"], out)
    rig.forget_logs(admission.session)
    return out


class _BareRelay:
    """The floor of any relay in user space: a listener on the host's loopback whose every
    connection is moved to the server by two threads with splice(2), nothing judged, nothing
    recorded. What a hop costs here, whoever makes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed: the benchmark is over
            upstream = socket.create_connection(("127.0.0.1", self.port))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_splice, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


def _splice(source: socket.socket, sink: socket.socket) -> None:
    pipe_r, pipe_w = os.pipe()
    try:
        fcntl.fcntl(pipe_w, 1031, 1 << 20)  # F_SETPIPE_SZ
        while moved := os.splice(source.fileno(), pipe_w, 1 << 20, flags=1):
            while moved:
                moved -= os.splice(pipe_r, sink.fileno(), moved, flags=1)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        os.close(pipe_r)
        os.close(pipe_w)


def _downloads(rig: Any, port: int, relay: int, runs: int) -> dict[str, list[float]]:
    grant = f"127.0.0.1:{port}"
    curl = "curl -sS -o /dev/null -w '%{time_total}'"
    via_proxy = f"{curl} --noproxy '' -x $http_proxy"
    shells = {
        "proxy": (f"{via_proxy} http://{grant}/big", {"allow_hosts": [grant]}),
        "direct": (f"{curl} http://{grant}/big", {"network": "host"}),
        "bare relay": (f"{curl} http://127.0.0.1:{relay}/big", {"network": "host"}),
    }
    seconds: dict[str, list[float]] = {v: [] for v in shells}
    order = list(shells)
    for index in range(runs + 1):  # the first of each is a warm-up
        for variant in order if index % 2 == 0 else order[::-1]:
            shell, kwargs = shells[variant]
            taken = float(_run(rig, shell, **kwargs))
            if index:
                seconds[variant].append(taken)
    return seconds


def _connections(rig: Any, port: int, requests: int) -> dict[str, list[float]]:
    with open(os.path.join(rig.workspace, "requests.py"), "w") as handle:
        handle.write(REQUESTS)
    grant = f"127.0.0.1:{port}"
    out: dict[str, list[float]] = {}
    for variant, kwargs in (("proxy", {"allow_hosts": [grant]}), ("direct", {"network": "host"})):
        text = _run(rig, f"python3 requests.py {port} {requests} {variant}", **kwargs)
        out[variant] = json.loads(text)[requests // 10 :]  # past the first tenth: warm
    return out


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "sizes": sizes, "source": source_revision()}
    _Server.size = sizes["size"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    relay = _BareRelay(port)
    try:
        with settled_rig("netproxy", launcher="fresh") as rig:
            try:
                seconds = _downloads(rig, port, relay.address, sizes["downloads"])
                per_request = _connections(rig, port, sizes["requests"])
                records, summary = interleaved(
                    ("proxy", "none"), sizes["admissions"],
                    lambda v: timed_admission(rig, argv=["true"], network=v)[0],
                )  # fmt: skip
            finally:
                from settled.netproxy import lifecycle

                lifecycle.stop(rig.runtime.home)
    finally:
        relay.close()
        server.shutdown()
        server.server_close()
        thread.join(10)
    data["download_s"] = {v: distribution(s) for v, s in seconds.items()}
    data["request_ms"] = {v: distribution(t) for v, t in per_request.items()}
    data["admission"] = summary
    data["runs"] = records
    down, req = data["download_s"], data["request_ms"]
    data["download_ratio"] = down["proxy"]["p50"] / down["direct"]["p50"]
    data["bare_relay_ratio"] = down["bare relay"]["p50"] / down["direct"]["p50"]
    data["connection_added_ms"] = req["proxy"]["p50"] - req["direct"]["p50"]
    log(
        f"download of {sizes['size'] >> 20} MiB: proxy p50 {down['proxy']['p50']:.3f} s vs "
        f"direct {down['direct']['p50']:.3f} s ({data['download_ratio']:.2f}x; a bare splice "
        f"relay {data['bare_relay_ratio']:.2f}x); a connection "
        f"adds {data['connection_added_ms']:.3f} ms p50; admission proxy p50 "
        f"{summary['proxy']['return_ms']['p50']:.2f} ms vs none "
        f"{summary['none']['return_ms']['p50']:.2f} ms"
    )
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    down, req, size = data["download_s"], data["request_ms"], data["sizes"]["size"] >> 20
    rows = [
        [f"download of {size} MiB, s", fmt(down["proxy"]["p50"], 3), fmt(down["direct"]["p50"], 3),
         fmt(data["download_ratio"])],
        ["one request on a new connection, ms", fmt(req["proxy"]["p50"], 3),
         fmt(req["direct"]["p50"], 3), fmt(req["proxy"]["p50"] / req["direct"]["p50"])],
    ]  # fmt: skip
    admission = comparison_rows(data["admission"]["proxy"], data["admission"]["none"])
    return (
        header("netproxy: a command's traffic through settled's proxy, and not", data)
        + f"\n\nSource `{data['source']}`; command `python bench/run.py netproxy`.\n\n"
        + md_table(["figure (p50)", "proxy", "direct (host)", "ratio"], rows)
        + f"\n\nThe floor of any relay in user space, a bare splice(2) relay on the host's "
        f"loopback (nothing judged or recorded), takes {fmt(down['bare relay']['p50'], 3)} s "
        f"for the same download ({fmt(data['bare_relay_ratio'])}x direct): a second TCP hop "
        "over loopback, on this machine's two CPUs shared by the server, the relay and curl."
        f"\n\nA connection through the proxy adds {fmt(data['connection_added_ms'], 3)} ms "
        "p50 (accept, the sock_diag attribution, the verdict, the upstream connect, two ledger "
        "lines).\n\n"
        + md_table(
            ["admission (fresh owner)", "proxy ms", "none ms", "added ms", "ratio"], admission
        )
        + "\n\nDownloads and requests by the command itself inside real sessions, curl's "
        "`time_total` and Python's clock, so the session's start is not in them; admissions "
        "interleaved on one Runtime.\n"
    )
