"""The soak's invariants, checked against what settled recorded and what is on disk.

Owns: `Observed` (what a lane saw before recovery: the highest durable cursor of each stream,
the owner of each session it saw unknown, the bytes each command prints) and the checks that
raise `Violation`: a settled session has a sealed receipt with proven death and a log whose
bytes are what its command printed up to the final cursor, never below a durable cursor once
published; every logical command launched at most once; a session once unknown settled by
recovery from the owner it lost; a complete close covers every session and a checkpoint that
reads back, verifies and restores to exactly the workspace.

Must never: trust what it checks (every receipt's seal is recomputed, every byte re-read and
re-hashed, the checkpoint restored and compared), change anything it checks, or read a stream
through anything but the Runtime's `StreamLog`.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import blake3

from settled.canonical import digest_of
from settled.errors import AdmissionSealed
from settled.runtime import Runtime
from settled.soak import procs
from settled.soak.plan import LAUNCHES, Violation, ticker_bytes

READ_CHUNK = 1 << 20


class Observed:
    """What a lane saw of its sessions; checks compare the final facts against it."""

    def __init__(self) -> None:
        self.durable: dict[str, int] = {}  # session -> highest stdout durable cursor seen
        self.lost_owner: dict[str, int] = {}  # session -> pid of the owner it was unknown without
        self.expected: dict[str, bytes | None] = {}  # session -> its stdout (None: ticks)
        self.files: dict[str, tuple[str, bytes]] = {}  # session -> the file it writes at exit
        self.logical: dict[str, str] = {}  # session -> the key its command logs in LAUNCHES

    def expect(self, session: str, key: str, stdout: bytes | None, file: Any = None) -> None:
        self.expected[session], self.logical[session] = stdout, key
        if file is not None:
            self.files[session] = file

    def printed(self, session: str, length: int) -> bytes:
        expected = self.expected.get(session)
        return ticker_bytes(length) if expected is None else expected[:length]


def read_log(rt: Runtime, session: str, end: int, stream: str = "stdout") -> bytes:
    """Bytes [0, end) of the stream as stored (fewer if the file is shorter)."""
    log, parts, cursor = rt.stream_log(session, stream), [], 0
    while cursor < end:
        data, _stored = log.read_at(cursor, min(READ_CHUNK, end - cursor))
        if not data:
            break
        parts.append(data)
        cursor += len(data)
    return b"".join(parts)


def observe(rt: Runtime, seen: Observed, session: str) -> None:
    """Record the session's durable cursor now, after checking every byte below it."""
    record = rt.session_record(session)
    durable = record.stdout_durable
    data = read_log(rt, session, durable)
    if len(data) < durable:
        raise Violation(
            "lost_byte",
            f"session {session} published durable cursor {durable} but its log holds "
            f"{len(data)} bytes",
        )
    if data != seen.printed(session, durable):
        raise Violation(
            "lost_byte",
            f"session {session}: bytes below durable cursor {durable} "
            "are not what its command printed",
        )
    seen.durable[session] = max(seen.durable.get(session, 0), durable)
    status = rt.session_status(session)
    if status["state"] == "unknown" and record.owner is not None:
        seen.lost_owner.setdefault(session, record.owner.pid)


def sealed(receipt: dict[str, Any], what: str) -> None:
    body = {k: v for k, v in receipt.items() if k != "digest"}
    if receipt.get("digest") != digest_of(body):
        raise Violation("false_success", f"{what}: its digest does not match its bytes")


def settled_session(rt: Runtime, seen: Observed, session: str) -> dict[str, Any]:
    """The session's receipt, once every invariant of a settled session holds."""
    record = rt.session_record(session)
    if record.state != "settled" or record.receipt is None:
        raise Violation(
            "converges", f"session {session} is {record.state} after its retry and recovery"
        )
    receipt = record.receipt
    sealed(receipt, f"the receipt of session {session}")
    if receipt["death"].get("proven") is not True:
        raise Violation(
            "false_success", f"session {session} settled without death evidence: {receipt['death']}"
        )
    lost = seen.lost_owner.get(session)
    if lost is not None:
        owner = receipt.get("owner") or {}
        if owner.get("role") != "recovery" or (owner.get("lost_owner") or {}).get("pid") != lost:
            raise Violation(
                "relaunch",
                f"session {session} was unknown without owner {lost}, "
                f"yet its receipt is by {owner}",
            )
    _output(rt, seen, session, receipt)
    running = procs.carrying(procs.KEY_ENV, seen.logical.get(session, ""))
    if running:
        raise Violation(
            "false_success",
            f"session {session} settled with proven death, yet process(es) {running} of its "
            "command still run",
        )
    return receipt


