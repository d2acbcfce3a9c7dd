"""What every store implementation decodes the same way: rows into records, and sealed facts.

Every load of a session checks its receipt's digest and every load of a close step checks its
fact's, whichever database the bytes came from: one decoder, so no backend can skip the check.
Pure: no database, no I/O (the admission and overlap rules are `store/admission.py`'s).
"""

from __future__ import annotations

import json

from settled.canonical import canonical_bytes, digest_of_canonical
from settled.errors import ReceiptTampered
from settled.receipts import checked
from settled.records import HostRecord, LiveSession, OwnerInfo, SessionRecord, TaskRecord
from settled.store import loads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Final

    # A stored list of hidden directories, by its digest: the text, or None if not stored.
    HiddenSetFetch = Callable[[str], str | None]

RECEIPT_EVENTS: Final = ("receipt", "lose", "recover", "unclaimed")

HOST_COLUMNS: Final = "host, name, home, registered_at, vanished_at, vanished_why"
# The order `session_from_row` reads; each backend selects these columns in this order.
SESSION_COLUMNS: Final = (
    "session, task, key, digest, spec, state, generation, owner, boundary, boundary_ref, "
    "command_pid, command_start_time, stdout_durable, stderr_durable, cancel_requested, "
    "created_at, started_at, settled_at, receipt, unknown_why, isolation"
)


def session_from_row(row: tuple[Any, ...], hidden_sets: HiddenSets) -> SessionRecord:
    """Every load checks the receipt's digest: no caller can decide from an edited one. A
    hidden-directory list stored apart (`stored_hidden`) is put back first, so the digest is
    checked over the receipt as its owner sealed it."""
    owner = loads(row[7])
    receipt = loads(row[18])
    if receipt is not None:
        if isinstance(receipt.get("isolation"), dict):
            receipt["isolation"] = hidden_sets.restored(
                receipt["isolation"], f"the process receipt of session {row[0]}"
            )
        receipt = checked(receipt, f"the process receipt of session {row[0]}")
    isolation = loads(row[20])
    if isinstance(isolation, dict):
        isolation = hidden_sets.restored(isolation, f"the isolation of session {row[0]}")
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
        isolation=isolation,
    )


# A list of hidden directories longer than this is stored once, in `hidden_sets` by its
# digest, and the session's row names it. Every command hides every other task's workspace, so
# written inline a home that had hosted 1,000 tasks put ~50 KB of nearly the same list into each
# session's claim and again into its receipt: a store quadratic in the home's age. A short list
# (the home alone, a few neighbours) stays inline: no second read for the common session.
HIDDEN_INLINE_MAX: Final = 16
HiddenSet = tuple[str, str]  # (digest, the list's canonical JSON text)
HIDDEN_SETS_KEPT: Final = 64  # lists a store keeps once checked; each up to tens of KB


def stored_hidden(isolation: dict[str, Any]) -> tuple[dict[str, Any], HiddenSet | None]:
    """`isolation` as a row stores it: a long `hidden.dirs` replaced by `dirs_set` (its digest)
    and `dirs_count`, with the set to store beside it in the same transaction."""
    hidden = isolation.get("hidden")
    dirs = hidden.get("dirs") if isinstance(hidden, dict) else None
    if not isinstance(hidden, dict) or not isinstance(dirs, list):
        return isolation, None
    if len(dirs) <= HIDDEN_INLINE_MAX:
        return isolation, None
    text = canonical_bytes(dirs).decode()
    digest = fact_digest(text)
    rest = {key: value for key, value in hidden.items() if key != "dirs"}
    compact = {**rest, "dirs_set": digest, "dirs_count": len(dirs)}
    return {**isolation, "hidden": compact}, (digest, text)


