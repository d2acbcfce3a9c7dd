"""What the kernel says about a TCP peer of this host: its socket, and where that was made.

Owns three questions, each asked of the kernel directly (no /proc scan): which socket of this
network namespace is bound to one end of a TCP connection and connected to the other
(NETLINK_SOCK_DIAG, `inet_diag_req_v2` for the exact 4-tuple, IPv4 or IPv6), with its state,
uid and the cgroup v2 it was made in (INET_DIAG_CGROUP_ID, Linux 5.7); whether an address is
one of this host's (NETLINK_ROUTE: the route the kernel picks for it is `local`); and the path
of a cgroup v2 given its id (the directory's inode on cgroup2: a kernfs file handle opened by
open_by_handle_at, which needs CAP_DAC_READ_SEARCH, else a walk of the hierarchy reading
d_ino, no stat). peers.py decides with the answers.

Must never: take a socket the lookup fell back to (a listener on the same port) for the peer,
cache an answer (sockets, ports and cgroup ids are reused), or import more than the standard
library (ctypes only once a cgroup id is to be opened).
"""

from __future__ import annotations

import _socket
import errno
import os
import struct

from settled.where import mountinfo_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

NETLINK_ROUTE, NETLINK_SOCK_DIAG = 0, 4
SOCK_DIAG_BY_FAMILY, RTM_GETROUTE, NLMSG_ERROR = 20, 26, 2
NLM_F_REQUEST = 1
INET_DIAG_CGROUP_ID = 21  # Linux 5.7
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
RTN_LOCAL = 2
FILEID_KERNFS = 0xFE
TCP_STATES = ("", "established", "syn-sent", "syn-recv", "fin-wait-1", "fin-wait-2",
              "time-wait", "closed", "close-wait", "last-ack", "listen", "closing")  # fmt: skip


def peer_socket(
    family: int, src: bytes, sport: int, dst: bytes, dport: int, via: Any = None
) -> tuple[str, int, int | None] | None:
    """(state, uid, cgroup id or None) of this host's TCP socket bound to src:sport and connected
    to dst:dport, or None when this network namespace has none. `via`: a NETLINK_SOCK_DIAG
    socket made in another network namespace, to ask about that one's sockets (a task's, for
    its proxy: netproxy/)."""
    request = struct.pack("=BBBxI", family, _socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
    request += struct.pack(">HH", sport, dport) + src.ljust(16, b"\0") + dst.ljust(16, b"\0")
    request += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    reply = _netlink(NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, request, via)
    if reply is None:
        return None
    if len(reply) < 72:
        raise OSError(errno.EPROTO, "a short sock_diag reply")
    state, (rport, rdport) = reply[1], struct.unpack_from(">HH", reply, 4)
    rsrc, rdst = reply[8 : 8 + len(src)], reply[24 : 24 + len(dst)]
    if (rport, rdport, rsrc, rdst) != (sport, dport, src, dst) or state == 10:
        return None  # a listener on the peer's port, not the peer: the kernel's fallback
    uid = struct.unpack_from("=I", reply, 64)[0]
    cgroup = _attribute(reply[72:], INET_DIAG_CGROUP_ID)
    name = TCP_STATES[state] if state < len(TCP_STATES) else f"in state {state}"
    return name, uid, None if cgroup is None else struct.unpack("=Q", cgroup[:8])[0]


def is_local(family: int, address: bytes) -> bool:
    """Whether the kernel routes `address` to this host (route type `local`): a connection from
    it came from this network namespace, never from a wire."""
    header = struct.pack("=BBBBBBBBI", family, len(address) * 8, 0, 0, 0, 0, 0, 0, 0)
    attribute = struct.pack("=HH", 4 + len(address), 1) + address  # RTA_DST
    reply = _netlink(NETLINK_ROUTE, RTM_GETROUTE, header + attribute)
    return reply is not None and len(reply) >= 8 and reply[7] == RTN_LOCAL


def _netlink(protocol: int, kind: int, body: bytes, via: Any = None) -> bytes | None:
    """One request and the body of its one answer; None for ENOENT, ENETUNREACH and the like
    (nothing there); OSError for the rest. `via`: a netlink socket of `protocol` to ask on (kept
    by its caller, who asks one question at a time), else one made for this question."""
    sock = via or _socket.socket(
        _socket.AF_NETLINK, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC, protocol
    )
    try:
        sock.sendto(struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST, 1, 0) + body, (0, 0))
        sock.settimeout(5.0)
        data = sock.recv(65536)
    finally:
        if via is None:
            sock.close()
    length, answer = struct.unpack_from("=IH", data)
    if answer == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, 16)[0]
        if code in (errno.ENOENT, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EINVAL):
            return None
        raise OSError(code, os.strerror(code))
    return data[16:length]


def _attribute(data: bytes, wanted: int) -> bytes | None:
    at = 0
    while at + 4 <= len(data):
        size, kind = struct.unpack_from("=HH", data, at)
        if size < 4:
            break
        if kind & 0x3FFF == wanted:
            return data[at + 4 : at + size]
        at += (size + 3) & ~3
    return None


# -- cgroup ids -------------------------------------------------------------------------------


_MOUNT: list[tuple[str, str]] = []  # the cgroup2 mount: (its path here, its root's path)


def cgroup_path(cgroup_id: int) -> str | None:
    """The cgroup v2 path (as /proc/<pid>/cgroup writes it) of the cgroup with this id, or None
    when no cgroup has it (removed). Through a kernfs file handle; without the right to open one
    (CAP_DAC_READ_SEARCH), by a walk of the hierarchy."""
    point, root = cgroup2_mount()
    try:
        found = _open_by_id(point, cgroup_id)
    except PermissionError:
        found = walk_for(point, cgroup_id)
    if found is None:
        return None
    if found != point and not found.startswith(point.rstrip("/") + "/"):
        raise OSError(errno.EXDEV, f"cgroup {cgroup_id} is at {found}, outside {point}")
    inside = found[len(point.rstrip("/")) :].strip("/")
    return "/" + "/".join(part for part in (root.strip("/"), inside) if part)


def cgroup2_mount() -> tuple[str, str]:
    if not _MOUNT:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    fields = left.split()
                    _MOUNT.append((mountinfo_path(fields[4]), mountinfo_path(fields[3])))
                    break
        if not _MOUNT:
            raise OSError(errno.ENOENT, "no cgroup2 filesystem is mounted here")
    return _MOUNT[0]


_LIBC: list[Any] = []  # ctypes' libc, loaded at the first TCP peer (~60 us a load)


def _open_by_id(point: str, cgroup_id: int) -> str | None:
    import ctypes

    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    libc = _LIBC[0]
    handle = ctypes.create_string_buffer(struct.pack("=IiQ", 8, FILEID_KERNFS, cgroup_id))
    mount = os.open(point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = libc.open_by_handle_at(mount, handle, os.O_PATH | os.O_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            if code in (errno.ESTALE, errno.ENOENT):
                return None
            raise OSError(code, f"open_by_handle_at: {os.strerror(code)}")
    finally:
        os.close(mount)
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def walk_for(point: str, cgroup_id: int) -> str | None:
    """The directory under `point` whose inode is the cgroup id (readdir's d_ino: no stat)."""
    if os.stat(point).st_ino == cgroup_id:
        return point
    pending = [point]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue  # removed while walked, or not ours to read
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.inode() == cgroup_id:
                    return entry.path
                pending.append(entry.path)
    return None
