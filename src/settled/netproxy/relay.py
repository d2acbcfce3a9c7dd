"""One connection through the proxy: its request head, the verdict, the upstream, the bytes.

A client speaks one of two forms (RFC 9110): `CONNECT host:port` (a tunnel: HTTPS, or anything
else; the proxy sees only bytes), or a plain HTTP request with an absolute URI
(`GET http://host:port/path`), which is sent on in origin form with `Connection: close`, so that
one proxy connection is one request to one destination and its ledger entry names both. The
head is parsed by h11 (at most HEAD_LIMIT bytes, within HEAD_TIMEOUT_S); the name resolved by
the daemon's resolver, each address judged by netpolicy.decide with whether it is one of this
host's own (the kernel's route lookup), and the first allowed one connected to (CONNECT_
TIMEOUT_S). Then bytes are copied both ways, counted, until both sides have ended.

How it ends, as the ledger says: `closed` (both directions reached their end), `reset` (either
side reset it), `failed` (no upstream: the name did not resolve, the connect failed or timed
out; 502 to the client), `refused` (403, or 503 at the task's connection limit, with why).
The daemon aborts a connection whose session it seals; the ledger's rule then calls it unknown.

Must never: connect before the verdict, connect to an address other than the one judged, or
forward a request head it could not parse.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import os
import select
import socket
import time
import urllib.parse
from typing import Any, Protocol

import h11

from settled import netpolicy, sockdiag
from settled.errors import BadInput

HEAD_LIMIT = 65536
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 30.0
CHUNK = 1 << 20  # a pump's splice, and its pipe's size
CHUNK_ON_LOOP = 1 << 18
SPLICE_AFTER = 4 << 20  # bytes one direction copies on the loop before a pump takes it
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization",
              b"proxy-authenticate", b"te", b"trailer", b"upgrade"}  # fmt: skip


class Ledger(Protocol):
    """One session's ledger, as the daemon keeps it."""

    allow: tuple[str, ...]

    def write(self, event: dict[str, Any]) -> None: ...


class Refused(Exception):
    def __init__(self, status: int, why: str, **facts: Any) -> None:
        super().__init__(why)
        self.status, self.why, self.facts = status, why, facts


