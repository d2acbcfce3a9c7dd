"""settled.server: the HTTP service (`settled serve`), an ASGI app on uvicorn over the Runtime.

Owns: starting and stopping the service: checking its tokens (it refuses to run with none),
removing ``SETTLED_TOKEN`` from the environment that commands inherit, binding the listening
socket (127.0.0.1 by default; port 0 picks a free one, and the address actually bound is printed
on stderr as ``settled serve: listening on http://HOST:PORT``), and running uvicorn until SIGINT
or SIGTERM (at the stop, every open event stream is told first, so it ends with its ``stop``
event rather than being cut). Every connection passes the peer gate first (server/peering.py):
a TCP peer of this host made inside one of settled's sessions gets a 403 naming why, before any
route or token check runs, and the refusal is logged here on stderr.

Must never: run open (no token configured is exit 2), pass its token to a command (it is
removed from the environment commands inherit and wiped from the process's original
environment block; the tokens file is hidden from every session of the home), or stop a
session when it stops: owners are detached and outlive the server, and a restarted server
resumes every stream from its cursor.

Exit codes: 0 after a clean shutdown, 1 if the server failed while starting, 2 for bad input
(no token, a bad tokens file, an unusable home, an address that cannot be bound).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator

import uvicorn

from settled import oomguard
from settled.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, SettledError
from settled.runtime import ready_home
from settled.server.app import create_app
from settled.server.auth import TOKEN_ENV, Grant, TokenConfigError, TokenTable
from settled.server.peering import gated
from settled.server.scrub import scrub_environ

__all__ = ["Grant", "TokenTable", "create_app", "serve"]

GRACEFUL_SHUTDOWN_S = 3
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _say(message: str) -> None:
    print(f"settled serve: {message}", file=sys.stderr, flush=True)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket of a service (`settled serve`, `settled serve --swerex`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, or asyncio does not set TCP_NODELAY on the accepted connections and a
    # response's headers and body (two writes) wait out the peer's delayed ACK: +40 ms each.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _hide_from_sessions(home: str, tokens_file: str) -> None:
    """Every session of this home, whoever launches it, gets the tokens file covered."""
    from settled.runtime import Runtime

    with Runtime(home) as runtime:
        runtime.hide_paths([tokens_file])


def _tokens(tokens_file: str | None) -> TokenTable | None:
    try:
        tokens = TokenTable.load(os.environ, tokens_file)
    except TokenConfigError as exc:
        _say(str(exc))
        return None
    if len(tokens) == 0:
        _say(
            f"no token configured: set {TOKEN_ENV} (full access) or pass a tokens file; "
            "the service never runs open"
        )
        return None
    return tokens


def serve(
    home: str | None, host: str = "127.0.0.1", port: int = 8765, tokens_file: str | None = None
) -> int:
    """Run the service over the settled home ``home`` (None: ``SETTLED_HOME``, else
    the default home) until SIGINT/SIGTERM; returns the exit code."""
    tokens = _tokens(tokens_file)
    if tokens is None:
        return EXIT_USAGE
    os.environ.pop(TOKEN_ENV, None)  # every command inherits this process's environment
    with contextlib.suppress(OSError):
        scrub_environ(TOKEN_ENV)  # and /proc/<pid>/environ would still show the original bytes
    try:
        home = ready_home(home)
        if tokens_file is not None:
            _hide_from_sessions(home, tokens_file)
        sock = bind(host, port)
    except SettledError as exc:
        _say(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        _say(f"cannot listen on {host}:{port}: {exc.strerror}")
        return EXIT_USAGE
    oomguard.protect_self()  # never the kernel's choice under memory pressure, where it can
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    _say(f"listening on http://{shown}:{bound_port} (home {home})")
    _say(f"the four clocks, on a page: http://{shown}:{bound_port}/ui (it asks for a token)")
    if not ipaddress.ip_address(bound_host).is_loopback:
        _say(
            "warning: not a loopback address and no TLS here: bearer tokens and output cross "
            "the network in clear; put a TLS-terminating proxy in front"
        )
    app = create_app(home, tokens)
    config = uvicorn.Config(
        app,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
        log_level="info",
        http=gated(_say),
    )
    server = _Server(config, app.state.begin_stop)
    try:
        with signals_end_serving():
            server.run(sockets=[sock])
    except SystemExit:  # uvicorn exits this way when the lifespan fails to start
        return EXIT_FAILURE
    finally:
        sock.close()
    return EXIT_OK if server.started else EXIT_FAILURE


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app it stops before it waits for open responses: every
    event stream then ends with its ``stop`` event instead of being cut at the deadline."""

    def __init__(self, config: uvicorn.Config, begin_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self._begin_stop = begin_stop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._begin_stop()
        await super().shutdown(sockets)


@contextlib.contextmanager
def signals_end_serving() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal under the
    handler that was there before it; with this one there, ``serve`` returns 0 instead of the
    process dying of the signal it already handled."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _already_handled) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _already_handled(_signum: int, _frame: object) -> None:
    return None
