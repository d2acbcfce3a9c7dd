"""A task's network namespace: with `--network none` a command's network is its task's loopback
and nothing else; with `--network host` it is the host's, and its receipt says so.

Real sessions through the Runtime, as root. This test process listens on the host's loopback
(and on every host address) on a port P, answering "host"; task A's `--service` session listens
on the same port P inside its task's namespace, and on an abstract unix socket, answering "A".
Then: another session of A reaches A's service on both; task B's command (also `none`) reaches
neither, nor the host's; the host reaches its own listener on P, never A's, and not A's abstract
socket; nothing beyond A's loopback answers A's command (the host's address, a settled server on
127.0.0.1, a route out); root binds port 80 and pings through a raw ICMP socket inside A's
namespace; the receipts name the mode and the namespace by inode, which is the pod's and the
command's own; `--network host` reaches the host's listener and a settled server, and its
receipt says the network is the host's. The namespace is joined on every boundary; a pod made
before pods had a network namespace gets one on its next session, its IPC kept (or, where it
cannot, is made again and says what was lost); a command that sees the host's /proc joins
neither A's network namespace nor the host's; `--isolation none` gives the host's network and
says so; `--network none` without a pod is refused, nothing
launched; a task's default applies. The command side runs the system Python (`net_probe.py`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import marshal
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _skip_unavailable
from test_server import Server

from settled.boundary import podhost, podmake, podns
from settled.records import TaskRecord
from settled.runtime import Runtime

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="pods need root's CAP_SYS_ADMIN"),
    pytest.mark.timeout(120),
]

SYSTEM_PYTHON = "/usr/bin/python3"
ROUTE_OUT = "192.0.2.1"  # TEST-NET-1: a destination only a route out could reach

PROBE = r"""
import errno, json, os, select, socket, struct, sys, time


def answer(family, address, only_connect=False):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(address)
        return "connected" if only_connect else s.recv(100).decode()
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    finally:
        s.close()


def serve(name, port, abstract):
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.1", port))
    tcp.listen(16)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind("\0" + abstract)
    unix.listen(16)
    open("ready-" + name, "w").close()
    while True:
        for ready in select.select([tcp, unix], [], [])[0]:
            peer, _ = ready.accept()
            peer.sendall(name.encode())
            peer.close()