def _output(rt: Runtime, seen: Observed, session: str, receipt: dict[str, Any]) -> None:
    for stream in ("stdout", "stderr"):
        fact = receipt["output"][stream]
        cursor = int(fact["cursor"])
        data = read_log(rt, session, cursor, stream)
        if len(data) < cursor:
            raise Violation(
                "lost_byte",
                f"session {session} {stream}: final cursor {cursor} "
                f"but the log holds {len(data)} bytes",
            )
        if "blake3:" + blake3.blake3(data).hexdigest() != fact["digest"]:
            raise Violation(
                "lost_byte",
                f"session {session} {stream}: the log's bytes below "
                f"cursor {cursor} do not match the receipt's digest",
            )
        printed = seen.printed(session, cursor) if stream == "stdout" else b""
        if data != printed:
            raise Violation(
                "lost_byte",
                f"session {session} {stream}: the bytes below cursor "
                f"{cursor} are not what its command printed",
            )
    cursor = int(receipt["output"]["stdout"]["cursor"])
    if cursor < seen.durable.get(session, 0):
        raise Violation(
            "lost_byte",
            f"session {session}: final cursor {cursor} is below the "
            f"durable cursor {seen.durable[session]} it published",
        )
    expected = seen.expected.get(session)
    whole = receipt["exit"].get("reason") == "exited" and receipt["output"]["drain"] == "complete"
    if whole and expected is not None and cursor != len(expected):
        raise Violation(
            "lost_byte",
            f"session {session} exited and drained {cursor} of the "
            f"{len(expected)} bytes its command printed",
        )


def launches(workspace: str) -> collections.Counter[str]:
    try:
        with open(os.path.join(workspace, LAUNCHES), encoding="utf-8") as handle:
            return collections.Counter(line.strip() for line in handle if line.strip())
    except FileNotFoundError:
        return collections.Counter()


def launched_once(rt: Runtime, seen: Observed, workspace: str, sessions: list[str]) -> None:
    """No logical command ran twice; each that exited ran exactly once; one that never
    started never ran."""
    counts = launches(workspace)
    twice = sorted(key for key, n in counts.items() if n > 1)
    if twice:
        raise Violation(
            "duplicate_launch",
            "launched more than once: " + ", ".join(f"{key} x{counts[key]}" for key in twice),
        )
    for session in sessions:
        receipt = rt.session_record(session).receipt or {}
        reason = (receipt.get("exit") or {}).get("reason")
        key = seen.logical.get(session)
        if key is None:
            continue
        if reason == "exited" and counts[key] != 1:
            raise Violation(
                "false_success",
                f"session {session} ({key}) has an exit status "
                "but its command never logged its launch",
            )
        if reason == "not_started" and counts[key] != 0:
            raise Violation(
                "false_success", f"session {session} ({key}) says not_started but its command ran"
            )


