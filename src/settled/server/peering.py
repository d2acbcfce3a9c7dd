"""The HTTP services' gate: every connection's peer is judged before uvicorn sees a byte of it.

Owns: the protocol class that `settled serve` and `settled serve --swerex` give uvicorn
(`gated(say)`): at `connection_made` it asks `peers.tcp_refusal` about the accepted socket's
peer (a TCP socket of this host made inside one of settled's sessions is refused, whatever its
uid; another host's is left to the token), and only an allowed connection gets uvicorn's own
protocol, made then and handed every later event. A refused one never reaches the HTTP parser,
the middleware or a route: it gets a 403 with the reason in one line and `Connection: close`,
its request bytes are read and dropped until it closes (closing on unread bytes would reset the
connection and lose the 403), and it is aborted after LINGER_S at most. The service's log
(stderr) says who and why.

Why a 403 and not a bare close: the reason is the one a person needs when a client they started
inside a session is turned away ("inside settled's session ..."), and it tells a hostile command
nothing it does not know (where it runs); a bare close looks like a crash. Why per connection
and not per request: the peer of a connection cannot change while it lives, and a keep-alive
client then pays for the check once (~60 us, peers.py).

Must never: hand a refused connection to uvicorn, judge a connection by anything but its own
4-tuple (no cache across connections: ports are reused), or block the loop on a peer longer
than two netlink round trips.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from settled.peers import tcp_refusal

LINGER_S = 5.0  # how long a refused connection may keep sending before it is aborted


def forbidden(reason: str) -> bytes:
    """The whole HTTP/1.1 answer to a refused peer."""
    body = json.dumps({"error": "Forbidden", "message": reason}).encode()
    head = (
        "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def gated(say: Callable[[str], None], base: str = "auto") -> type[asyncio.Protocol]:
    """A protocol class for `uvicorn.Config(http=...)`: uvicorn's own (`base`, a name of
    uvicorn's HTTP_PROTOCOLS) behind the peer check; `say` logs a refusal."""
    inner: Any = import_from_string(HTTP_PROTOCOLS[base])

    class Gate(asyncio.Protocol):
        def __init__(self, **kwargs: Any) -> None:
            self._kwargs = kwargs
            self._inner: asyncio.Protocol | None = None
            self._transport: Any = None
            self._linger: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            reason = _judge(peer, local)
            if reason is None:
                made: asyncio.Protocol = inner(**self._kwargs)
                self._inner = made
                made.connection_made(transport)
                return
            say(f"refused {reason}")
            self._transport = transport
            transport.write(forbidden(reason))
            if transport.can_write_eof():
                transport.write_eof()
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, transport.abort)

        def data_received(self, data: bytes) -> None:
            if self._inner is not None:
                self._inner.data_received(data)

        def eof_received(self) -> bool | None:
            if self._inner is not None:
                return self._inner.eof_received()
            if self._transport is not None:
                self._transport.close()
            return None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._linger is not None:
                self._linger.cancel()
            if self._inner is not None:
                self._inner.connection_lost(exc)

        def pause_writing(self) -> None:
            if self._inner is not None:
                self._inner.pause_writing()

        def resume_writing(self) -> None:
            if self._inner is not None:
                self._inner.resume_writing()

    return Gate


def _judge(peer: Any, local: Any) -> str | None:
    if not isinstance(peer, tuple) or not isinstance(local, tuple):
        return f"a peer of no TCP address ({peer!r}): it cannot be checked"
    return tcp_refusal((str(peer[0]), int(peer[1])), (str(local[0]), int(local[1])))
