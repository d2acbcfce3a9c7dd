"""Who is at the other end of a settled socket, and whether settled serves it.

Every socket settled listens on (the home's launcher, the journal daemon, `settled serve` and
`settled serve --swerex`) asks here once per connection, before it reads a byte of the request:
the answer is None (serve it) or one line saying why not (close it, and log the line). A
session's command is hostile and usually root, so neither a uid check nor a bearer token tells
it from settled: where it runs does.

Unix sockets (`unix_refusal`): the peer is the process that connected, pinned by a pidfd
(SO_PEERPIDFD, Linux 6.5), so a pid reused meanwhile is never the one judged. It is refused when
its PID namespace or its mount namespace is not this process's own (nsfs identities, through
the pidfd's PIDFD_GET_*_NAMESPACE ioctls, Linux 6.11, else `/proc/<pid>/ns/*`; a session's
command has both of its own, and so has a process `unshare -m` started), when one of its cgroup
paths lies inside a session of settled's tree (`<any>/settled/t_<hex>/s_<hex>`, boundary/
cgroup2.py's layout, in any hierarchy), or when it cannot be read (gone, or unreadable). Where
this process may not read the peer's namespaces (it runs in a child user namespace: ptrace
rules), the same two questions are answered without that right: the pidfd's `NSpid` has one
entry only for a process of this PID namespace, and the first line of `/proc/<pid>/mountinfo`
names the same mount (mount ids are never shared by two namespaces) only in this mount
namespace. Without SO_PEERPIDFD (Linux < 6.5), SO_PEERCRED's pid is pinned with pidfd_open and
refused if that process started after the check began (a pid reused between the connect and
the accept of a queued connection is the one case this cannot see).

TCP (`tcp_refusal`): the peer socket itself, when it is on this host, found by NETLINK_SOCK_DIAG
for the exact 4-tuple (IPv4 and IPv6), and the cgroup v2 the kernel recorded when the socket was
made (INET_DIAG_CGROUP_ID, Linux 5.7), mapped to its path (sockdiag.py asks the kernel all
three). Refused when that cgroup is inside a session. A peer socket not found on this host is
a remote client, allowed (the token decides), unless its address is one of this host's (the
kernel's route lookup says `local`): that socket closed before it could be checked.

Cost per connection, measured by bench/peers.py (2,000 interleaved rounds on this 2-vCPU VM,
Linux 6.18): a unix peer adds ~33 us p50 to a connection's ~11 us (two nsfs ioctls, the cgroup
file, the pidfd's fdinfo); a TCP peer of this host ~26 us p50 to its ~31 us (the sock_diag
lookup, then ~9 us for the kernfs handle); a peer not on this host ~19 us (the lookup finds
nothing, the route lookup says not local). Without CAP_DAC_READ_SEARCH the walk costs ~12 us
per cgroup directory of the host (6 ms for 500): a non-root server pays it for each TCP peer of
this host.

Must never: serve a peer it could not read (every doubt is a refusal), judge a pid no pidfd
pins, remember a verdict from one connection to the next (a 4-tuple or a pid is reused), or
import more than the standard library's small modules (the launcher's and the journal's
callers pay for this module's import).
"""

from __future__ import annotations

import _socket
import errno
import fcntl
import os
import struct
import time

from settled.sockdiag import cgroup_path, is_local, peer_socket

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

SESSION_TREE = "settled"  # boundary/cgroup2.py ROOT_DIR_NAME: <hierarchy>/settled/<task>/<session>
SO_PEERPIDFD = 77  # Linux 6.5
PIDFD_GET_MNT_NAMESPACE = 0xFF03  # _IO(PIDFS_IOCTL_MAGIC, 3), Linux 6.11
PIDFD_GET_PID_NAMESPACE = 0xFF05  # _IO(PIDFS_IOCTL_MAGIC, 5)
_NO_IOCTL = (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP)  # a kernel before 6.11
_NOT_ALLOWED = (errno.EACCES, errno.EPERM)
_NAMES = {"pid": "PID", "mnt": "mount"}


# -- unix sockets ---------------------------------------------------------------------------------


def unix_refusal(conn: _socket.socket) -> str | None:
    """None when the process that connected `conn` runs in this process's mount and PID
    namespaces and in no session's cgroup; else one line naming it and why not."""
    try:
        raw = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
    except OSError as exc:
        return f"a peer whose credentials cannot be read ({_say(exc)})"
    who = f"peer pid {pid} uid {uid}"
    if pid <= 0:
        return f"peer uid {uid}: its process has no pid in this PID namespace (it runs in another)"
    started = time.clock_gettime(time.CLOCK_BOOTTIME)
    try:
        pidfd, pinned = _pidfd(conn, pid)
    except OSError as exc:
        return f"{who}: its process cannot be read ({_say(exc)})"
    try:
        why = _judge(pidfd, pid, None if pinned else started)
    except OSError as exc:
        why = f"its process cannot be read ({_say(exc)})"
    finally:
        os.close(pidfd)
    return None if why is None else f"{who}: {why}"


