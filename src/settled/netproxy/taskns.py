"""A listener and a sock_diag socket made inside a task's network namespace, held outside it.

A socket belongs to the network namespace it was made in for its whole life, whoever holds it:
a helper forked from the daemon enters the home's pods mount namespace (where the task's
namespace files are bound, podhost.py), opens the task's `net`, checks it is the one the pod
record names, joins it, makes a TCP listener on 127.0.0.1:PROXY_PORT and a NETLINK_SOCK_DIAG
socket (to ask the kernel who made each peer socket), sends both back over a socket pair
(SCM_RIGHTS) and exits. The daemon, in the host's network namespace, then accepts connections
made inside the task's and connects out from its own.

Must never: run in the daemon's own process (setns of a mount namespace needs a single thread,
and the daemon's resolver runs threads), or bind anything but the task's loopback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from typing import Any

from settled.boundary import linux, podhost
from settled.boundary.podmake import inside
from settled.netpolicy import PROXY_PORT

BACKLOG = 512


def open_task(home: str, task: str) -> tuple[socket.socket, socket.socket, int]:
    """(listener, sock_diag socket, the namespace's inode) of `task`'s network namespace.
    OSError naming why not: no pod, no network namespace, or the port held by a command of
    the task."""
    pod = podhost.find(home, task)
    if pod is None or "net" not in pod:
        raise OSError(errno.ENOENT, f"task {task} has no pod with a network namespace")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the helper's life, checked through what it sends
        ours.close()
        code = 1
        try:
            _make(pod, theirs)
            code = 0
        except BaseException as exc:
            with contextlib.suppress(OSError):
                theirs.sendall(f"{getattr(exc, 'errno', 0) or errno.EIO}:{exc}".encode())
        finally:
            os._exit(code)
    theirs.close()
    try:
        message, fds, _flags, _addr = socket.recv_fds(ours, 4096, 2)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        number, _, why = message.decode("utf-8", "replace").partition(":")
        raise OSError(int(number) if number.isdigit() else errno.EIO, why or "the helper died")
    return socket.socket(fileno=fds[0]), socket.socket(fileno=fds[1]), int(pod["net"])


def _make(pod: dict[str, Any], back: socket.socket) -> None:
    with inside(pod["pin"]):
        net = os.open(f"{pod['dir']}/net", os.O_RDONLY | os.O_CLOEXEC)
    if os.fstat(net).st_ino != pod["net"]:
        raise OSError(errno.ESTALE, f"the network namespace of pod {pod['hostname']} changed")
    linux.setns(net, linux.CLONE_NEWNET)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # a restarted proxy binds past its predecessor's closed connections (TIME_WAIT); never past
    # a listener (no SO_REUSEPORT, so no command's socket shares the port either)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", PROXY_PORT))
    except OSError as exc:
        raise OSError(exc.errno, f"127.0.0.1:{PROXY_PORT} in the task's network namespace: "
                      f"{exc.strerror} (a command of the task holds it?)") from None  # fmt: skip
    listener.listen(BACKLOG)
    diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 4)
    socket.send_fds(back, [b"ok"], [listener.fileno(), diag.fileno()])
