"""Sealing a settled session's logs into the object store, as facts of their own.

The receipt comes first: death, cursors and digests are proven without the object store. Then,
where the home's objects live outside it (`backends.seals_logs`), each stream is published
(`log/seal.py`) and its sealed copy recorded (`Store.record_seal`), which the store refuses
unless its length and digest are the receipt's: no log, hostile or changed, can make a sealed
copy that disagrees with the receipt. A seal that fails is tried again: by the owner after its
receipt (`seal_with_retries`, bounded backoff within `SETTLED_SEAL_RETRY_S`), by recovery after a
recovered receipt, and by the close before it publishes (`CloseSeals`, which names each stream
left unsealed). Every attempt is idempotent: the objects are content-addressed and the first
recorded seal stands.

Must never: seal a stream past its receipt's cursor, seal a session that has no receipt, or let
a failed seal cost (or change) a receipt.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Final

from settled.backends import seals_logs
from settled.home import log_path
from settled.receipts import STREAMS, seal_failure, sealed_copy
from settled.records import SessionRecord
from settled.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    from settled.objects import ObjectStore

SEAL_BOUND_ENV: Final = "SETTLED_SEAL_RETRY_S"
DEFAULT_SEAL_BOUND_S: Final = 300.0
FIRST_PAUSE_S: Final = 0.5
LONGEST_PAUSE_S: Final = 10.0
NOT_HERE: Final = "its log is not in this home"


def seal_bound() -> float:
    """How long an owner goes on trying to seal its logs after its receipt."""
    return float(os.environ.get(SEAL_BOUND_ENV) or DEFAULT_SEAL_BOUND_S)


def seal_session(
    home: str, store: Store, objects: ObjectStore, record: SessionRecord
) -> dict[str, str]:
    """Seal each stream of the settled `record` not sealed yet, from this home's logs; why each
    stream still unsealed is (empty: every stream has its sealed copy). Stops at the first
    stream the object store cannot take: the others would wait on it as long."""
    receipt = record.receipt
    if receipt is None:
        return {stream: "the session has no receipt yet" for stream in STREAMS}
    recorded = store.log_seals(record.task, record.session).get(record.session, {})
    failures: dict[str, str] = {}
    for stream in STREAMS:
        if sealed_copy(receipt, recorded, stream) is not None:
            continue
        if failures:  # the object store failed this session already: the same reason
            failures[stream] = next(iter(failures.values()))
            continue
        failure = _seal_one(home, store, objects, record, stream)
        if failure is not None:
            failures[stream] = failure
    return failures


def _seal_one(
    home: str, store: Store, objects: ObjectStore, record: SessionRecord, stream: str
) -> str | None:
    from settled.log.seal import seal_stream  # after death: off the launch path

    fact = (record.receipt or {}).get("output", {}).get(stream) or {}
    if "digest" not in fact or "cursor" not in fact:
        return "its receipt names no digest of the stream"
    path = log_path(home, record.session, stream)
    if fact["cursor"] and not os.path.exists(path):
        return NOT_HERE
    started = time.monotonic()
    try:
        sealed = seal_stream(objects, path, int(fact["cursor"]), str(fact["digest"]))
        if stream == "stdout" and _both_wrote(record.receipt):  # their order, for elsewhere
            sealed.update(_sealed_index(objects, os.path.dirname(path)))
        store.record_seal(
            record.session,
            stream,
            {
                **sealed,
                "length": fact["cursor"],
                "digest": fact["digest"],
                "seal_s": round(time.monotonic() - started, 6),
            },
        )
    except BaseException as exc:  # never the receipt's cost: a library's panic is named too
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return f"{type(exc).__name__}: {exc}"
    return None


def _both_wrote(receipt: dict[str, Any] | None) -> bool:
    """Whether the merged view has an order to keep: both streams stored bytes."""
    output = (receipt or {}).get("output", {})
    return all((output.get(stream) or {}).get("cursor") for stream in STREAMS)


def _sealed_index(objects: ObjectStore, log_dir: str) -> dict[str, str]:
    """The session's interleave index as one object (`{"index": name}`), or nothing for a
    session without one. Not covered by the receipt, and need not be: the merged view trusts
    its records only while they are contiguous and within the receipt's cursors, so a wrong
    index could only unorder bytes the receipt's digests cover, never serve another."""
    from settled.log.interleave import index_path

    try:
        with open(index_path(log_dir), "rb") as index:
            return {"index": objects.put_stream(index)}
    except FileNotFoundError:
        return {}


def seal_with_retries(
    attempt: Callable[[], dict[str, str]],
    bound_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """`attempt()` until it leaves nothing unsealed, with doubling pauses (0.5 s to 10 s), no
    new attempt started past `bound_s`; what the last attempt left unsealed."""
    give_up = time.monotonic() + bound_s
    pause = FIRST_PAUSE_S
    while True:
        failures = attempt()
        if not failures or time.monotonic() + pause > give_up:
            return failures
        sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE_S)


class CloseSeals:
    """The close's retry of every seal its task's settled sessions still lack (their logs are
    on this host: a task closes only on its own), before it publishes; it names each stream
    left unsealed with why. Nothing to do where the home's objects live inside it."""

    def __init__(self, home: str, store: Store, objects: Callable[[], ObjectStore]) -> None:
        self.home, self.store, self.objects = home, store, objects

    def __call__(self, sessions: list[SessionRecord]) -> list[dict[str, Any]]:
        if not seals_logs(self.home):
            return []
        unsealed: list[dict[str, Any]] = []
        away: str | None = None  # why the object store could not be reached, once it could not
        for record in sessions:
            if record.receipt is None:
                continue
            if away is not None:  # one unreachable store is not asked again per session
                failures = {s: away for s in self._unsealed(record)}
            else:
                failures = seal_session(self.home, self.store, self.objects(), record)
                away = unreachable(failures)
            for stream, why in failures.items():
                first = seal_failure(record.receipt, stream)  # an older receipt's own words
                why = f"{why} (its owner's seal failed first: {first})" if first else why
                unsealed.append({"session": record.session, "stream": stream, "why": why})
        return unsealed

    def _unsealed(self, record: SessionRecord) -> list[str]:
        recorded = self.store.log_seals(record.task, record.session).get(record.session, {})
        return [s for s in STREAMS if sealed_copy(record.receipt, recorded, s) is None]


def unreachable(failures: dict[str, str]) -> str | None:
    """The failure that says the object store could not be reached, if one does."""
    for why in failures.values():
        if why.startswith("ObjectStoreUnreachable"):
            return why
    return None