def _pidfd(conn: _socket.socket, pid: int) -> tuple[int, bool]:
    """A pidfd of the peer, and whether the kernel pinned it to the very process that connected
    (SO_PEERPIDFD) rather than to whoever holds its pid now (pidfd_open)."""
    try:
        return int(conn.getsockopt(_socket.SOL_SOCKET, SO_PEERPIDFD)), True
    except OSError as exc:
        if exc.errno != errno.ENOPROTOOPT:
            raise
    return os.pidfd_open(pid), False


def _judge(pidfd: int, pid: int, started: float | None) -> str | None:
    """Why the pidfd's process (pid `pid` here) is not served, or None. `started`: when the
    check began, for a pidfd that pidfd_open made from a pid (that process must be older).

    The namespaces come through the pidfd itself; what is read through /proc/<pid> counts only
    because the pidfd's process still holds that pid once it is read (`_pidfd_pids` after):
    a process never comes back, so its pid was never free while it was read."""
    if started is not None and _start_time(pid) > started:
        return "its pid was reused by a process started after the connection"
    pidns = _namespace(pidfd, pid, "pid", PIDFD_GET_PID_NAMESPACE)
    mntns = _namespace(pidfd, pid, "mnt", PIDFD_GET_MNT_NAMESPACE)
    first_mount = _first_mount(pid) if mntns is None else None
    cgroups = _read(f"/proc/{pid}/cgroup")
    pids = _pidfd_pids(pidfd)
    if pids[0] != pid:
        return "its process ended before it could be read"
    if pidns is None and len(pids) > 1:
        return f"its PID namespace is not this process's (pid {pid} here is pid {pids[-1]} in its)"
    own = _own_namespaces()
    for kind, theirs, mine in (("pid", pidns, own[0]), ("mnt", mntns, own[1])):
        if theirs is not None and theirs != mine:
            return (f"its {_NAMES[kind]} namespace {kind}:[{theirs[1]}] is not this process's "
                    f"{kind}:[{mine[1]}]")  # fmt: skip
    if mntns is None and first_mount != own[2]:
        return "its mount namespace is not this process's (its root mount is another)"
    inside = session_of(cgroups)
    if inside is not None:
        return f"it runs in cgroup {inside[0]}, inside settled's session {inside[1]}"
    return None


def _pidfd_pids(pidfd: int) -> list[int]:
    """The pidfd's process as this PID namespace sees it, then in each namespace below, down to
    its own (`NSpid`); [-1] once it has been reaped, [0] when it has no pid here."""
    info = _read(f"/proc/self/fdinfo/{pidfd}")
    for name in ("NSpid:", "Pid:"):  # Pid: only, on a kernel without CONFIG_PID_NS
        for line in info.splitlines():
            if line.startswith(name):
                return [int(part) for part in line.split()[1:]]
    raise OSError(errno.EINVAL, "the pidfd's fdinfo names no pid")


def _namespace(pidfd: int, pid: int, kind: str, request: int) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the process's namespace of `kind`, or None when this process may not
    read it (ptrace's rules: another user namespace's process, or an undumpable one)."""
    try:
        nsfd = fcntl.ioctl(pidfd, request)
    except OSError as exc:
        if exc.errno in _NOT_ALLOWED:
            return None
        if exc.errno not in _NO_IOCTL:
            raise
    else:
        try:
            found = os.fstat(nsfd)
        finally:
            os.close(nsfd)
        return found.st_dev, found.st_ino
    try:
        found = os.stat(f"/proc/{pid}/ns/{kind}")
    except OSError as exc:
        if exc.errno in _NOT_ALLOWED:
            return None
        raise
    return found.st_dev, found.st_ino


_OWN: dict[int, tuple[tuple[int, int], tuple[int, int], str]] = {}


def _own_namespaces() -> tuple[tuple[int, int], tuple[int, int], str]:
    """This process's PID and mount namespaces and first mount, read once per process (a
    process of settled that serves a socket never changes its own namespaces)."""
    pid = os.getpid()
    if pid not in _OWN:
        _OWN.clear()  # a fork's parent's
        pidns, mntns = os.stat("/proc/self/ns/pid"), os.stat("/proc/self/ns/mnt")
        _OWN[pid] = (pidns.st_dev, pidns.st_ino), (mntns.st_dev, mntns.st_ino), _first_mount("self")
    return _OWN[pid]


def _first_mount(pid: int | str) -> str:
    """The first line of the process's mountinfo: readable without ptrace's rights, and its
    mount id belongs to one mount namespace only."""
    fd = os.open(f"/proc/{pid}/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode(errors="replace").partition("\n")[0]
    finally:
        os.close(fd)


def _start_time(pid: int) -> float:
    """When the process started, in CLOCK_BOOTTIME seconds (the clock /proc/<pid>/stat counts
    ticks of), rounded down to its tick."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