def closed_task(
    rt: Runtime, seen: Observed, task: str, workspace: str, receipt: dict[str, Any], scratch: str
) -> None:
    """A complete close is no false success: it covers every session of the task, each settled
    with proven death, and a checkpoint that reads back, verifies and restores to exactly the
    workspace (with every file a command wrote before it exited); admission stays sealed."""
    sealed(receipt, f"the close receipt of task {task}")
    if receipt["outcome"].get("complete") is not True:
        raise Violation("close_converges", f"task {task}: the close is not complete")
    sessions = [view["session"] for view in rt.task_status(task)["sessions"]]
    named = {entry["session"]: entry["receipt"] for entry in receipt["sessions"]}
    if set(named) != set(sessions):
        raise Violation(
            "false_success",
            f"task {task}: the close receipt names "
            f"{sorted(named)} but the task has {sorted(sessions)}",
        )
    for session in sessions:
        if settled_session(rt, seen, session)["digest"] != named[session]:
            raise Violation(
                "false_success",
                f"task {task}: the close names another receipt "
                f"for session {session} than the one stored",
            )
    launched_once(rt, seen, workspace, sessions)
    seqs = [
        entry["terminal_mutation"]["seq"]
        for entry in receipt["sessions"]
        if isinstance(entry["terminal_mutation"].get("seq"), int)
    ]
    checkpoint = receipt["checkpoint"]
    if seqs and checkpoint["watermark"] < max(seqs):
        raise Violation(
            "false_success",
            f"task {task}: checkpoint watermark "
            f"{checkpoint['watermark']} is below a terminal mutation {max(seqs)}",
        )
    restored = checkpoint_restores(rt, task, workspace, checkpoint, scratch)
    for session in sessions:
        exit_fact = (rt.session_record(session).receipt or {}).get("exit") or {}
        if session in seen.files and exit_fact.get("code") == 0:
            name, content = seen.files[session]
            if restored.get(name) != ("file", content):
                raise Violation(
                    "false_success",
                    f"task {task}: session {session} exited 0 "
                    f"after writing {name}, which its close's checkpoint lacks",
                )
    try:
        rt.exec(task, shell=f"echo late >> {LAUNCHES}", key=f"after-close-{task}")
    except AdmissionSealed:
        return
    raise Violation("false_success", f"task {task} admitted a command after its close")


def checkpoint_restores(
    rt: Runtime, task: str, workspace: str, checkpoint: dict[str, Any], scratch: str
) -> Tree:
    """A checkpoint receipt is no false success: sealed, read back by its exact id, verified
    again now, and restoring to exactly the workspace (quiet: nothing of the task runs that
    writes it). Returns the restored tree."""
    sealed(checkpoint, f"the checkpoint receipt of task {task}")
    read_back = checkpoint["read_back"]
    if not read_back_holds(read_back) or read_back.get("id") != checkpoint["manifest"]:
        raise Violation(
            "false_success", f"task {task}: its checkpoint was not read back verified: {read_back}"
        )
    verified = rt.verify(checkpoint["manifest"])
    if verified.get("verified") is not True or verified.get("problems"):
        raise Violation(
            "false_success",
            f"task {task}: checkpoint {checkpoint['manifest']} "
            f"does not verify: {verified.get('problems')}",
        )
    destination = os.path.join(scratch, f"restored-{task}")
    rt.restore(checkpoint["manifest"], destination)
    try:
        restored = tree(destination)
    finally:
        _remove(destination)
    here = tree(workspace)
    if here != restored:
        differ = sorted(k for k in here.keys() | restored.keys() if here.get(k) != restored.get(k))
        raise Violation(
            "false_success",
            f"task {task}: checkpoint {checkpoint['manifest']} "
            f"restores another tree than its workspace, at {differ[:5]}",
        )
    return restored


def read_back_holds(read_back: dict[str, Any]) -> bool:
    """Verified, or an incremental read-back that found nothing wrong and says what it trusted
    from its parent (workspace/readback.py: a reused subtree makes it not `verified` by design,
    issue 36); either way the whole manifest is verified again below."""
    if read_back.get("verified") is True:
        return True
    return (
        read_back.get("scope") == "since_parent"
        and read_back.get("problems_found") == 0
        and bool(read_back.get("trusted_from"))
        and bool(read_back.get("unchecked"))
    )


Tree = dict[str, tuple[str, bytes]]


def tree(root: str) -> Tree:
    """Every entry under `root`: a file's bytes, a link's target, a directory."""
    found: Tree = {}
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                found[rel] = ("link", os.fsencode(os.readlink(path)))
            elif os.path.isdir(path):
                found[rel] = ("dir", b"")
            else:
                with open(path, "rb") as handle:
                    found[rel] = ("file", handle.read())
    return found


def _remove(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
