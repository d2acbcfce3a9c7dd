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

import http.server
import json
import os
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


def _downloads(rig: Any, port: int, runs: int) -> dict[str, list[float]]:
    grant = f"127.0.0.1:{port}"
    curl = "curl -sS -o /dev/null -w '%{time_total}'"
    via_proxy = f"{curl} --noproxy '' -x $http_proxy"
    shells = {
        "proxy": (f"{via_proxy} http://{grant}/big", {"allow_hosts": [grant]}),
        "direct": (f"{curl} http://{grant}/big", {"network": "host"}),
    }
    seconds: dict[str, list[float]] = {"proxy": [], "direct": []}
    for index in range(runs + 1):  # the first of each is a warm-up
        for variant in ("proxy", "direct") if index % 2 == 0 else ("direct", "proxy"):
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
    data: dict[str, Any] = {"machine": machine(), "sizes": sizes}
    _Server.size = sizes["size"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        with settled_rig("netproxy", launcher="fresh") as rig:
            try:
                seconds = _downloads(rig, port, sizes["downloads"])
                per_request = _connections(rig, port, sizes["requests"])
                records, summary = interleaved(
                    ("proxy", "none"), sizes["admissions"],
                    lambda v: timed_admission(rig, argv=["true"], network=v)[0],
                )  # fmt: skip
            finally:
                from settled.netproxy import lifecycle

                lifecycle.stop(rig.runtime.home)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    data["download_s"] = {v: distribution(s) for v, s in seconds.items()}
    data["request_ms"] = {v: distribution(t) for v, t in per_request.items()}
    data["admission"] = summary
    data["runs"] = records
    down, req = data["download_s"], data["request_ms"]
    data["download_ratio"] = down["proxy"]["p50"] / down["direct"]["p50"]
    data["connection_added_ms"] = req["proxy"]["p50"] - req["direct"]["p50"]
    log(
        f"download of {sizes['size'] >> 20} MiB: proxy p50 {down['proxy']['p50']:.3f} s vs "
        f"direct {down['direct']['p50']:.3f} s ({data['download_ratio']:.2f}x); a connection "
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
        + "\n\n"
        + md_table(["figure (p50)", "proxy", "direct (host)", "ratio"], rows)
        + f"\n\nA connection through the proxy adds {fmt(data['connection_added_ms'], 3)} ms "
        "p50 (accept, the sock_diag attribution, the verdict, the upstream connect, two ledger "
        "lines).\n\n"
        + md_table(
            ["admission (fresh owner)", "proxy ms", "none ms", "added ms", "ratio"], admission
        )
        + "\n\nDownloads and requests by the command itself inside real sessions, curl's "
        "`time_total` and Python's clock, so the session's start is not in them; admissions "
        "interleaved on one Runtime.\n"
    )
