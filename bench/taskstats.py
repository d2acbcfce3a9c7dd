"""Each exiting task's own CPU time, from the kernel's taskstats (generic netlink), by process.

A listener registered for every CPU gets one message per exiting task (thread or process): its
pid, its thread group id and `cpu_run_virtual_total`, the scheduler's sum_exec_runtime in
nanoseconds, exact, of that task alone. Summed by thread group, that is a process's own CPU
over its whole life, every thread included and none of its children (whose groups are their
own): what neither `/proc/PID/stat` (10 ms ticks) nor wait4 (which adds what it reaped) says.
Needs root (CAP_NET_ADMIN) and CONFIG_TASKSTATS; `TaskExits.open()` is None without them.
Offsets are those of `struct taskstats` version 13 (linux/taskstats.h), checked at open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
NLM_F_REQUEST = 1
TASKSTATS_CMD_GET = 1
REGISTER_CPUMASK = 3
TYPE_STATS, TYPE_AGGR_PID = 3, 4
VERSION_AT, VIRTUAL_NS_AT, PID_AT, PPID_AT, TGID_AT = 0, 72, 128, 132, 368  # version 13
MIN_VERSION = 10  # ac_tgid's
SO_RCVBUFFORCE = 33


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("HH", size, kind) + payload + b"\0" * (-size % 4)


def _attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    at = 0
    while at + 4 <= len(data):
        size, kind = struct.unpack_from("HH", data, at)
        if size < 4:
            return
        yield kind & 0x3FFF, data[at + 4 : at + size]
        at += size + (-size % 4)


def _request(family: int, command: int, payload: bytes) -> bytes:
    body = struct.pack("BBH", command, 1, 0) + payload
    return struct.pack("IHHII", 16 + len(body), family, NLM_F_REQUEST, 1, 0) + body


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    at = 0
    while at + 16 <= len(data):
        size, kind = struct.unpack_from("IH", data, at)
        yield kind, data[at + 20 : at + size]  # past the netlink and generic headers
        at += size + (-size % 4)


class TaskExits:
    """A thread reading every task exit of this process's children (a subreaper's, so its
    orphaned descendants too): `own_cpu_s(pid)` once `pid` was reaped."""

    def __init__(self, sock: socket.socket, family: int) -> None:
        self._sock, self._family = sock, family
        self._parent = os.getpid()
        self._cpu_ns: dict[int, int] = {}  # thread group -> its exited tasks' CPU
        self._leaders: set[int] = set()  # thread groups whose leader's exit was read
        self.overruns = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="taskstats", daemon=True).start()

    @classmethod
    def open(cls) -> TaskExits | None:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        except OSError:
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
            sock.bind((0, 0))
            name = _attr(CTRL_ATTR_FAMILY_NAME, b"TASKSTATS\0")
            sock.send(_request(GENL_ID_CTRL, CTRL_CMD_GETFAMILY, name))
            family = next(
                struct.unpack("H", value[:2])[0]
                for _, payload in _messages(sock.recv(65536))
                for kind, value in _attrs(payload)
                if kind == CTRL_ATTR_FAMILY_ID
            )
            cpus = f"0-{(os.cpu_count() or 1) - 1}\0".encode()
            sock.send(_request(family, TASKSTATS_CMD_GET, _attr(REGISTER_CPUMASK, cpus)))
        except (OSError, StopIteration):
            sock.close()
            return None
        return cls(sock, family)

    def _run(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except OSError as error:
                if error.errno == errno.ENOBUFS:  # the kernel dropped some; later ones count
                    self.overruns += 1
                    continue
                return  # closed
            for kind, payload in _messages(data):
                if kind == self._family:
                    self._read(payload)

    def _read(self, payload: bytes) -> None:
        for kind, value in _attrs(payload):
            if kind != TYPE_AGGR_PID:
                continue
            for inner, stats in _attrs(value):
                if (
                    inner != TYPE_STATS
                    or struct.unpack_from("H", stats, VERSION_AT)[0] < MIN_VERSION
                ):
                    continue
                (virtual_ns,) = struct.unpack_from("Q", stats, VIRTUAL_NS_AT)
                (pid,) = struct.unpack_from("I", stats, PID_AT)
                (tgid,) = struct.unpack_from("I", stats, TGID_AT)
                if struct.unpack_from("I", stats, PPID_AT)[0] != self._parent:
                    continue  # not a child of this process (its owners are re-parented here)
                with self._cond:
                    self._cpu_ns[tgid] = self._cpu_ns.get(tgid, 0) + virtual_ns
                    if pid == tgid:
                        self._leaders.add(tgid)
                    self._cond.notify_all()

    def own_cpu_s(self, pid: int, timeout: float = 2.0) -> float | None:
        """The whole life's CPU of process `pid`, every thread of it, none of its children;
        call once it was reaped (every thread had exited). None if its exit was not read
        (dropped by an overrun), or `pid` was another process's before."""
        give_up = time.monotonic() + timeout
        with self._cond:
            while pid not in self._leaders:
                left = give_up - time.monotonic()
                if left <= 0:
                    self._cpu_ns.pop(pid, None)
                    return None
                self._cond.wait(left)
            self._leaders.discard(pid)
            return self._cpu_ns.pop(pid) / 1e9

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
