"""The home's proxy daemon: its control socket, a listener per task, the sessions it serves and
their ledgers, and the per-task connection limit.

Control (`<home>/run/netproxy.sock`, one JSON request and one JSON reply per connection, each
peer judged by peers.unix_refusal first): `serve` (a session about to start: make its task's
listener unless it exists, open the session's ledger, keep its `--allow-host` patterns),
`seal` (its owner has death evidence: abort its connections still open, append `sealed` with
when the kill began, fsync, forget it), `release` (a task closed: its listener goes), `ping`,
`stop`. A daemon with no task for `idle_exit_s` exits.

Each accepted connection is attributed before anything else: the peer socket's cgroup v2 id
(sockdiag through the task's own sock_diag socket), its path, the session in it. A peer of no
session served here (a session sealed, one of another task, a process outside every session)
is answered 403 and logged, and nothing is sent anywhere. Past `connection_limit` connections
open in one task, a new one is answered 503 and recorded `refused` with `limit` set.

Must never: write to a ledger after it was sealed, or hold a lock or a thread the owner waits
on: an owner's `seal` is answered from the event loop, whatever the relays are doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from settled import netledger, oomguard, peers, sockdiag
from settled.boundary import podhost
from settled.daemons import ReadyReport
from settled.home import session_dir
from settled.netproxy import taskns
from settled.netproxy.relay import Connection, response
from settled.netproxy.wire import LOCK_SUFFIX, SOCKET_NAME
from settled.where import run_dir

CONNECTION_LIMIT = 256  # open at once in one task (SETTLED_PROXY_CONNECTIONS overrides)
LEDGER_ENTRIES = 100_000  # a session's ledger (~20 MiB); past it connections are refused, counted


class SessionLedger:
    """One session's ledger file, open for appending until it is sealed."""

    def __init__(self, home: str, task: str, session: str, allow: tuple[str, ...]) -> None:
        self.task, self.session, self.allow = task, session, allow
        self.path = os.path.join(session_dir(home, session), netledger.LEDGER_NAME)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(self.path, flags, 0o600)
        events, _ = netledger.read_events(self.path)  # a restarted daemon numbers on
        self.next = 1 + max((int(e.get("id", 0)) for e in events), default=0)
        self.open: dict[int, Connection] = {}
        self.sealed = False
        self.unrecorded = 0  # refused once the ledger was full: counted, said at the seal

    def write(self, event: dict[str, Any]) -> None:
        if not self.sealed:
            os.write(self.fd, json.dumps(event, separators=(",", ":")).encode() + b"\n")

    def number(self) -> int:
        self.next += 1
        return self.next - 1

    def seal(self, killed_at: float | None) -> int:
        """Abort what is open (the ledger's rule makes it unknown), append `sealed`, fsync."""
        for number, connection in list(self.open.items()):
            if connection.task is not None:
                connection.task.cancel()  # its `finally` closes both sockets, off the loop's fds
            else:
                connection.abort()
            self.write({"e": "end", "id": number, "at": time.time(), "mono": time.monotonic(),
                        "sent": connection.sent, "received": connection.received,
                        "how": "aborted"})  # fmt: skip
        count = len(self.open)
        self.write({"e": "sealed", "at": time.time(), "killed_at": killed_at, "aborted": count,
                    "unrecorded": self.unrecorded})  # fmt: skip
        self.sealed = True
        os.fsync(self.fd)
        os.close(self.fd)
        return count


class TaskNet:
    """A task's listener and sock_diag socket, made inside its network namespace."""

    def __init__(
        self, task: str, listener: socket.socket, diag: socket.socket, namespace: int
    ) -> None:
        self.task, self.listener, self.diag, self.namespace = task, listener, diag, namespace
        self.open = 0
        self.accepting: asyncio.Task[None] | None = None

    def close(self) -> None:
        if self.accepting is not None:
            self.accepting.cancel()
        self.listener.close()
        self.diag.close()


