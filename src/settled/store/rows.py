"""What every store implementation decodes the same way: rows into records, and sealed facts.

Every load of a session checks its receipt's digest and every load of a close step checks its
fact's, whichever database the bytes came from: one decoder, so no backend can skip the check.
The overlap of two workspaces is decided here for the same reason. Pure: no database, no I/O.
"""

from __future__ import annotations

import json

from settled.canonical import digest_of_canonical
from settled.errors import ReceiptTampered
from settled.receipts import checked
from settled.records import HostRecord, LiveSession, OwnerInfo, SessionRecord, TaskRecord
from settled.store import loads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

RECEIPT_EVENTS: Final = ("receipt", "lose", "recover")

HOST_COLUMNS: Final = "host, name, home, registered_at, vanished_at, vanished_why"
# The order `session_from_row` reads; each backend selects these columns in this order.
SESSION_COLUMNS: Final = (
    "session, task, key, digest, spec, state, generation, owner, boundary, boundary_ref, "
    "command_pid, command_start_time, stdout_durable, stderr_durable, cancel_requested, "
    "created_at, started_at, settled_at, receipt, unknown_why, isolation"
)


def session_from_row(row: tuple[Any, ...]) -> SessionRecord:
    """Every load checks the receipt's digest: no caller can decide from an edited one."""
    owner = loads(row[7])
    receipt = loads(row[18])
    if receipt is not None:
        receipt = checked(receipt, f"the process receipt of session {row[0]}")
    return SessionRecord(
        session=row[0],
        task=row[1],
        key=row[2],
        digest=row[3],
        spec=json.loads(row[4]),
        state=row[5],
        generation=row[6],
        owner=OwnerInfo(**owner) if owner else None,
        boundary=row[8],
        boundary_ref=row[9],
        command_pid=row[10],
        command_start_time=row[11],
        stdout_durable=row[12],
        stderr_durable=row[13],
        cancel_requested=row[14],
        created_at=row[15],
        started_at=row[16],
        settled_at=row[17],
        receipt=receipt,
        unknown_why=row[19],
        isolation=loads(row[20]),
    )


# The order `live_from_row` reads: what recovery's look needs of each live session.
LIVE_COLUMNS: Final = "session, task, state, generation, owner, created_at"


def live_from_row(row: tuple[Any, ...]) -> LiveSession:
    owner = loads(row[4])
    return LiveSession(
        row[0], row[1], row[2], row[3], OwnerInfo(**owner) if owner else None, row[5]
    )


def task_from_row(row: tuple[Any, ...]) -> TaskRecord:
    """(task, key, workspace, state, generation, created_at, user, shared_workspace, host,
    frozen, sandbox, ignore_rules)."""
    user = loads(row[6])
    task, key, workspace, state, generation, created_at = row[:6]
    return TaskRecord(
        task, key, workspace, state, generation, created_at,
        (int(user[0]), int(user[1])) if user is not None else None, bool(row[7]),
        host=row[8], frozen=row[9], sandbox=loads(row[10]),
        ignore_rules=loads(row[11]),
    )  # fmt: skip


def host_from_row(row: tuple[Any, ...]) -> HostRecord:
    """In `HOST_COLUMNS` order."""
    return HostRecord(*row)


def overlap(a: str, b: str) -> bool:
    """Two resolved directories are the same, or one holds the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def fact_digest(text: str) -> str:
    """A fact is stored as its canonical JSON text, so its digest is that of the text's bytes."""
    return digest_of_canonical(text.encode("utf-8"))


def checked_fact(task: str, step: str, text: str, digest: str | None) -> dict[str, Any]:
    """A close step's fact, once its bytes match the digest recorded with them; a receipt it
    carries (the checkpoint's, the close's) is checked as well."""
    actual = fact_digest(text)
    if digest != actual:
        raise ReceiptTampered(f"close step {step!r} of task {task}", digest, actual)
    fact: dict[str, Any] = json.loads(text)
    if isinstance(fact.get("receipt"), dict):
        checked(fact["receipt"], f"the {step} receipt of task {task}")
    return fact
