"""A session as its readers see it: the record, its owner's liveness, a wait, a cancel request.

The close join, recovery and the Runtime share this one view, so "is the owner there", "has
it a receipt" and "ask it to stop" have one answer each. It decides nothing (status is the
projection in `status.py`, states change only in the store) and touches no process itself:
liveness comes from a `Liveness` (for owners on this host, `owner.liveness.LocalOwners`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from settled.errors import NotSettled
from settled.records import OwnerFacts, OwnerInfo, SessionRecord
from settled.states import SETTLED, UNKNOWN
from settled.status import session_status
from settled.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol, TypeAlias

    LastWords: TypeAlias = Callable[[str], dict[str, Any] | None]  # session -> its last words
else:
    Protocol = object  # a protocol is the type checker's; at run time a plain base

FIRST_PAUSE_S = 0.002
LONGEST_PAUSE_S = 0.05


class Liveness(Protocol):
    """Whether a recorded owner is alive, a handle to wait on its exit, and a way to wake it."""

    def facts(self, owner: OwnerInfo, now: float | None = None) -> OwnerFacts: ...

    def exit_handle(self, owner: OwnerInfo) -> int | None: ...

    def await_exit(self, handle: int | None, seconds: float) -> bool: ...

    def close_handle(self, handle: int) -> None: ...

    def ask_to_cancel(self, owner: OwnerInfo) -> None: ...


class SessionWatch:
    def __init__(
        self, store: Store, liveness: Liveness, last_words: LastWords | None = None
    ) -> None:
        """`last_words` reads what an owner that ended without a receipt recorded (why it
        could not write one): an unknown session's status shows it as `reason`."""
        self.store, self.liveness = store, liveness
        self._last_words = last_words

    def owner_facts(self, record: SessionRecord) -> OwnerFacts | None:
        return None if record.owner is None else self.liveness.facts(record.owner)

    def status(self, session: str) -> dict[str, Any]:
        record = self.store.get_session(session)
        facts = self.owner_facts(record)
        if facts is not None and not facts.alive and record.live:
            # The owner writes its receipt before it exits: one that settled and exited between
            # the two reads above is settled, not unknown. Read the record again to see.
            record = self.store.get_session(session)
        view = session_status(record, facts)
        if view["state"] == UNKNOWN and self._last_words is not None:
            words = self._last_words(session)
            if words is not None:
                view["reason"] = words["reason"]
        return view

    def wait(self, session: str, timeout: float | None = None) -> dict[str, Any]:
        """Block until the session has a receipt (or is unknown); the session's clock, not ours.

        Sleeps on the owner's exit handle (it writes the receipt just before it exits), so a
        waiter wakes at once instead of on its next poll. Without one (no owner yet, or an
        owner on another host) it sleeps in `Store.await_change`, which a store with
        notifications ends at the session's next change; the poll remains for everything else.
        """
        give_up = None if timeout is None else time.monotonic() + timeout
        pause = FIRST_PAUSE_S
        with self.pauses(session) as sleep:
            while True:
                view = self.status(session)
                if view["state"] == SETTLED and "receipt" in view:
                    return view
                if view["state"] == UNKNOWN and not self._owner_still_runs(session):
                    return view  # a stale lease alone is recovery's business, not a waiter's
                now = time.monotonic()
                if give_up is not None and now >= give_up:
                    raise NotSettled(
                        f"session {session} is still {view['state']} after {timeout} s; it goes "
                        f"on (wait again, or read its output with `settled logs {session} "
                        "--follow`)"
                    )
                sleep(pause if give_up is None else min(pause, max(0.0, give_up - now)))
                pause = min(pause * 1.5, LONGEST_PAUSE_S)

    @contextlib.contextmanager
    def pauses(self, session: str) -> Iterator[Callable[[float], None]]:
        """A sleep for a waiter or a follower of the session that wakes at once when its owner
        exits (the receipt is recorded just before), so the end of a short command is seen
        then and not at the next poll. Without an owner here to watch (none yet, or one on
        another host), and once the owner is gone, it sleeps in `Store.await_change`: a
        follower of a lost owner polls, it never spins."""
        handle: int | None = None
        exited = False

        def pause(seconds: float) -> None:
            nonlocal handle, exited
            if handle is None and not exited:  # until an owner is recorded here to watch
                owner = self.store.get_session(session).owner
                handle = None if owner is None else self.liveness.exit_handle(owner)
            if handle is None:  # no owner here to watch: the store says when it changes
                self.store.await_change((session,), seconds)
            elif self.liveness.await_exit(handle, seconds):
                self.liveness.close_handle(handle)
                handle, exited = None, True

        try:
            yield pause
        finally:
            if handle is not None:
                self.liveness.close_handle(handle)

    def exit_handle(self, session: str) -> int | None:
        """A handle (a pidfd) that becomes readable when the live session's owner exits, for a
        waiter with an event loop of its own; None when no owner of this host is there to
        watch (none yet, gone, another host's, or the session is no longer live). The caller
        closes it (`Liveness.close_handle`)."""
        record = self.store.get_session(session)
        if record.owner is None or not record.live:
            return None
        return self.liveness.exit_handle(record.owner)

    def settles_within(self, session: str, seconds: float) -> bool:
        """Whether the session left its owner's hands (settled or unknown) within `seconds`."""
        try:
            self.wait(session, timeout=max(0.0, seconds))
        except NotSettled:
            return False
        return not self.store.get_session(session).live

    def cancel(self, session: str, reason: str) -> dict[str, Any]:
        """Record the request, then wake the owner (it stops the session: TERM, grace, KILL
        over the whole boundary). An owner that is gone is recovery's, not ours."""
        record = self.store.request_cancel(session, reason)
        facts = self.owner_facts(record)
        if record.owner is not None and facts is not None and facts.alive:
            self.liveness.ask_to_cancel(record.owner)
        return self.status(session)

    def _owner_still_runs(self, session: str) -> bool:
        record = self.store.get_session(session)
        if not record.live:
            return False
        facts = self.owner_facts(record)
        return facts is not None and facts.process_alive