# -- cgroups ---------------------------------------------------------------------------------


def session_of(cgroups: str, own: str | None = None) -> tuple[str, str] | None:
    """(path, session) for the first cgroup path of `cgroups` (the text of /proc/<pid>/cgroup)
    that lies inside one of settled's sessions, `<any>/settled/t_<16 hex>/s_<16 hex>`; None if
    none does. A session that holds this process too (`own`, default its /proc/self/cgroup: a
    settled that runs inside a session) is its own and not counted."""
    mine: dict[str, str] | None = None
    for key, path in _hierarchies(cgroups):
        for session in session_roots(path):
            if mine is None:
                mine = dict(_hierarchies(_read("/proc/self/cgroup") if own is None else own))
            if not _within(mine.get(key), session):
                return path, session
    return None


def _hierarchies(text: str) -> Iterator[tuple[str, str]]:
    """(hierarchy key, path) per line of a /proc/<pid>/cgroup ("ID:CONTROLLERS:PATH")."""
    for line in text.splitlines():
        key, _, path = line.rpartition(":")
        if key:
            yield key, path


def session_roots(path: str) -> Iterator[str]:
    """Each `<any>/settled/t_<hex>/s_<hex>` that `path` lies in (a session's cgroup)."""
    parts = path.split("/")
    for at in range(len(parts) - 2):
        if (
            parts[at] == SESSION_TREE
            and _is_id(parts[at + 1], "t_")
            and _is_id(parts[at + 2], "s_")
        ):
            yield "/".join(parts[: at + 3]) or "/"


def _is_id(name: str, prefix: str) -> bool:
    """identity.new_id's form: the prefix and 16 lowercase hex digits."""
    return len(name) == 18 and name.startswith(prefix) and all(c in "0123456789abcdef"
                                                                for c in name[2:])  # fmt: skip


def _within(path: str | None, root: str) -> bool:
    return path is not None and (path == root or path.startswith(root.rstrip("/") + "/"))


# -- TCP -------------------------------------------------------------------------------------


def tcp_refusal(peer: tuple[str, int], local: tuple[str, int]) -> str | None:
    """None when the connection from `peer` to `local` (the accepted socket's peername and
    sockname) comes from another host, or from a socket of this host made outside every
    session; else one line naming it and why not."""
    host, port = _plain(peer[0]), int(peer[1])
    who = f"peer {host}:{port}"
    try:
        family, src, dst = _packed(host, _plain(local[0]))
        found = peer_socket(family, src, port, dst, int(local[1]))
        if found is None:
            if is_local(family, src):
                return f"{who}: {GONE}"
            return None  # another host's: the token decides
        state, uid, cgroup_id = found
        who = f"{who} uid {uid}"
        if cgroup_id is None:
            return f"{who}: its socket on this host is {state} and names no cgroup to check"
        path = cgroup_path(cgroup_id)
    except (OSError, ValueError) as exc:
        why = _say(exc) if isinstance(exc, OSError) else str(exc)
        return f"{who}: its socket cannot be checked ({why})"
    if path is None:
        return f"{who}: its socket's cgroup (id {cgroup_id}) no longer exists to be checked"
    inside = session_of(f"0::{path}")
    if inside is not None:
        return f"{who}: its socket was made in cgroup {path}, inside settled's session {inside[1]}"
    return None


GONE = "its address is this host's but its socket is gone (closed before it could be checked)"


def _plain(host: str) -> str:
    """An address without its IPv6 zone, and an IPv4-mapped one as IPv4 (the socket at the other
    end may be either; the kernel's lookup by IPv4 finds both)."""
    host = host.partition("%")[0]
    if host.lower().startswith("::ffff:") and "." in host:
        return host[7:]
    return host


def _packed(peer: str, local: str) -> tuple[int, bytes, bytes]:
    family = _socket.AF_INET6 if ":" in peer else _socket.AF_INET
    if (":" in local) != (family == _socket.AF_INET6):
        raise ValueError(f"{peer} and {local} are not of one address family")
    return family, _socket.inet_pton(family, peer), _socket.inet_pton(family, local)


def _read(path: str) -> str:
    """A small /proc file, whole (open() costs twice os.open here: ~35 us against ~15)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 65536)]
        while chunks[-1]:
            chunks.append(os.read(fd, 65536))
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def _say(exc: OSError) -> str:
    return exc.strerror or str(exc)