def stored_receipt(receipt: dict[str, Any]) -> tuple[str, HiddenSet | None]:
    """The receipt's text as its row stores it (`stored_hidden` on its isolation)."""
    isolation = receipt.get("isolation")
    if not isinstance(isolation, dict):
        return canonical_bytes(receipt).decode(), None
    compact, hidden_set = stored_hidden(isolation)
    return canonical_bytes({**receipt, "isolation": compact}).decode(), hidden_set


def stored_isolation(isolation: dict[str, Any]) -> tuple[str, HiddenSet | None]:
    compact, hidden_set = stored_hidden(isolation)
    return canonical_bytes(compact).decode(), hidden_set


class HiddenSets:
    """The lists of hidden directories a store's rows name by digest (`stored_hidden`), each
    checked against its digest once when first read, then kept: every later session of the
    home names the same few, and a check of 1,000 directories costs ~0.2 ms a read."""

    def __init__(
        self, fetch: HiddenSetFetch, kept: dict[str, tuple[str, ...]] | None = None
    ) -> None:
        self._fetch = fetch
        self._kept: dict[str, tuple[str, ...]] = {} if kept is None else kept

    def via(self, fetch: HiddenSetFetch) -> HiddenSets:
        """The same lists, any missing one read by `fetch` (inside a transaction)."""
        return HiddenSets(fetch, self._kept)

    def restored(self, isolation: dict[str, Any], what: str) -> dict[str, Any]:
        """`isolation` with its stored-apart list back in `hidden.dirs`, once the list's bytes
        match the digest that names it; inline lists (and rows written before) pass as they
        are. The receipt's own digest is checked after, over the whole."""
        hidden = isolation.get("hidden")
        if not isinstance(hidden, dict) or "dirs_set" not in hidden:
            return isolation
        digest = hidden["dirs_set"]
        dirs = self._kept.get(digest)
        if dirs is None:
            dirs = self._checked(digest, what)
        if len(dirs) != hidden.get("dirs_count"):
            raise ReceiptTampered(
                f"the hidden directories of {what}",
                f"{hidden.get('dirs_count')} directories",
                f"{len(dirs)} directories",
            )
        rest = {k: v for k, v in hidden.items() if k not in ("dirs_set", "dirs_count")}
        return {**isolation, "hidden": {**rest, "dirs": list(dirs)}}

    def _checked(self, digest: str, what: str) -> tuple[str, ...]:
        text = self._fetch(digest)
        if text is None:
            raise ReceiptTampered(f"the hidden directories of {what}", digest, "nothing stored")
        actual = fact_digest(text)
        if actual != digest:
            raise ReceiptTampered(f"the hidden directories of {what}", digest, actual)
        dirs = tuple(json.loads(text))
        if len(self._kept) >= HIDDEN_SETS_KEPT:
            self._kept.clear()
        self._kept[digest] = dirs
        return dirs


# The order `live_from_row` reads: what recovery's look needs of each live session.
LIVE_COLUMNS: Final = "session, task, state, generation, owner, created_at"


def live_from_row(row: tuple[Any, ...]) -> LiveSession:
    owner = loads(row[4])
    return LiveSession(
        row[0], row[1], row[2], row[3], OwnerInfo(**owner) if owner else None, row[5]
    )


def task_from_row(row: tuple[Any, ...]) -> TaskRecord:
    """(task, key, workspace, state, generation, created_at, user, shared_workspace, host,
    frozen, sandbox, ignore_rules, defaults, workspace_identity)."""
    user = loads(row[6])
    task, key, workspace, state, generation, created_at = row[:6]
    return TaskRecord(
        task, key, workspace, state, generation, created_at,
        (int(user[0]), int(user[1])) if user is not None else None, bool(row[7]),
        host=row[8], frozen=row[9], sandbox=loads(row[10]),
        ignore_rules=loads(row[11]), defaults=loads(row[12]),
        workspace_identity=loads(row[13]),
    )  # fmt: skip


def host_from_row(row: tuple[Any, ...]) -> HostRecord:
    """In `HOST_COLUMNS` order."""
    return HostRecord(*row)


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
