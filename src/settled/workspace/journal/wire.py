"""The journal's wire protocol, spoken by every caller of its daemon, and the `Watermark`.

One home runs one journal daemon that watches every open task's workspace. One request per
connection, one JSON object per line each way; every request but `stop` names its task:
`{"op": "watch", "task", "root"}` (start watching a task's workspace; cheap when it already
is), `barrier`, `reset` (with `seq`), `ping` (the task optional), `release` (stop watching the
task; `forget` also drops its state, for a task whose creation is undone) and `stop` (the
whole daemon). A journal that does not answer within the timeout, or does not watch the task,
is None here (never an exception), and the caller records that and falls back to a full scan.

Must never import anything outside the standard library (no `settled.*`, no inotify_simple): a
session owner started with `python -I -S` and only its own import roots imports this module on
the path from death evidence to its receipt (tests/test_journal.py checks every import). For the
same reason it loads no dataclasses, typing or `socket` (whose enums cost ~2 ms): a fresh owner
would pay ~10 ms of imports between its command's exit and its receipt.
"""

from __future__ import annotations

import _socket
import contextlib
import json
import os
import time
from collections.abc import Iterator

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Where a run directory's journal lives: its socket, its log and its task state files.
SOCKET_NAME, LOG_NAME, STATE_DIR = "journal.sock", "journal.log", "journal"
_FIELDS = ("seq", "overflowed", "trustworthy", "dirty_dirs", "lost_watches", "reasons")


class Watermark:
    """Where a task's journal stood at a barrier. `trustworthy` False: do a full scan.
    Immutable, compared and hashed by its fields (the frozen dataclass it was)."""

    __slots__ = _FIELDS
    seq: int
    overflowed: bool
    trustworthy: bool
    dirty_dirs: frozenset[str]
    lost_watches: frozenset[str]
    reasons: tuple[str, ...]

    def __init__(
        self,
        seq: int,
        overflowed: bool,
        trustworthy: bool,
        dirty_dirs: frozenset[str],
        lost_watches: frozenset[str] = frozenset(),
        reasons: tuple[str, ...] = (),
    ) -> None:
        values = (seq, overflowed, trustworthy, dirty_dirs, lost_watches, reasons)
        for name, value in zip(_FIELDS, values, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Watermark is frozen: cannot assign {name!r}")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not Watermark:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return "Watermark(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in _FIELDS) + ")"

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "overflowed": self.overflowed,
            "trustworthy": self.trustworthy,
            "dirty_dirs": sorted(self.dirty_dirs),
            "lost_watches": sorted(self.lost_watches),
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Watermark:
        return cls(
            seq=int(data["seq"]),
            overflowed=bool(data["overflowed"]),
            trustworthy=bool(data["trustworthy"]),
            dirty_dirs=frozenset(data["dirty_dirs"]),
            lost_watches=frozenset(data.get("lost_watches", ())),
            reasons=tuple(data.get("reasons", ())),
        )


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """An AF_UNIX address for `path`: sun_path holds 107 bytes, a run directory may be longer."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def request(socket_path: str, fields: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """Send one request and read its one-line reply; None if nobody answers within `timeout`."""
    line = json.dumps(fields, separators=(",", ":")).encode() + b"\n"
    deadline = time.monotonic() + timeout
    data = b""
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        try:
            with unix_address(socket_path) as address:
                sock.settimeout(timeout)
                sock.connect(address)
                sock.sendall(line)
                sock.shutdown(_socket.SHUT_WR)  # one request per connection: the journal drops it
                while b"\n" not in data:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    sock.settimeout(remaining)
                    chunk = sock.recv(1 << 16)
                    if not chunk:
                        return None
                    data += chunk
        finally:
            sock.close()
        reply = json.loads(data.partition(b"\n")[0])
    except (OSError, ValueError):
        return None
    return reply if isinstance(reply, dict) else None


def _watermark_of(reply: dict[str, Any] | None) -> Watermark | None:
    if reply is None or "error" in reply:
        return None
    try:
        return Watermark.from_json(reply)
    except (KeyError, TypeError, ValueError):
        return None


def barrier(socket_path: str, task: str, timeout: float = 2.0) -> Watermark | None:
    """The task's watermark after every change completed before this call; None if no journal
    answers within `timeout` or it does not watch the task (record that and do a full scan)."""
    return _watermark_of(request(socket_path, {"op": "barrier", "task": task}, timeout))


def terminal_mutation(socket_path: str, task: str, timeout: float = 2.0) -> dict[str, Any]:
    """A process receipt's `terminal_mutation`: the barrier read after death evidence, so every
    write of the session's processes is at or below `seq`; or why there is no sequence."""
    watermark = barrier(socket_path, task, timeout)
    if watermark is None:
        return {
            "seq": None,
            "source": "none",
            "why": "the task's journal did not answer; the final scan covers this session",
        }
    return {"seq": watermark.seq, "source": "journal", "trustworthy": watermark.trustworthy}


def reset(socket_path: str, task: str, upto_seq: int, timeout: float = 2.0) -> Watermark | None:
    """Tell the task's journal a checkpoint covers `upto_seq`; the watermark after the reset."""
    fields = {"op": "reset", "task": task, "seq": int(upto_seq)}
    return _watermark_of(request(socket_path, fields, timeout))


def watch(socket_path: str, task: str, root: str, timeout: float = 30.0) -> dict[str, Any] | None:
    """Ask the journal to watch `root` for `task` (a no-op if it already does): the reply is
    the task's watermark, or `{"error": ...}` naming why it cannot; None if nobody answers.
    The first watch walks the workspace, hence the longer timeout."""
    return request(socket_path, {"op": "watch", "task": task, "root": root}, timeout)


def release(socket_path: str, task: str, *, forget: bool = False, timeout: float = 5.0) -> bool:
    """Stop watching the task (`forget`: and drop its sequence state); False if nobody answers."""
    fields = {"op": "release", "task": task, "forget": forget}
    return request(socket_path, fields, timeout) is not None


def ping(socket_path: str, task: str | None = None, timeout: float = 2.0) -> dict[str, Any] | None:
    """`{"ok", "pid", "tasks"}` of the journal answering on `socket_path` (with `task`: also
    that task's `root` and `seq`, `root` None if it is not watched), or None."""
    fields: dict[str, Any] = {"op": "ping"} if task is None else {"op": "ping", "task": task}
    reply = request(socket_path, fields, timeout)
    return reply if reply is not None and reply.get("ok") is True else None


def send_stop(socket_path: str, timeout: float = 5.0) -> bool:
    """Ask the journal on `socket_path` to stop; False if nobody answers. It may still hold its
    lock when this returns: `lifecycle.stop` also waits until the lock is released."""
    return request(socket_path, {"op": "stop"}, timeout) is not None