class Daemon:
    def __init__(self, home: str, idle_exit_s: float, limit: int, entries: int) -> None:
        self.home, self.idle_exit_s, self.limit, self.entries = home, idle_exit_s, limit, entries
        self.tasks: dict[str, TaskNet] = {}
        self.sessions: dict[str, SessionLedger] = {}
        self.stopping = asyncio.Event()
        self.idle_since = time.monotonic()
        self.running: set[asyncio.Task[None]] = set()

    # -- control ---------------------------------------------------------------------------

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            refusal = peers.unix_refusal(writer.get_extra_info("socket"))
            if refusal is not None:
                log(f"control: refused {refusal}")
                return
            line = await asyncio.wait_for(reader.readline(), 10.0)
            try:
                request = json.loads(line)
                reply = await self.answer(request)
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (OSError, TimeoutError, ValueError):
            pass
        finally:
            writer.close()

    async def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "tasks": len(self.tasks)}
        if op == "serve":
            return self.serve(str(request["task"]), str(request["session"]),
                              tuple(str(p) for p in request.get("allow") or ()))  # fmt: skip
        if op == "seal":
            return self.seal(str(request["session"]), request.get("killed_at"))
        if op == "release":
            net = self.tasks.pop(str(request["task"]), None)
            if net is not None:
                net.close()
            return {"ok": True, "released": net is not None}
        if op == "stop":
            self.stopping.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def serve(self, task: str, session: str, allow: tuple[str, ...]) -> dict[str, Any]:
        known = self.tasks.get(task)
        pod = podhost.find(self.home, task)
        if known is not None and (pod is None or pod.get("net") != known.namespace):
            self.tasks.pop(task).close()  # its pod was made again since
        if task not in self.tasks:
            listener, diag, namespace = taskns.open_task(self.home, task)
            listener.setblocking(False)
            net = self.tasks[task] = TaskNet(task, listener, diag, namespace)
            net.accepting = asyncio.get_running_loop().create_task(self.accept(net))
            log(f"task {task}: listening in its network namespace")
        if session not in self.sessions:
            self.sessions[session] = SessionLedger(self.home, task, session, allow)
        return {"ok": True, "ledger": self.sessions[session].path}

    def seal(self, session: str, killed_at: object) -> dict[str, Any]:
        kill = float(killed_at) if isinstance(killed_at, int | float) else None
        ledger = self.sessions.pop(session, None)
        if ledger is None:  # never served here (a daemon restarted since): seal the file
            path = os.path.join(session_dir(self.home, session), netledger.LEDGER_NAME)
            if not os.path.exists(path):
                return {"ok": True, "ledger": None}
            ledger = SessionLedger(self.home, "", session, ())
        aborted = ledger.seal(kill)
        return {"ok": True, "ledger": ledger.path, "aborted": aborted}

    # -- connections -----------------------------------------------------------------------

    async def accept(self, net: TaskNet) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(net.listener)
            except OSError as exc:
                log(f"task {net.task}: accept: {exc}")
                await asyncio.sleep(0.05)
                continue
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # relayed as it comes
            running = loop.create_task(self.connection(net, client))
            self.running.add(running)  # a task the loop holds only weakly would be collected
            running.add_done_callback(self.running.discard)

    async def connection(self, net: TaskNet, client: socket.socket) -> None:
        ledger, why = self.whose(net, client)
        if ledger is None:
            log(f"task {net.task}: refused a connection: {why}")
            with contextlib.suppress(OSError):
                client.send(response(403, None))
            client.close()
            return
        if ledger.next > self.entries:  # the home's disk is not the command's to fill
            ledger.unrecorded += 1
            with contextlib.suppress(OSError):
                client.send(response(503, None))
            client.close()
            return
        number = ledger.number()
        connection = Connection(client, number, ledger)
        if net.open >= self.limit:
            why = f"the task's connection limit ({self.limit} open at once) was reached"
            ledger.write({"e": "refused", "id": number, "at": time.time(), "host": "",
                          "port": 0, "why": why, "limit": True})  # fmt: skip
            await connection.answer(asyncio.get_running_loop(), 503, why)
            client.close()
            return
        net.open += 1
        ledger.open[number] = connection
        connection.task = asyncio.current_task()
        try:
            await connection.run()
        except asyncio.CancelledError:
            pass
        finally:
            net.open -= 1
            ledger.open.pop(number, None)
            connection.abort()

    def whose(self, net: TaskNet, client: socket.socket) -> tuple[SessionLedger | None, str]:
        """The ledger of the session whose process made the peer socket, or why none."""
        try:
            host, port = client.getpeername()[:2]
            here, listening = client.getsockname()[:2]
            found = sockdiag.peer_socket(
                socket.AF_INET,
                socket.inet_aton(host),
                port,
                socket.inet_aton(here),
                listening,
                via=net.diag,
            )
        except OSError as exc:
            return None, f"its peer could not be read: {exc}"
        if found is None or found[2] is None:
            return None, f"no socket of {host}:{port} in the task's namespace, or no cgroup"
        path = sockdiag.cgroup_path(found[2])
        session = _session_in(path or "", net.task)
        ledger = self.sessions.get(session or "")
        if ledger is None or ledger.task != net.task:
            return None, f"its peer's cgroup {path} is no session of task {net.task} served here"
        return ledger, ""

    # -- life ------------------------------------------------------------------------------

    def release_ended_tasks(self) -> None:
        """A task whose pod was released (closed, destroyed) or made again lets its listener
        go: the listener would keep its network namespace alive."""
        for task, net in list(self.tasks.items()):
            pod = podhost.find(self.home, task)
            if pod is None or pod.get("net") != net.namespace:
                log(f"task {task}: its pod is gone or new; its listener goes")
                self.tasks.pop(task).close()
                for session, ledger in list(self.sessions.items()):
                    if ledger.task == task and pod is None:  # never sealed by an owner (its
                        ledger.seal(time.monotonic())  # launch failed): what is open is unknown
                        del self.sessions[session]

    async def idle_watch(self) -> None:
        while not self.stopping.is_set():
            await asyncio.sleep(min(self.idle_exit_s, 5.0))
            self.release_ended_tasks()
            if self.tasks or self.sessions:
                self.idle_since = time.monotonic()
            elif time.monotonic() - self.idle_since >= self.idle_exit_s:
                log("idle: exiting")
                self.stopping.set()


