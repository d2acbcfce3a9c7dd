"""The warm launcher: a pre-imported interpreter that forks session owners on request.

A fresh `python -I -S` owner pays 7-10 ms of interpreter start before it can run its command,
and ~40 ms of imports while it runs; a fork of this process pays ~1-2 ms for both. The zygote
belongs to one Runtime: it is that Runtime's child, talks to it over a socketpair, and exits
when the socketpair closes (the Runtime closed or its process died), so it never outlives its
owner. Owners it forks are detached at once (setsid, a second fork) and outlive it. It holds
no store connection and no lock while it forks. The launcher claims for the owner and hands it
its orders (handoff.py), as for a fresh owner. The caller's environment and umask travel with
each request, so an owner runs with the caller's environment, not the zygote's (a command sees
neither: only its spec's env, settled.environment).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import threading
from typing import Any

from settled.helper_process import python_command
from settled.owner.forking import (
    MAX_REQUEST,
    ZYGOTE_MODULES,
    Refill,
    Spare,
    fork_owner,
    launch_through,
    preload,
    reap_stubs,
)
from settled.store import Store

# -- the zygote process -----------------------------------------------------------------------


def main(argv: list[str]) -> int:
    return serve(int(argv[0]))


def serve(sock_fd: int) -> int:
    """Loop: one request in, one owner forked, its pid out. EOF on the socket ends the zygote."""
    preload()
    sock = socket.socket(fileno=sock_fd)
    os.chdir("/")
    refill = Refill()
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        if not poller.poll(None if refill.home is None else refill.timeout_ms(1e9)):
            refill.run_if_due((sock,))
            continue
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, 2)
        except InterruptedError:
            continue
        if not message:
            Spare.end()
            reap_stubs(all_of_them=True)
            return 0
        request = json.loads(message)
        fork_owner(request, fds, (sock,))
        sock.sendall(b"ok\n")
        refill.after(request["home"])  # the caller has its answer; its spare a moment later


# -- the Runtime's side -----------------------------------------------------------------------


class WarmLauncher:
    """Starts its zygote on first use; close() (or the end of this process) ends it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            python_command("settled.owner.zygote:main", ZYGOTE_MODULES, str(theirs.fileno())),
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        return ours

    def launch(self, home: str, session: str, store: Store) -> dict[str, Any]:
        return launch_through(self._send, home, session, store)

    def _send(self, request: dict[str, Any], fds: list[int]) -> None:
        with self._lock:
            if self._sock is None:
                self._sock = self._start()
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            if self._sock.recv(16) != b"ok\n":
                raise RuntimeError("the warm launcher did not answer; see its stderr")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._process is not None:
                self._process.wait(timeout=10)
                self._process = None
