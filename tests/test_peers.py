"""Every settled socket knows its peer (issue 34, item 4, and attack 3): real processes, as root.

A session's command (a real settled session, default isolation and `--isolation none`), a
process `unshare -m` started, and a host process put in a session's cgroup each talk to the four
sockets of one home: the home's launcher (`run/launcher.sock`), its journal daemon
(`run/journal.sock`), `settled serve` and `settled serve --swerex` on 127.0.0.1. Each request is
one that a served peer gets an answer to without any credential (the launcher's `stop`, the
journal's `ping`, `GET /healthz`, the SWE-ReX root), so an empty answer or a 403 is the peer
check and nothing else. The same probe from the host (this test process's namespaces) is served.

How a hostile command reaches the unix sockets: the home is invisible to an isolated command, so
the test hands it hard links of the two sockets inside its workspace (a unix socket is found by
its inode: a command that found any path to one connects through it); an `--isolation none`
command sees the host's files and uses the sockets' own paths.

A client on another host: a process in another network namespace, joined to this one by a veth
pair (`ip netns`), connects to the services bound on this side's veth address. Its socket lives
in the other namespace's tables, so this host's NETLINK_SOCK_DIAG lookup does not find it and its
address is not one of this host's: exactly what a remote client is to the server. It is served,
and the token (the key) decides.

Everything a test starts it ends: servers are stopped, the launcher and journal by conftest,
sessions settle, the namespace, the veth pair and the cgroups made here are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import TOKEN, Server

from settled import peers, sockdiag
from settled.boundary import availability
from settled.owner import home_launcher
from settled.runtime import Runtime

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="peers of other namespaces: needs root"),
    pytest.mark.timeout(180),
]

SYSTEM_PYTHON = "/usr/bin/python3"  # in every view the command may get: /usr is always there
KEY = "peers-test-key-0123456789abcdef"
START_S = 30.0
SESSION_WORDS = "inside settled's session"

# Run by /usr/bin/python3 -I -S wherever the peer is: one request per target, what came back.
PROBE = r"""
import json, os, socket, sys
out = {"uid": os.getuid()}
for name, kind, where in json.loads(sys.argv[1]):
    try:
        if kind == "http":
            host, port = where.rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=20)
            s.sendall(b"GET " + (sys.argv[2] if name == "swerex" else "/healthz").encode()
                      + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        else:
            kinds = {"seqpacket": socket.SOCK_SEQPACKET, "stream": socket.SOCK_STREAM}
            s = socket.socket(socket.AF_UNIX, kinds[kind])
            s.settimeout(20)
            s.connect(where)
            try:  # a refusal may come (the socket closed) before this is sent: read it anyway
                s.sendall(b'{"op": "stop"}' if kind == "seqpacket" else b'{"op": "ping"}\n')
                if kind == "stream":
                    s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            if kind == "seqpacket":
                break
        out[name] = got.decode(errors="replace")
    except OSError as exc:
        out[name] = "error " + type(exc).__name__
print(json.dumps(out))
"""


# -- the four sockets of one home ------------------------------------------------------------


class Swerex:
    """`settled serve --swerex --port 0` in a subprocess; stderr to a file we read."""

    def __init__(self, home: Path, log: Path, host: str = "127.0.0.1", **env: str) -> None:
        self.log = log
        self.key_path: str | None = None
        command = [sys.executable, "-m", "settled.cli", "serve", "--swerex", "--host", host,
                   "--port", "0", *env.pop("ARGS", "").split()]  # fmt: skip
        environ = {k: v for k, v in os.environ.items() if k != "SETTLED_SWEREX_API_KEY"}
        with open(log, "ab") as sink:
            self.process = subprocess.Popen(
                command, env={**environ, "SETTLED_HOME": str(home), **env},
                stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
            )  # fmt: skip
        self.url = self._await("listening on http://").split("listening on ")[1].split()[0]
        if "SETTLED_SWEREX_API_KEY" not in env:
            said = self._await("made one in ")
            self.key_path = said.split("made one in ")[1].split(" (mode")[0]
        give_up = time.monotonic() + START_S
        while time.monotonic() < give_up:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/", timeout=5).status_code == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"swerex never answered: {self.text()}")

    def _await(self, words: str) -> str:
        give_up = time.monotonic() + START_S
        while time.monotonic() < give_up:
            for line in self.text().splitlines():
                if words in line:
                    return line
            if self.process.poll() is not None:
                raise AssertionError(f"swerex exited {self.process.returncode}: {self.text()}")
            time.sleep(0.02)
        raise AssertionError(f"swerex never said {words!r}: {self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@dataclass
class Home:
    rt: Runtime
    task: str
    workspace: Path
    run: Path
    serve: Server
    swerex: Swerex

    def targets(self, unix_dir: Path | None = None) -> list[tuple[str, str, str]]:
        where = unix_dir or self.run
        return [
            ("launcher", "seqpacket", str(where / home_launcher.SOCKET_NAME)),
            ("journal", "stream", str(where / "journal.sock")),
            ("serve", "http", self.serve.url.removeprefix("http://")),
            ("swerex", "http", self.swerex.url.removeprefix("http://")),
        ]

    def zygote(self) -> int:
        return int((self.run / home_launcher.LOCK_NAME).read_text())

    def launcher_log(self) -> str:
        return (self.run / home_launcher.LOG_NAME).read_text(errors="replace")

    def journal_log(self) -> str:
        return (self.run / "journal.log").read_text(errors="replace")


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Home]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    started: list[Any] = []
    with Runtime(str(tmp_path / "home")) as rt:
        try:
            task = rt.new_task(str(workspace)).task  # starts the home's journal
            run = tmp_path / "home" / "run"
            home_launcher.start(str(run))
            started.append(Server(tmp_path / "home", tmp_path / "serve.log", None, {}))
            swerex = Swerex(tmp_path / "home", tmp_path / "swerex.log",
                            SETTLED_SWEREX_API_KEY=KEY)  # fmt: skip
            started.append(swerex)
            yield Home(rt, task, workspace, run, started[0], swerex)
        finally:
            for server in started:
                server.stop()


def _probe(
    command: list[str], targets: list[tuple[str, str, str]], swerex_path: str = "/"
) -> dict[str, Any]:
    argv = [*command, *_probe_argv(targets, swerex_path)]
    done = subprocess.run(argv, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def _probe_argv(targets: list[tuple[str, str, str]], swerex_path: str = "/") -> list[str]:
    return [SYSTEM_PYTHON, "-I", "-S", "-c", PROBE, json.dumps(targets), swerex_path]


def _in_session(home: Home, targets: list[tuple[str, str, str]], **options: Any) -> dict[str, Any]:
    options.setdefault("network", "host")  # the host's loopback, where the services listen
    admission = home.rt.exec(home.task, argv=_probe_argv(targets), timeout=120, **options)
    receipt = home.rt.wait(admission.session, timeout=150)["receipt"]
    out = home.rt.read(admission.session, "stdout")
    assert receipt["exit"]["code"] == 0, (receipt, home.rt.read(admission.session, "stderr"))
    answer: dict[str, Any] = json.loads(out)
    return answer


def _assert_all_refused(answer: dict[str, Any], zygote: int) -> None:
    assert answer["uid"] == 0  # root in its session: the uid alone tells it from nothing
    assert answer["launcher"] == "refused\n", answer  # one word, and its "stop" never read
    assert answer["journal"].startswith('{"error":"refused: '), answer
    for service in ("serve", "swerex"):
        assert answer[service].startswith("HTTP/1.1 403 Forbidden"), answer
        assert SESSION_WORDS in answer[service], answer
    assert _alive(zygote)  # its "stop" was never read


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _refusals(log: str) -> list[str]:
    return [line for line in log.splitlines() if "refused peer" in line]


def _services_say_session(home: Home) -> None:
    for text in (home.serve.text(), home.swerex.text()):
        said = _refusals(text)
        assert said and all(re.search(r"refused peer 127\.0\.0\.1:\d+ uid 0: its socket was made"
                                      r" in cgroup /\S*settled/t_[0-9a-f]{16}/s_[0-9a-f]{16}",
                                      line) for line in said), text  # fmt: skip


def _boundary_with_pidns() -> None:
    reason = availability()["cgroup2+pidns"]
    if reason is not None:
        pytest.skip(f"sessions here get no PID namespace and cgroup: {reason}")


# -- a session's command ---------------------------------------------------------------------


def test_a_sessions_command_is_refused_by_every_socket_even_as_root(home: Home) -> None:
    _boundary_with_pidns()
    links = home.workspace / "found"
    links.mkdir()
    for name in (home_launcher.SOCKET_NAME, "journal.sock"):
        os.link(home.run / name, links / name)  # any path to a socket reaches it
    zygote = home.zygote()
    try:
        answer = _in_session(home, home.targets(links))
    finally:
        shutil.rmtree(links)
    _assert_all_refused(answer, zygote)
    for log in (home.launcher_log(), home.journal_log()):
        said = _refusals(log)
        assert said and all(re.search(r"refused peer pid \d+ uid 0: its PID namespace pid:\[\d+\] "
                                      r"is not this process's pid:\[\d+\]", line)
                            for line in said), log  # fmt: skip
    _services_say_session(home)


def test_an_unisolated_sessions_command_is_refused_too(home: Home) -> None:
    """`--isolation none` sees the host's files, sockets included; it still runs in its own PID
    namespace and in its session's cgroup."""
    _boundary_with_pidns()
    zygote = home.zygote()
    answer = _in_session(home, home.targets(), isolation="none")
    _assert_all_refused(answer, zygote)
    for log in (home.launcher_log(), home.journal_log()):
        said = _refusals(log)
        assert said and all("uid 0: its PID namespace" in line for line in said), log
    _services_say_session(home)


def test_a_process_of_another_mount_namespace_is_refused_by_the_unix_sockets(home: Home) -> None:
    zygote = home.zygote()
    answer = _probe(["unshare", "-m"], home.targets()[:2])  # started outside settled
    assert answer["launcher"] == "refused\n", answer
    assert answer["journal"].startswith('{"error":"refused: '), answer
    assert _alive(zygote)
    for log in (home.launcher_log(), home.journal_log()):
        said = _refusals(log)
        pattern = r"uid 0: its mount namespace mnt:\[\d+\] is not this process's mnt:\[\d+\]"
        assert said and all(re.search(pattern, line) for line in said), log


def test_settled_itself_from_another_mount_namespace_fails_at_once_naming_why(
    home: Home,
) -> None:
    """A caller of the home in another mount namespace (a container sharing the home, a
    service with a private /tmp) is refused like any other: it fails at once, saying so,
    instead of starting journals and zygotes that would find the home's locks held."""
    launch = (
        "import sys; from settled.owner.home_launcher import HomeLauncher, LauncherUnavailable\n"
        "try:\n    HomeLauncher()._send(sys.argv[1], {}, [])\n"
        "except LauncherUnavailable as exc:\n    print(exc)\n"
    )
    done = subprocess.run(["unshare", "-m", sys.executable, "-c", launch, str(home.run)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "refused this process: it serves only processes of its own mount and PID" in done.stdout
    assert str(home.run / home_launcher.LOG_NAME) in done.stdout, done.stderr
    cli = [sys.executable, "-m", "settled.cli", "run", "--task", home.task, "--", "true"]
    env = {**os.environ, "SETTLED_HOME": str(home.run.parent)}
    ran = subprocess.run(["unshare", "-m", *cli], env=env, capture_output=True, timeout=60)
    assert ran.returncode == 1, ran
    assert b"journal" in ran.stderr and b"refused: this journal serves only" in ran.stderr
    assert "another journal holds" not in home.journal_log()  # no second journal was started


def test_the_same_calls_from_the_host_are_served(home: Home) -> None:
    zygote = home.zygote()
    answer = _probe([], home.targets())
    assert answer["uid"] == 0
    assert json.loads(answer["journal"])["ok"] is True
    assert answer["serve"].startswith("HTTP/1.1 200 OK"), answer
    assert answer["swerex"].startswith("HTTP/1.1 200 OK"), answer
    assert answer["launcher"] == "stop\n"  # served: it obeyed, and leaves
    deadline = time.monotonic() + 10
    while _alive(zygote) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(zygote)
    assert not _refusals(home.launcher_log()) and not _refusals(home.journal_log())
    assert not _refusals(home.serve.text()) and not _refusals(home.swerex.text())


# -- a session's cgroup, whatever the namespaces -----------------------------------------------


@contextlib.contextmanager
def _session_cgroup() -> Iterator[Path]:
    """A cgroup where settled puts a session (`<hierarchy>/settled/t_<hex>/s_<hex>`), made
    here and removed after."""
    from settled.boundary.cgroup2 import find_hierarchy

    try:
        hierarchy = Path(find_hierarchy())
    except Exception as exc:
        pytest.skip(f"no writable cgroup v2 hierarchy here: {exc}")
    tree = hierarchy / peers.SESSION_TREE
    task = tree / f"t_{os.urandom(8).hex()}"
    session = task / f"s_{os.urandom(8).hex()}"
    made_tree = not tree.exists()
    session.mkdir(parents=True)
    try:
        yield session
    finally:
        for path in (session, task) + ((tree,) if made_tree else ()):
            with contextlib.suppress(OSError):
                path.rmdir()
        assert not session.exists() and not task.exists()


def test_a_host_process_in_a_sessions_cgroup_is_refused_by_every_socket(home: Home) -> None:
    """Same mount and PID namespaces as the servers: the cgroup alone refuses it."""
    zygote = home.zygote()
    with _session_cgroup() as cgroup:
        joined = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
        answer = _probe(joined, home.targets())
    _assert_all_refused(answer, zygote)
    named = _as_proc_path(cgroup)
    for log in (home.launcher_log(), home.journal_log()):
        said = _refusals(log)
        assert said and all(line.endswith(f"uid 0: it runs in cgroup {named}, inside settled's "
                                          f"session {named}") for line in said), log  # fmt: skip
    _services_say_session(home)


@pytest.mark.parametrize(
    ("bind", "connect"),
    [(("::1", 0), "::1"), (("::", 0), "127.0.0.1"), (("127.0.0.1", 0), "127.0.0.1")],
    ids=["ipv6", "ipv4-mapped", "ipv4"],
)
def test_a_tcp_peer_is_found_over_ipv6_and_ipv4_and_judged_by_its_cgroup(
    bind: tuple[str, int], connect: str
) -> None:
    family = socket.AF_INET6 if ":" in bind[0] else socket.AF_INET
    with socket.socket(family) as listener, _session_cgroup() as cgroup:
        listener.bind(bind)
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection((connect, port)):
            accepted, peer = listener.accept()
            with accepted:
                assert peers.tcp_refusal(peer, accepted.getsockname()) is None
            dial = f"import socket; socket.create_connection(({connect!r}, {port})).recv(1)"
            joined = f'echo $$ > {cgroup}/cgroup.procs && exec "$@"'
            child = subprocess.Popen(["sh", "-c", joined, "sh", SYSTEM_PYTHON, "-I", "-S",
                                      "-c", dial])  # fmt: skip
            try:
                accepted, peer = listener.accept()
                with accepted:
                    why = peers.tcp_refusal(peer, accepted.getsockname())
            finally:
                child.kill()
                child.wait(timeout=30)
    assert why is not None and why.endswith(
        f"its socket was made in cgroup {_as_proc_path(cgroup)}, inside settled's session "
        f"{_as_proc_path(cgroup)}"
    ), why


def _as_proc_path(cgroup: Path) -> str:
    """The cgroup's path as /proc/<pid>/cgroup writes it (from the hierarchy's root)."""
    point, root = sockdiag.cgroup2_mount()
    inside = cgroup.relative_to(point).as_posix()
    return "/" + "/".join(part for part in (root.strip("/"), inside) if part)


# -- serve --swerex never runs without a key --------------------------------------------------


def test_serve_swerex_without_a_key_makes_one_0600_and_says_where(tmp_path: Path) -> None:
    Runtime(str(tmp_path / "home")).close()
    server = Swerex(tmp_path / "home", tmp_path / "swerex.log")
    try:
        assert server.key_path is not None
        key_file = Path(server.key_path)
        assert key_file.parent == tmp_path / "home" / "run"
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", key)
        assert key not in server.text()  # where, never what
        refused = httpx.get(server.url + "/is_alive", timeout=10)
        wrong = httpx.get(server.url + "/is_alive", headers={"X-API-Key": "x" * 64}, timeout=10)
        served = httpx.get(server.url + "/is_alive", headers={"X-API-Key": key}, timeout=10)
        assert (refused.status_code, wrong.status_code, served.status_code) == (401, 401, 200)
        assert served.json()["is_alive"] is True
    finally:
        server.stop()
    assert not key_file.exists()  # the key died with its server


def test_an_api_key_file_that_does_not_exist_yet_gets_the_new_key_and_keeps_it(
    tmp_path: Path,
) -> None:
    Runtime(str(tmp_path / "home")).close()
    named = tmp_path / "keys" / "swerex.key"
    named.parent.mkdir()
    server = Swerex(tmp_path / "home", tmp_path / "swerex.log", ARGS=f"--api-key-file {named}")
    try:
        assert server.key_path == str(named) and named.stat().st_mode & 0o777 == 0o600
        key = named.read_text().strip()
        assert httpx.get(server.url + "/is_alive", headers={"X-API-Key": key}).status_code == 200
    finally:
        server.stop()
    assert named.read_text().strip() == key  # kept: the next start uses the same key
    again = Swerex(tmp_path / "home", tmp_path / "again.log", ARGS=f"--api-key-file {named}",
                   SETTLED_SWEREX_API_KEY="")  # fmt: skip
    try:
        assert "made one" not in again.text()
        assert httpx.get(again.url + "/is_alive", headers={"X-API-Key": key}).status_code == 200
    finally:
        again.stop()


# -- a client on another host -----------------------------------------------------------------


@contextlib.contextmanager
def _other_host() -> Iterator[tuple[str, list[str]]]:
    """A network namespace joined to this one by a veth pair: (this side's address, the command
    prefix that runs a process over there). Removed after, with both ends of the pair."""
    if shutil.which("ip") is None:
        pytest.skip("no ip(8) here to make a network namespace and a veth pair")
    tag = os.urandom(3).hex()
    name, here, there = f"peers-{tag}", f"vp{tag}a", f"vp{tag}b"
    octet = 1 + int(tag, 16) % 250
    near, far = f"10.213.{octet}.1", f"10.213.{octet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    ip("netns", "add", name)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", name)
        ip("addr", "add", f"{near}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", name, "addr", "add", f"{far}/30", "dev", there)
        ip("-n", name, "link", "set", there, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield near, ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        ip("netns", "del", name)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                      text=True, timeout=30).stdout  # fmt: skip


def test_a_client_on_another_host_is_not_found_here_and_left_to_the_token(
    tmp_path: Path,
) -> None:
    with _other_host() as (near, over_there):
        Runtime(str(tmp_path / "home")).close()
        serve = _serve_on(tmp_path, near)
        swerex = Swerex(tmp_path / "home", tmp_path / "swerex.log", host=near,
                        SETTLED_SWEREX_API_KEY=KEY)  # fmt: skip
        try:
            targets = [("serve", "http", serve.url.removeprefix("http://")),
                       ("swerex", "http", swerex.url.removeprefix("http://"))]  # fmt: skip
            answer = _probe(over_there, targets)
            assert answer["serve"].startswith("HTTP/1.1 200 OK"), answer  # /healthz: open
            assert answer["swerex"].startswith("HTTP/1.1 200 OK"), answer  # /: open
            keyless = _probe(over_there, targets[1:], "/is_alive")  # the key decides the rest
            assert keyless["swerex"].startswith("HTTP/1.1 401"), keyless
            assert not _refusals(serve.text()) and not _refusals(swerex.text())
        finally:
            swerex.stop()
            serve.stop()


def test_a_connection_from_another_network_namespace_is_not_found_on_this_host() -> None:
    """The decision itself, on a connection accepted here from over the veth pair."""
    with _other_host() as (near, over_there), socket.socket() as listener:
        listener.bind((near, 0))
        listener.listen()
        connect = f"import socket; socket.create_connection({listener.getsockname()!r}).recv(1)"
        client = subprocess.Popen([*over_there, SYSTEM_PYTHON, "-I", "-S", "-c", connect])
        try:
            accepted, peer = listener.accept()
            with accepted:
                local = accepted.getsockname()
                family, src, dst = peers._packed(peer[0], local[0])
                assert sockdiag.peer_socket(family, src, peer[1], dst, local[1]) is None  # not here
                assert not sockdiag.is_local(family, src)  # and not from an address of ours
                assert peers.tcp_refusal(peer, local) is None
        finally:
            client.kill()
            client.wait(timeout=30)


def _serve_on(tmp_path: Path, host: str) -> Server:
    """`settled serve` bound to `host` (test_server's Server binds 127.0.0.1)."""

    class There(Server):
        def __init__(self) -> None:
            self.home, self.log = tmp_path / "home", tmp_path / "serve.log"
            code = ("import sys; from settled.server import serve; "
                    f"sys.exit(serve(sys.argv[1], host={host!r}, port=0))")  # fmt: skip
            with open(self.log, "ab") as sink:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", code, str(self.home)],
                    env={**os.environ, "SETTLED_TOKEN": TOKEN}, stdin=subprocess.DEVNULL,
                    stdout=sink, stderr=sink,
                )  # fmt: skip
            self.url = self._await_listening()
            self._await_ready()

    return There()


# -- the decisions, each alone ---------------------------------------------------------------


def test_a_tcp_peer_of_this_host_whose_socket_is_gone_is_refused() -> None:
    """A command that sends its request and resets its socket before the check runs is not
    taken for a remote client: its address is this host's."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        accepted, peer = listener.accept()
        with accepted:
            local = accepted.getsockname()
            assert peers.tcp_refusal(peer, local) is None  # this host's, outside every session
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            client.close()  # a reset: the socket is gone at once, no TIME_WAIT
            why = peers.tcp_refusal(peer, local)
    assert why == f"peer 127.0.0.1:{peer[1]}: {peers.GONE}"


def test_a_journal_in_a_child_user_namespace_still_tells_its_peers_apart(tmp_path: Path) -> None:
    """A daemon in a child user namespace may not read a host process's namespaces (ptrace's
    rules); it answers the same two questions from what needs no right (the pidfd's NSpid, the
    first line of the peer's mountinfo), so a host peer is served and the others are not."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    run = tmp_path / "home" / "run"
    start = "import sys; from settled.workspace.journal import lifecycle as j; "
    start += "j.ensure_running(sys.argv[1])"
    subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", start,
                    str(run)], check=True, timeout=60)  # fmt: skip
    targets = [("journal", "stream", str(run / "journal.sock"))]
    assert json.loads(_probe([], targets)["journal"])["ok"] is True
    for other in (["unshare", "-m"], ["unshare", "--pid", "--fork", "--kill-child"]):
        assert _probe(other, targets)["journal"].startswith('{"error":"refused: ')
    said = _refusals((run / "journal.log").read_text())
    assert len(said) == 2, said
    assert said[0].endswith("its mount namespace is not this process's (its root mount is another)")
    assert re.search(r"its PID namespace is not this process's \(pid \d+ here is pid 1 in its\)$",
                     said[1])  # fmt: skip


