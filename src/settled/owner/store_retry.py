"""How an owner waits out its store: one retry policy for every store call an owner makes.

An owner outlives a store outage (a PostgreSQL restart, a killed or stopped server) within its
deadline: a call that meets StoreUnreachable is made again after a pause that starts at
FIRST_DELAY_S and doubles up to CAP_DELAY_S, each time on a fresh connection (the PostgreSQL
store drops a connection that failed: store/postgres.py), until it succeeds or the call's
patience is spent. The patience of the receipt is the owner's store patience
(SETTLED_OWNER_STORE_PATIENCE_S, default DEFAULT_PATIENCE_S); a renewal's is a fraction of a
heartbeat period, since the next beat tries again.

Only StoreUnreachable is retried: nothing was recorded by the call that met it, or, if the
connection was lost after its COMMIT was sent, the caller reads the outcome back (session.py).
A refused write (StaleWrite) or a refusing disk (StorageFailed) is an answer, not an outage.

`next_delay` and `gives_up` are pure (tests/test_store_retry.py hands them numbers), and so
are the read-backs of a retried write refused as stale (`receipt_recorded`, `settling_outcome`:
handed records); `with_retries` is the loop over them. Must never: sleep past the patience,
retry a StaleWrite, or run on the owner's supervise loop (a renewal retries on the lease
keeper's thread).
"""

from __future__ import annotations

import os
import time

from settled.errors import StoreUnreachable
from settled.states import SETTLED, SETTLING

TYPE_CHECKING = False  # loaded by every fresh owner with its session: no typing at run time
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    from settled.records import SessionRecord

    T = TypeVar("T")

FIRST_DELAY_S = 0.05
CAP_DELAY_S = 1.0
PATIENCE_ENV = "SETTLED_OWNER_STORE_PATIENCE_S"
DEFAULT_PATIENCE_S = 300.0  # a PostgreSQL failover or restart takes seconds to a minute


def patience_s() -> float:
    """How long an owner waits for its store to come back before it gives up on its receipt."""
    text = os.environ.get(PATIENCE_ENV)
    return float(text) if text else DEFAULT_PATIENCE_S


def next_delay(attempt: int) -> float:
    """The pause before retry number `attempt` (0: the first retry): doubling, capped."""
    return min(CAP_DELAY_S, FIRST_DELAY_S * float(2 ** min(attempt, 32)))


def gives_up(waited: float, delay: float, patience: float) -> bool:
    """Whether a call that has waited `waited` s stops instead of pausing `delay` s more: a
    retry is made only if it starts within the patience."""
    return waited + delay > patience


def with_retries(
    call: Callable[[], T],
    patience: float,
    *,
    between: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[T, int]:
    """`call()` until it does not raise StoreUnreachable, or the last StoreUnreachable once the
    patience is spent; (its result, how many attempts failed before it). `between` runs before
    each pause (the owner asks for a lease renewal there)."""
    started = clock()
    attempt = 0
    while True:
        try:
            return call(), attempt
        except StoreUnreachable:
            delay = next_delay(attempt)
            if gives_up(clock() - started, delay, patience):
                raise
        if between is not None:
            between()
        sleep(delay)
        attempt += 1


def receipt_recorded(found: SessionRecord, generation: int, digest: str) -> bool:
    """Whether a receipt write refused as stale had in fact been made by an earlier attempt of
    the same owner (its answer lost with the connection): this receipt, at its generation."""
    recorded = found.receipt or {}
    return found.generation == generation and recorded.get("digest") == digest


def settling_outcome(found: SessionRecord, generation: int) -> str:
    """What a `settling` write refused as stale means: "done" (settling or settled at the
    owner's generation: an earlier attempt, or its receipt, came first), "fenced" (recovery
    took it over: another generation), else "wait" (unknown at its generation: its next
    renewal revives it, and `settling` is asked again)."""
    if found.generation != generation:
        return "fenced"
    return "done" if found.state in (SETTLING, SETTLED) else "wait"