def ping():
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    raw.settimeout(5)
    ident = os.getpid() & 0xFFFF
    body = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"settled"
    total = sum(struct.unpack("!%dH" % (len(body) // 2), body[: len(body) // 2 * 2]))
    total += body[-1] << 8 if len(body) % 2 else 0
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    body = body[:2] + struct.pack("!H", ~total & 0xFFFF) + body[4:]
    raw.sendto(body, ("127.0.0.1", 0))
    while True:
        packet = raw.recv(1024)
        kind, _, _, got, _ = struct.unpack("!BBHHH", packet[20:28])
        if kind == 0 and got == ident:
            return "reply"


def attempt(call):
    try:
        return call()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


if sys.argv[1] == "serve":
    serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
elif sys.argv[1] == "look":
    asked = json.loads(sys.argv[2])
    print(json.dumps({
        "net": os.readlink("/proc/self/ns/net"),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "tcp": [answer(socket.AF_INET, (t[0], t[1]), len(t) > 2) for t in asked.get("tcp", [])],
        "abstract": [answer(socket.AF_UNIX, "\0" + n) for n in asked.get("abstract", [])],
    }))
elif sys.argv[1] == "privileged":
    def bind80():
        s = socket.socket()
        s.bind(("127.0.0.1", 80))
        s.listen(1)
        return "bound"
    print(json.dumps({"bind80": attempt(bind80), "ping": attempt(ping)}))
"""


class HostListener:
    """This process, listening on the host's network on one port (every address), answering
    `host` to each connection, until closed."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                peer, _ = self.sock.accept()
            except OSError:
                return
            with peer:
                peer.sendall(b"host")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=10)


@pytest.fixture(autouse=True)
def _strong_paths() -> None:
    _skip_unavailable("cgroup2+pidns")


@pytest.fixture
def host() -> Iterator[HostListener]:
    listener = HostListener()
    try:
        yield listener
    finally:
        listener.close()


def _task(rt: Runtime, root: Path, name: str, **kw: object) -> TaskRecord:
    workspace = root / name
    workspace.mkdir()
    (workspace / "net_probe.py").write_text(PROBE)
    return rt.new_task(str(workspace), **kw)  # type: ignore[arg-type]


@pytest.fixture
def two(rt: Runtime, tmp_path: Path) -> tuple[TaskRecord, TaskRecord]:
    return _task(rt, tmp_path, "a"), _task(rt, tmp_path, "b")


def run(rt: Runtime, task: TaskRecord, shell: str, **kw: object) -> tuple[dict, str, str]:
    admission = rt.exec(task.task, shell=shell, **kw)  # type: ignore[arg-type]
    view = rt.wait(admission.session, timeout=60)
    assert view["state"] == "settled", view
    out = rt.read(admission.session, "stdout").decode(errors="replace")
    err = rt.read(admission.session, "stderr").decode(errors="replace")
    return view["receipt"], out, err


def look(rt: Runtime, task: TaskRecord, asked: dict, **kw: object) -> tuple[dict, dict]:
    words = json.dumps(asked).replace("'", "")
    receipt, out, err = run(rt, task, f"{SYSTEM_PYTHON} -I -S net_probe.py look '{words}'", **kw)
    assert receipt["exit"]["code"] == 0, err
    return receipt, json.loads(out)


def serve(rt: Runtime, task: TaskRecord, port: int, **kw: object) -> str:
    """A `--service` session of `task` answering its name on 127.0.0.1:port and on the abstract
    unix socket settled-net-<name>, once it listens."""
    name = Path(task.workspace).name
    shell = f"exec {SYSTEM_PYTHON} -I -S net_probe.py serve {name} {port} settled-net-{name}"
    session = rt.exec(task.task, shell=shell, service=True, **kw).session  # type: ignore[arg-type]
    ready = Path(task.workspace) / f"ready-{name}"
    deadline = time.monotonic() + 30
    while not ready.exists():
        status = rt.session_status(session)
        assert status["state"] in ("admitted", "starting", "running"), status
        assert time.monotonic() < deadline, status
        time.sleep(0.02)
    return session


def stop(rt: Runtime, session: str) -> dict:
    rt.cancel(session, "test done")
    view = rt.wait(session, timeout=60)
    assert view["receipt"]["death"]["proven"], view["receipt"]["death"]
    return dict(view["receipt"])


def from_host(family: int, address: object) -> str:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(address)
        return s.recv(100).decode()
    except OSError as exc:
        return f"E{exc.errno}"
    finally:
        s.close()


def host_address() -> str | None:
    """One of the host's own addresses that is not a loopback one, if it has any."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        return line.split()[3].split("/")[0]
    return None


@pytest.mark.parametrize("mode", ["none", "proxy"])
def test_a_tasks_loopback_is_its_sessions_and_no_one_elses(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], host: HostListener, mode: str
) -> None:
    """Under `none` and under `proxy` (the default) alike: the task's own namespace."""
    a, b = two
    port = host.port  # the host listens on it too: A's service binds the same port in its own
    service = serve(rt, a, port, network=mode)
    asked = {"tcp": [["127.0.0.1", port]], "abstract": ["settled-net-a"]}

    receipt_a, seen_by_a = look(rt, a, asked, network=mode)
    assert seen_by_a["tcp"] == ["a"] and seen_by_a["abstract"] == ["a"]
    receipt_b, seen_by_b = look(rt, b, asked, network=mode)
    assert seen_by_b["tcp"] == ["ECONNREFUSED"] and seen_by_b["abstract"] == ["ECONNREFUSED"]
    assert from_host(socket.AF_INET, ("127.0.0.1", port)) == "host", "the host's, not A's"
    assert from_host(socket.AF_UNIX, "\0settled-net-a") == f"E{errno.ECONNREFUSED}"

    network = receipt_a["isolation"]["network"]
    pod = receipt_a["isolation"]["pod"]
    assert network["mode"] == mode and network["interfaces"] == ["lo"]
    assert network["namespace"] == pod["namespaces"]["net"]
    assert seen_by_a["net"] == f"net:[{network['namespace']}]"
    assert seen_by_a["net"] != os.readlink("/proc/self/ns/net")
    assert seen_by_a["interfaces"] == ["lo"] and seen_by_b["interfaces"] == ["lo"]
    assert receipt_b["isolation"]["network"]["namespace"] != network["namespace"]
    assert "network" not in receipt_a["isolation"]["missing"]

    served = stop(rt, service)
    assert served["isolation"]["network"] == network, "the service ran in the same namespace"


def test_nothing_beyond_the_loopback_answers(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], host: HostListener, tmp_path: Path
) -> None:
    """The host's loopback services (this process's listener, a settled server), the host's own
    address, and a route out: none of them answers `none`; `host` reaches the first three."""
    a, _ = two
    server = Server(tmp_path / "served", tmp_path / "server.log", None, {})
    try:
        server_port = int(server.url.rsplit(":", 1)[1].strip("/"))
        targets = [["127.0.0.1", host.port], ["127.0.0.1", server_port, "connect"], [ROUTE_OUT, 80]]
        address = host_address()
        if address is not None:
            targets.append([address, host.port])
        _, closed = look(rt, a, {"tcp": targets}, network="none")
        _, opened = look(rt, a, {"tcp": targets[:2]}, network="host")
    finally:
        server.stop()
    assert closed["tcp"][:3] == ["ECONNREFUSED", "ECONNREFUSED", "ENETUNREACH"], closed
    assert closed["tcp"][3:] == ["ENETUNREACH"] * (len(targets) - 3), closed
    assert opened["tcp"][0] == "host"
    assert opened["tcp"][1] == "connected", "the settled server, on the host's loopback"


def test_root_binds_port_80_and_pings_inside_its_tasks_namespace(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    """CAP_NET_BIND_SERVICE and CAP_NET_RAW hold over the task's namespace, which the pod's
    user namespace owns; in the host's they do not (test_podns says the same)."""
    a, _ = two
    shell = f"{SYSTEM_PYTHON} -I -S net_probe.py privileged"
    _, inside, err = run(rt, a, shell, network="none")
    assert json.loads(inside) == {"bind80": "bound", "ping": "reply"}, err
    _, outside, _ = run(rt, a, shell, network="host")
    assert json.loads(outside) == {"bind80": "EACCES", "ping": "EPERM"}


def test_the_hosts_network_is_asked_for_by_name_and_named_missing_in_the_receipt(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], host: HostListener
) -> None:
    a, _ = two
    receipt, seen = look(rt, a, {"tcp": [["127.0.0.1", host.port]]}, network="host")
    assert seen["tcp"] == ["host"] and seen["net"] == os.readlink("/proc/self/ns/net")
    network = receipt["isolation"]["network"]
    assert network["mode"] == "host" and network["namespace"] == "host"
    assert "the host's network" in network["shared"] and "granted" in network["shared"]
    assert "nothing records" in receipt["isolation"]["missing"]["network"], "asked, and missing"
    assert receipt["isolation"]["pod"]["namespaces"]["net"], "the pod has one, not joined"
    look(rt, a, {}, network="none")
    said = [session["protections"] for session in rt.explain(a.task)["sessions"]]
    assert "the host's network, granted (--network host)" in said[0]
    assert "its task's own network namespace: loopback only" in said[1]


def test_every_boundary_joins_the_tasks_network_namespace(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], boundary: str
) -> None:
    a, _ = two
    receipt, seen = look(rt, a, {}, network="none", boundary=boundary)
    assert seen["net"] == f"net:[{receipt['isolation']['network']['namespace']}]"
    assert seen["interfaces"] == ["lo"]


