"""peers: what judging a connection's peer (settled.peers) adds to each connection.

Every socket settled listens on judges each connection's peer once, before it reads a byte.
Measured here, interleaved in one loop: a new unix connection (connect + accept + close) with
and without `unix_refusal`, a new TCP connection on 127.0.0.1 with and without `tcp_refusal`
(NETLINK_SOCK_DIAG finds the peer socket, its cgroup id is opened by a kernfs handle), the
judgement of a peer that is not on this host (the lookup finds nothing, then the route lookup
says the address is not this host's), and the two ways of mapping a cgroup id to its path: the
handle (needs CAP_DAC_READ_SEARCH) and, without it, the walk of the whole cgroup2 hierarchy
(its worst case: an id that is nowhere) over the host's cgroups and a tree of our own
(`<hierarchy>/settled-bench-peers-<pid>/...`, removed after), with the number it walked.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from common import distribution, fmt, header, log, machine, md_table, scratch, source_revision

from settled import peers, sockdiag

FULL = {"runs": 2000, "walk_runs": 100, "tree": 500}
QUICK = {"runs": 200, "walk_runs": 10, "tree": 100}
REMOTE = ("192.0.2.7", 40000)  # TEST-NET-1: never this host's


def _us(started: float) -> float:
    return (time.perf_counter() - started) * 1e6


def _unix(listener: socket.socket, path: str, judge: bool) -> float:
    started = time.perf_counter()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    conn, _ = listener.accept()
    if judge:
        assert peers.unix_refusal(conn) is None
    conn.close()
    client.close()
    return _us(started)


def _tcp(listener: socket.socket, judge: bool) -> float:
    started = time.perf_counter()
    client = socket.create_connection(listener.getsockname())
    conn, peer = listener.accept()
    if judge:
        assert peers.tcp_refusal(peer, conn.getsockname()) is None
    conn.close()
    client.close()
    return _us(started)


def _remote(local: tuple[str, int]) -> float:
    started = time.perf_counter()
    assert peers.tcp_refusal(REMOTE, local) is None
    return _us(started)


def _handle(cgroup_id: int) -> float:
    started = time.perf_counter()
    assert sockdiag.cgroup_path(cgroup_id) is not None
    return _us(started)


def _walk(point: str) -> float:
    started = time.perf_counter()
    assert sockdiag.walk_for(point, 1 << 62) is None
    return _us(started)


def _directories(point: str) -> int:
    return sum(1 for _ in os.walk(point))


@contextlib.contextmanager
def _cgroups(point: str, count: int) -> Iterator[None]:
    """`count` empty cgroups of our own beside the host's, so the walk has a tree to walk
    (this VM's hierarchy is nearly empty; a systemd host has hundreds): removed after."""
    parent = os.path.join(point, f"settled-bench-peers-{os.getpid()}")
    os.mkdir(parent)
    made = [parent]
    try:
        for index in range(count - 1):
            child = os.path.join(made[index // 8], f"c{index}")  # eight to a parent
            os.mkdir(child)
            made.append(child)
        yield
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if os.path.exists(parent):
            log(f"warning: could not remove {parent}")


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    series: dict[str, list[float]] = {name: [] for name in (
        "unix_bare", "unix_judged", "tcp_bare", "tcp_judged", "tcp_remote", "cgroup_handle",
    )}  # fmt: skip
    point = sockdiag.cgroup2_mount()[0]
    own_id = os.stat(point).st_ino
    with scratch("peers") as root:
        path = os.path.join(root, "s.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix, socket.socket() as tcp:
            unix.bind(path)
            unix.listen(64)
            tcp.bind(("127.0.0.1", 0))
            tcp.listen(64)
            local = tcp.getsockname()
            for index in range(p["runs"]):
                series["unix_bare"].append(_unix(unix, path, False))
                series["unix_judged"].append(_unix(unix, path, True))
                series["tcp_bare"].append(_tcp(tcp, False))
                series["tcp_judged"].append(_tcp(tcp, True))
                series["tcp_remote"].append(_remote(local))
                series["cgroup_handle"].append(_handle(own_id))
                if index and index % 500 == 0:
                    log(f"peers: {index} rounds")
    bare_tree = _directories(point)
    with _cgroups(point, p["tree"]):
        tree = _directories(point)
        walks = [_walk(point) for _ in range(p["walk_runs"])]
    data: dict[str, Any] = {
        "benchmark": "peers",
        "quick": quick,
        "machine": machine(),
        "source": source_revision(),
        "params": dict(p),
        "runs": series,
        "walk_us": walks,
        "cgroup_directories": tree,
        "host_cgroup_directories": bare_tree,
    }
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    runs = data["runs"]
    rows = []
    for what, judged, bare in (
        ("unix connection, `unix_refusal`", "unix_judged", "unix_bare"),
        ("TCP connection on 127.0.0.1, `tcp_refusal`", "tcp_judged", "tcp_bare"),
    ):
        j, b = distribution(runs[judged]), distribution(runs[bare])
        rows.append([what, fmt(b["p50"], 1), fmt(j["p50"], 1), fmt(j["p50"] - b["p50"], 1),
                     fmt(j["p99"], 1)])  # fmt: skip
    for what, name in (
        ("a peer not on this host (lookup, then route)", "tcp_remote"),
        ("cgroup id -> path by kernfs handle", "cgroup_handle"),
    ):
        d = distribution(runs[name])
        rows.append([what, "", "", fmt(d["p50"], 1), fmt(d["p99"], 1)])
    walk = distribution(data["walk_us"])
    count = data["cgroup_directories"]
    rows.append([f"cgroup id -> path by a walk of {count} directories (the id nowhere)",
                 "", "", fmt(walk["p50"], 1), fmt(walk["p99"], 1)])  # fmt: skip
    rows.append(["the walk, per directory", "", "", fmt(walk["p50"] / count, 2), ""])
    table = md_table(["per connection (us)", "bare p50", "judged p50", "added p50", "p99"], rows)
    return (
        header("peers: judging a connection's peer", data)
        + "\n\nEach connection is judged once, before its first byte is read (`settled.peers`)."
        + " Bare: connect, accept and close; judged: the same with the judgement (p99: of the"
        + " judged). The rows without a bare column are the judgement's parts alone.\n\n"
        + table
    )