class Connection:
    """One client's connection and its upstream, so that a seal can abort both."""

    def __init__(self, client: socket.socket, number: int, ledger: Ledger) -> None:
        self.client, self.number, self.ledger = client, number, ledger
        self.upstream: socket.socket | None = None
        self.sent = self.received = 0
        self.task: asyncio.Task[None] | None = None
        self.pumps = 0  # pump threads using its sockets: they are closed when none is
        self.closing = False

    def abort(self) -> None:
        """End both directions now: a pump blocked in splice wakes at the shutdown, and the
        sockets are closed once no thread uses them (never under a thread's feet: the
        number could meanwhile name another connection's socket)."""
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self.closing = True
        if self.pumps == 0:
            self.close()

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                sock.close()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            head, rest = await asyncio.wait_for(_read_head(loop, self.client), HEAD_TIMEOUT_S)
            request = _parse(head)
        except (TimeoutError, Refused, OSError, h11.RemoteProtocolError) as exc:
            why = exc.why if isinstance(exc, Refused) else f"no request head: {exc!r}"
            await self.answer(loop, 400, why)
            self.ledger.write({"e": "refused", "id": self.number, "at": time.time(),
                               "host": "", "port": 0, "why": why})  # fmt: skip
            self.client.close()
            return
        try:
            await self._connect(loop, request)
        except Refused as exc:
            await self.answer(loop, exc.status, exc.why)
            self.client.close()
            return
        await self._pipe(loop, request, rest)

    async def _connect(self, loop: asyncio.AbstractEventLoop, request: dict[str, Any]) -> None:
        host, port = request["host"], request["port"]
        base = {"id": self.number, "at": time.time(), "host": host, "port": port,
                "kind": request["kind"], **request.get("http", {})}  # fmt: skip
        named = _literal_family(host) is None
        if named and (why := netpolicy.may_resolve(self.ledger.allow, host, port)):
            self._refused(base, why)
            raise Refused(403, why)
        try:
            addresses = await _resolve(loop, host, port)
        except OSError as exc:
            self._refused(base, f"{host} did not resolve: {exc.strerror or exc}", failed=True)
            raise Refused(502, f"{host} did not resolve") from None
        why = "no address"
        for family, address in addresses:
            own = sockdiag.is_local(family, socket.inet_pton(family, address))
            why = netpolicy.decide(self.ledger.allow, host, port, address, own) or ""
            if not why:
                break
        if why:
            self._refused(base, why)
            raise Refused(403, why)
        upstream = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        self.upstream = upstream
        self.ledger.write({"e": "open", **base, "address": address})
        try:
            await asyncio.wait_for(loop.sock_connect(upstream, (address, port)), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            self._end("failed", f"connecting to {address}:{port}: {_said(exc)}")
            raise Refused(502, f"connecting to {host}:{port}: {_said(exc)}") from None
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _refused(self, base: dict[str, Any], why: str, failed: bool = False) -> None:
        if failed:
            self.ledger.write({"e": "open", **base})
            self._end("failed", why)
        else:
            self.ledger.write({"e": "refused", **base, "why": why})

    async def _pipe(
        self, loop: asyncio.AbstractEventLoop, request: dict[str, Any], rest: bytes
    ) -> None:
        assert self.upstream is not None
        upstream, client = self.upstream, self.client
        try:
            if request["kind"] == "connect":
                await loop.sock_sendall(client, b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                await loop.sock_sendall(upstream, request["forward"])
                self.sent += len(request["forward"])
            if rest:
                await loop.sock_sendall(upstream, rest)
                self.sent += len(rest)
        except OSError as exc:
            self._end("reset" if isinstance(exc, ConnectionResetError | BrokenPipeError)
                      else "failed", _said(exc))  # fmt: skip
            self.abort()
            return
        results = await asyncio.gather(
            self._direction(loop, client, upstream, "sent"),
            self._direction(loop, upstream, client, "received"),
            return_exceptions=True,
        )
        resets = [r for r in results if isinstance(r, ConnectionResetError | BrokenPipeError)]
        errors = [r for r in results if isinstance(r, BaseException) and r not in resets]
        how = "reset" if resets else "failed" if errors else "closed"
        self._end(how, _said(errors[0]) if errors else None)
        self.abort()

    async def _direction(
        self,
        loop: asyncio.AbstractEventLoop,
        source: socket.socket,
        sink: socket.socket,
        field: str,
    ) -> BaseException | None:
        """One direction's bytes, counted: copied on the loop while few (a request, an
        answer: no thread to wake), then, past SPLICE_AFTER, moved by a pump thread with
        splice(2), which never copies them into Python. Raises what ended it on the loop;
        returns what ended the pump."""
        buffer = bytearray(CHUNK_ON_LOOP)
        view, moved = memoryview(buffer), 0
        while moved < SPLICE_AFTER:
            got = await loop.sock_recv_into(source, buffer)
            if not got:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return None
            await loop.sock_sendall(sink, view[:got])
            setattr(self, field, getattr(self, field) + got)
            moved += got
        self.pumps += 1
        pumped = loop.run_in_executor(_pumps(), _pump, source, sink, self, field)
        pumped.add_done_callback(self._pumped)
        return await pumped

    def _pumped(self, _: object) -> None:
        self.pumps -= 1
        if self.pumps == 0 and self.closing:
            self.close()

    def _end(self, how: str, why: str | None) -> None:
        event = {"e": "end", "id": self.number, "at": time.time(), "mono": time.monotonic(),
                 "sent": self.sent, "received": self.received, "how": how}  # fmt: skip
        if why:
            event["why"] = why
        self.ledger.write(event)

    async def answer(self, loop: asyncio.AbstractEventLoop, status: int, why: str) -> None:
        """The proxy's refusal to the client, with why (at most 5 s: the client may not read)."""
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(loop.sock_sendall(self.client, response(status, why)), 5.0)


REASONS = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable"}


def response(status: int, why: str | None) -> bytes:
    """A whole answer that closes the connection: with why in its body, or empty."""
    body = f"settled proxy: {why}\n".encode() if why is not None else b""
    kind = "Content-Type: text/plain; charset=utf-8\r\n" if body else ""
    return (f"HTTP/1.1 {status} {REASONS[status]}\r\n{kind}Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body  # fmt: skip


_PUMPS: list[concurrent.futures.ThreadPoolExecutor] = []
PUMP_THREADS = 2 * 1024  # two per connection; the daemon's per-task limit bounds the use
SPLICE_F_MOVE, F_SETPIPE_SZ = 1, 1031


def _pumps() -> concurrent.futures.ThreadPoolExecutor:
    if not _PUMPS:
        _PUMPS.append(concurrent.futures.ThreadPoolExecutor(PUMP_THREADS, "pump"))
    return _PUMPS[0]


def _pump(
    source: socket.socket, sink: socket.socket, counts: Connection, field: str
) -> BaseException | None:
    """Move `source`'s bytes to `sink` until its end (then half-close `sink`), counting them;
    the error that ended it, else None. The sockets stay non-blocking (the loop may use the
    other direction of each): the thread waits in poll(2), and wakes at an abort's shutdown."""
    pipe_r, pipe_w = os.pipe2(os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):  # a larger pipe: fewer calls (1 MiB, the default max)
            fcntl.fcntl(pipe_w, F_SETPIPE_SZ, CHUNK)
        into, out = source.fileno(), sink.fileno()
        while True:
            try:
                moved = os.splice(into, pipe_w, CHUNK, flags=SPLICE_F_MOVE)
            except BlockingIOError:
                _wait(into, select.POLLIN)
                continue
            if moved == 0:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return None
            left = moved
            while left:
                try:
                    left -= os.splice(pipe_r, out, left, flags=SPLICE_F_MOVE)
                except BlockingIOError:
                    _wait(out, select.POLLOUT)
            setattr(counts, field, getattr(counts, field) + moved)
    except OSError as exc:
        return exc
    finally:
        os.close(pipe_r)
        os.close(pipe_w)


def _wait(fd: int, event: int) -> None:
    poller = select.poll()
    poller.register(fd, event)
    poller.poll(1000)  # an error or a hang-up wakes it too; the next splice says which


async def _read_head(loop: asyncio.AbstractEventLoop, client: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while True:
        chunk = await loop.sock_recv(client, 16384)
        if not chunk:
            raise Refused(400, "the client closed before its request head ended")
        data += chunk
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            return data[: end + 4], data[end + 4 :]
        if len(data) > HEAD_LIMIT:
            raise Refused(400, f"a request head over {HEAD_LIMIT} bytes")


def _parse(head: bytes) -> dict[str, Any]:
    """What the client asked for: kind, host, port; for plain HTTP the head to send on."""
    try:
        return _parse_head(head)
    except BadInput as exc:
        raise Refused(400, str(exc)) from None


def _parse_head(head: bytes) -> dict[str, Any]:
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
    parser.receive_data(head)
    event = parser.next_event()
    if not isinstance(event, h11.Request):
        raise Refused(400, "not an HTTP/1.x request head")
    method, target = event.method.decode("ascii"), event.target.decode("ascii", "replace")
    if method == "CONNECT":
        host, port = netpolicy.parse_authority(target)
        if port is None:
            raise Refused(400, f"CONNECT {target}: the port is missing")
        return {"kind": "connect", "host": host, "port": port}
    url = urllib.parse.urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise Refused(400, f"{method} {target[:200]}: a proxy request needs an http:// URI "
                      "(https goes through CONNECT)")  # fmt: skip
    authority = url.netloc.rpartition("@")[2]  # never the userinfo, in the ledger or upstream
    host, port = netpolicy.parse_authority(authority)
    port = port or 80
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    lines = [f"{method} {path} HTTP/1.1".encode()]
    lines += [name + b": " + value for name, value in event.headers if name not in HOP_BY_HOP]
    lines.append(b"connection: close")
    forward = b"\r\n".join(lines) + b"\r\n\r\n"
    return {"kind": "http", "host": host, "port": port, "forward": forward,
            "http": {"method": method, "authority": authority}}  # fmt: skip


async def _resolve(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[tuple[int, str]]:
    """(family, address) in the resolver's order; an address literal is itself."""
    family = _literal_family(host)
    if family is not None:
        return [(family, host)]
    found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[tuple[int, str]] = []
    for family, _type, _proto, _name, address in found:
        pair = (int(family), str(address[0]))
        if pair not in seen:
            seen.append(pair)
    return seen


def _literal_family(host: str) -> int | None:
    """The family of an address literal, None for a name."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return family
        except OSError:
            continue
    return None


def _said(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return getattr(exc, "strerror", None) or repr(exc)