def _session_in(path: str, task: str) -> str | None:
    """The session of `task` whose cgroup `path` lies in (peers' reading of the tree)."""
    for root in peers.session_roots(path):
        tree, session = os.path.split(root)
        if os.path.basename(tree) == task:
            return session
    return None


def log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} netproxy[{os.getpid()}]: {line}",
          file=sys.stderr, flush=True)  # fmt: skip


async def serve(home: str, idle_exit_s: float, on_ready: Any) -> int:
    socket_path = os.path.join(run_dir(home), SOCKET_NAME)
    lock = os.open(socket_path + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        on_ready({"state": "locked"})
        return 0
    os.ftruncate(lock, 0)
    os.write(lock, str(os.getpid()).encode())
    limit = int(os.environ.get("SETTLED_PROXY_CONNECTIONS", CONNECTION_LIMIT))
    entries = int(os.environ.get("SETTLED_PROXY_LEDGER_ENTRIES", LEDGER_ENTRIES))
    daemon = Daemon(home, idle_exit_s, limit, entries)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server = await asyncio.start_unix_server(daemon.control, path=socket_path)
    os.chmod(socket_path, 0o600)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, daemon.stopping.set)
    watch = loop.create_task(daemon.idle_watch())
    log(f"serving on {socket_path}, {limit} connections per task")
    on_ready({"state": "ready", "pid": os.getpid()})
    await daemon.stopping.wait()
    server.close()
    watch.cancel()
    for net in daemon.tasks.values():
        net.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    return 0


def main(argv: list[str]) -> int:
    """argv: HOME IDLE_EXIT_S READY_FD. Forks once so the starter reaps at once."""
    home, idle_text, ready_text = argv[:3]
    if os.fork() != 0:
        os._exit(0)
    oomguard.protect_self()
    report = ReadyReport(int(ready_text))
    try:
        return asyncio.run(serve(home, float(idle_text), report))
    finally:
        report({"state": "error", "error": "the proxy exited before it was ready"})