def test_a_pod_made_before_pods_had_a_network_namespace_gets_one(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    """The pod as an older settled left it (its record without `net`, nothing bound at
    `/T/net`): its next session adds one, its other namespaces and IPC kept."""
    a, _ = two
    first, _, _ = run(rt, a, "ipcmk -Q >/dev/null")
    before = first["isolation"]["pod"]["namespaces"]
    _strip_network(rt.home, a.task)
    assert podns.describe(rt.home, a.task)["network"] is None

    receipt, seen = look(rt, a, {}, network="none")
    pod = receipt["isolation"]["pod"]
    assert pod["state"] == "found" and "network namespace" in pod["added"], pod
    assert {k: pod["namespaces"][k] for k in ("user", "ipc", "uts")} == {
        k: before[k] for k in ("user", "ipc", "uts")
    }
    assert seen["net"] == f"net:[{pod['namespaces']['net']}]" and seen["interfaces"] == ["lo"]
    again, out, _ = run(rt, a, "ipcs -q | grep -c '^0x'")
    assert out.strip() == "1", "the queue made before is still the task's"
    assert (
        again["isolation"]["pod"]["state"] == "found" and "added" not in again["isolation"]["pod"]
    )
    assert podns.describe(rt.home, a.task)["network"] == {"interfaces": {"lo": "up"}}


def _strip_network(home: str, task: str, user: int | None = None) -> None:
    """Make the task's pod what a settled before this change made: no `net` in its record,
    nothing at /T/net in the pods namespace (and, given `user`, a record naming that inode as
    its user namespace)."""
    path = os.path.join(home, "run", "pods", f"{task}.pod")
    with open(path, "rb") as handle:
        record = marshal.loads(handle.read())
    del record["net"]
    if user is not None:
        record["user"] = user
    with open(path, "wb") as handle:
        handle.write(marshal.dumps(record))

    def unbind() -> dict:
        with podmake.inside(podhost.pin_path(home)):
            podmake.linux.umount2(f"/{task}/net", podmake.linux.MNT_DETACH)
            os.unlink(f"/{task}/net")
        return {}

    assert podmake.in_helper(unbind, "unbinding") == {}


def test_a_pod_whose_network_namespace_cannot_be_added_is_made_again_and_says_so(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    """An older record whose user namespace is not the one bound (the child joins it by inode,
    so it refuses): the pod is made again, and what was lost is said."""
    a, _ = two
    run(rt, a, "ipcmk -Q >/dev/null")
    _strip_network(rt.home, a.task, user=1)
    receipt, seen = look(rt, a, {}, network="none")
    pod = receipt["isolation"]["pod"]
    assert pod["state"] == "recreated", pod
    assert "network namespace could not be added" in pod["lost"], pod["lost"]
    assert seen["net"] == f"net:[{pod['namespaces']['net']}]"
    _, out, _ = run(rt, a, "ipcs -q | grep -c '^0x' || true")
    assert out.strip() == "0", "a new pod: the queue went with the old one"


SETNS = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for pid in sys.argv[1:]:
    try:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    except OSError as e:
        out[pid] = "open " + errno.errorcode[e.errno]
        continue
    joined = libc.setns(fd, 0x40000000)
    out[pid] = "joined" if joined == 0 else "setns " + errno.errorcode[ctypes.get_errno()]
print(json.dumps(out))
"""


def test_no_command_joins_another_network_namespace(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], host: HostListener
) -> None:
    """On a boundary without a PID namespace the command's /proc is the host's, so it finds
    task A's service and the host's first process: it can join neither's network namespace
    (no CAP_SYS_ADMIN over the host's user namespace, nor over A's pod's)."""
    a, b = two
    service = serve(rt, a, host.port, network="none")
    inside = f"net:[{podns.ensure(rt.home, a.task)['net']}]"
    [pid, *_] = [p for p in _pids() if _readlink(f"/proc/{p}/ns/net") == inside]
    (Path(b.workspace) / "setns.py").write_text(SETNS)
    for network in ("none", "host"):
        receipt, out, err = run(
            rt, b, f"{SYSTEM_PYTHON} -I -S setns.py {pid} 1", network=network, boundary="cgroup2"
        )
        assert receipt["isolation"]["proc"] == "host"
        tried = json.loads(out)
        assert len(tried) == 2 and set(tried.values()) <= {"open EACCES", "setns EPERM"}, err
    stop(rt, service)


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def test_isolation_none_gives_the_hosts_network_and_says_so(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, _ = two
    receipt, seen = look(rt, a, {}, network="none", isolation="none")
    assert seen["net"] == os.readlink("/proc/self/ns/net")
    assert receipt["isolation"]["network"]["mode"] == "host"
    assert "--isolation none builds no namespace" in receipt["isolation"]["missing"]["network"]


def test_network_none_without_a_pod_is_refused_and_nothing_runs(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = two
    monkeypatch.setenv(podhost.PODS_ENV, "off")  # the launcher is this process
    receipt, _, _ = run(rt, a, "touch ran", network="none")
    assert receipt["exit"]["reason"] == "not_started", receipt["exit"]
    assert "--network none" in json.dumps(receipt["exit"])
    assert not (Path(a.workspace) / "ran").exists()
    receipt, _, _ = run(rt, a, "true")  # host, without a pod: runs, and says it has no pod
    assert receipt["exit"]["code"] == 0 and "pod" in receipt["isolation"]["missing"]


def test_a_tasks_default_network_applies_to_its_commands(rt: Runtime, tmp_path: Path) -> None:
    task = _task(rt, tmp_path, "c", network="none")
    receipt, seen = look(rt, task, {})
    assert receipt["isolation"]["network"]["mode"] == "none" and seen["interfaces"] == ["lo"]
    receipt, seen = look(rt, task, {}, network="host")
    assert receipt["isolation"]["network"]["mode"] == "host"
    assert seen["net"] == os.readlink("/proc/self/ns/net")
