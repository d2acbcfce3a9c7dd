"""The proxy daemon's wire protocol, for its callers: one JSON request per connection, one
JSON reply line. Standard library only (an owner started with `-I -S` seals its ledger with
this after death evidence). A daemon that does not answer within the timeout is None here,
never an exception: the caller says so (an owner's ledger then keeps what was written, and
what never ended is unknown).
"""

from __future__ import annotations

import _socket
import json
import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SOCKET_NAME, LOG_NAME, LOCK_SUFFIX = "netproxy.sock", "netproxy.log", ".lock"
IDLE_EXIT_S = 60.0  # a daemon serving no task exits after this long, as the journal does


def socket_path(run_dir: str) -> str:
    return os.path.join(run_dir, SOCKET_NAME)


def request(path: str, body: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """The daemon's reply to `body`, or None when none answers in time."""
    give_up = time.monotonic() + timeout
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(timeout, 0.01))
        sock.connect(path)
        sock.sendall(json.dumps(body).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            sock.settimeout(max(give_up - time.monotonic(), 0.001))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    finally:
        sock.close()
    try:
        reply = json.loads(data)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def seal(run_dir: str, session: str, killed_at: float | None, timeout: float = 10.0) -> str | None:
    """Ask the daemon to seal `session`'s ledger; None when done, else why not (one line)."""
    reply = request(socket_path(run_dir), {"op": "seal", "session": session,
                                           "killed_at": killed_at}, timeout)  # fmt: skip
    if reply is None:
        return f"the proxy did not answer within {timeout:g} s"
    return None if reply.get("ok") else str(reply.get("error"))


def release(run_dir: str, task: str, timeout: float = 5.0) -> bool:
    reply = request(socket_path(run_dir), {"op": "release", "task": task}, timeout)
    return reply is not None and reply.get("ok") is True


def send_stop(run_dir: str, timeout: float = 5.0) -> bool:
    reply = request(socket_path(run_dir), {"op": "stop"}, timeout)
    return reply is not None and reply.get("ok") is True
