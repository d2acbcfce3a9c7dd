"""A pod's network namespace: made with the pod, owned by its user namespace, holding one
interface, its loopback, up; what a receipt says of a command's network; what one holds now.

A command's network is one of three (identity.NETWORK_POLICIES), chosen by the launcher from the
spec (owner/handoff.py) and carried by the plan (`IsolationPlan.network`):

- "none": the init joins its task's network namespace before the view, with the pod's IPC and
  UTS namespaces (podns.join_before_view). Its network is its task's loopback (127.0.0.1, ::1,
  abstract unix sockets), shared by the task's sessions (a `--service` of one answers another)
  and by no other task, and nothing else: there is no other interface, so no route leaves it,
  and the host's loopback services are not in it. The pod's user namespace owns it, so root
  inside holds CAP_NET_BIND_SERVICE and CAP_NET_RAW over it (ports below 1024, ping), and
  CAP_NET_ADMIN is out of every command's bounding set (isolation.KEPT_CAPS): no command adds
  an interface or a route, or takes the loopback down.
- "proxy": as "none", and the task's loopback holds settled's proxy on 127.0.0.1:3128, its one
  way out (netproxy/: a listener made in this namespace, served from the host's).
- "host": the host's network namespace, as before pods had one: every address and port of the
  host, its loopback services and abstract unix sockets included. A grant, named as one in the
  receipt (`facts`), not a protection missing.

The namespace is made by the pod's first process (podmake.py) and kept, found, released and
described exactly as the pod's other namespaces are (podhost.py); a pod made before pods had
one gets one on its next `ensure` (`add_namespace`), its other namespaces kept. Never decides
which mode a session gets (handoff does); imports only os at run time (isolation.py, on the
owner's launch path, imports `facts`).
"""

from __future__ import annotations

import errno
import os

TYPE_CHECKING = False  # isolation.py imports this on the owner's launch path: no typing
if TYPE_CHECKING:
    from typing import Any, Final

MODES: Final = ("host", "none", "proxy")
JOINED: Final = ("none", "proxy")  # the modes whose init joins the pod's network namespace
SIOCGIFFLAGS: Final = 0x8913
SIOCSIFFLAGS: Final = 0x8914
IFF_UP: Final = 0x1
IFREQ: Final = "16sh22x"  # struct ifreq: the name, then ifr_flags in a 24-byte union
LOOPBACK: Final = "lo"
HOST: Final = (
    "the host's network namespace: every address and port of the host, its loopback services "
    "and abstract unix sockets included, shared with the host and every session run with "
    "network host; granted, by --network host"
)
NONE: Final = (
    "its task's own network namespace: the loopback (127.0.0.1, ::1, abstract unix sockets) "
    "shared by the task's sessions and no other task's; no other interface, so no route out, "
    "and none of the host's loopback services"
)


PROXY: Final = (
    "its task's own network namespace, as with none, whose one way out is settled's proxy on "
    "127.0.0.1:3128 (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY): every connection through it is judged "
    "against --allow-host and recorded in the session's ledger; a tool that ignores the proxy "
    "variables gets no route"
)


def facts(mode: str, pod: dict[str, Any] | None) -> dict[str, Any]:
    """The receipt's `isolation.network`: the mode, and for "none" and "proxy" the namespace
    (by inode) and what it holds."""
    if mode not in JOINED:
        return {"mode": "host", "namespace": "host", "shared": HOST}
    inode = pod.get("net") if pod is not None else None
    reaches = NONE if mode == "none" else PROXY
    return {"mode": mode, "namespace": inode, "interfaces": [LOOPBACK], "reaches": reaches}


def loopback_up() -> None:
    """In this process's network namespace (a new one: its loopback down), bring the loopback
    up: SIOCSIFFLAGS on a socket made in it, which needs CAP_NET_ADMIN over the namespace (the
    process that made it has it)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        asked = struct.pack(IFREQ, LOOPBACK.encode(), 0)
        flags = struct.unpack(IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, asked))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(IFREQ, LOOPBACK.encode(), flags | IFF_UP))


def interfaces() -> dict[str, str]:
    """Each interface of this process's network namespace, "up" or "down" (for `describe`)."""
    import fcntl
    import socket
    import struct

    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        for _index, name in socket.if_nameindex():
            asked = struct.pack(IFREQ, name.encode(), 0)
            flags = struct.unpack(IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, asked))[1]
            found[name] = "up" if flags & IFF_UP else "down"
    return found


def add_namespace(pin: str, pod: dict[str, Any]) -> int:
    """In podhost's helper: give `pod` (a record made before pods had a network namespace) one,
    owned by its user namespace, its loopback up, bound at `<dir>/net` inside the pods namespace
    pinned at `pin`. Its inode. A child joins the pod's user namespace (checked by inode) and
    makes the namespace; this process, still the host's, binds it (as podmake.make_pod does)."""
    from settled.boundary import podmake

    with podmake.inside(pin):
        user = os.open(f"{pod['dir']}/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(user).st_ino != pod["user"]:
            raise podmake.PodUnavailable(errno.ESTALE, "the pod's user namespace is not its own")
        with podmake.helper(lambda given, told: _make_in(user, given, told)) as (pid, _, hear):
            podmake.expect_line(hear, "made")
            net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:  # the child exits at EOF: the mount holds its namespace
                return podmake.bind_namespaces(pin, pod["dir"], {"net": net}, fresh=False)["net"]
            finally:
                os.close(net)
    finally:
        os.close(user)


def _make_in(user: int, from_parent: int, to_parent: int) -> None:
    """The child of `add_namespace` (never returns): into the pod's user namespace, a network
    namespace of its own, the loopback up; then wait for EOF (the namespace bound)."""
    from settled.boundary import linux, podmake

    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, podmake.SIGKILL)
        linux.setns(user, linux.CLONE_NEWUSER)
        linux.unshare(linux.CLONE_NEWNET)
        loopback_up()
        os.write(to_parent, b"made\n")
        podmake.read_line(from_parent)
    except BaseException as exc:
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            os.write(to_parent, f"error {exc}\n".encode("utf-8", "replace"))
        except OSError:
            pass
    finally:
        os._exit(0)