def test_without_so_peerpidfd_a_pid_younger_than_the_check_is_refused() -> None:
    """Linux < 6.5: the pid SO_PEERCRED named is pinned by pidfd_open, which may pin a process
    that took the pid after the peer left: one that started after the check began is refused."""
    checked = time.clock_gettime(time.CLOCK_BOOTTIME)
    time.sleep(0.05)  # several clock ticks: the process below starts after the check began
    younger = subprocess.Popen(["sleep", "60"])
    pidfd = os.pidfd_open(younger.pid)
    try:
        assert peers._judge(pidfd, younger.pid, checked) == (
            "its pid was reused by a process started after the connection"
        )
        assert peers._judge(pidfd, younger.pid, time.clock_gettime(time.CLOCK_BOOTTIME)) is None
    finally:
        os.close(pidfd)
        younger.kill()
        younger.wait(timeout=30)


def test_a_unix_peer_in_this_namespaces_and_no_session_is_served() -> None:
    left, right = socket.socketpair()
    with left, right:
        assert peers.unix_refusal(left) is None


@pytest.mark.parametrize(
    ("cgroups", "own", "inside"),
    [
        ("0::/settled/t_0123456789abcdef/s_0123456789abcdef", "0::/", True),
        ("0::/a.slice/settled/t_0123456789abcdef/s_0123456789abcdef/x/y", "0::/", True),
        ("4:memory:/settled/t_0123456789abcdef/s_0123456789abcdef\n0::/", "0::/", True),
        ("0::/settled/t_0123456789abcdef", "0::/", False),  # a task's, never a command's
        ("0::/settled.service/t_0123456789abcdef/s_0123456789abcdef", "0::/", False),
        ("0::/settled/task/session", "0::/", False),  # not settled's names
        # a settled that itself runs inside a session: that session is its own
        ("0::/settled/t_0123456789abcdef/s_0123456789abcdef",
         "0::/settled/t_0123456789abcdef/s_0123456789abcdef", False),
        ("0::/settled/t_0123456789abcdef/s_0123456789abcdef/settled/t_1111111111111111/"
         "s_2222222222222222", "0::/settled/t_0123456789abcdef/s_0123456789abcdef", True),
    ],
)  # fmt: skip
def test_what_lies_inside_a_session(cgroups: str, own: str, inside: bool) -> None:
    assert (peers.session_of(cgroups, own) is not None) is inside


def test_the_session_tree_is_the_one_boundary_cgroup2_makes() -> None:
    from settled.boundary.cgroup2 import ROOT_DIR_NAME

    assert peers.SESSION_TREE == ROOT_DIR_NAME
