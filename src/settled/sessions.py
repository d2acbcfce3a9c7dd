"""A session as its readers see it: the record, its owner's liveness, a wait, a cancel request.

The close join, recovery and the Runtime share this one view, so "is the owner there", "has
it a receipt" and "ask it to stop" have one answer each. It decides nothing (status is the
projection in `status.py`, states change only in the store) and touches no process itself:
liveness comes from a `Liveness` (for owners on this host, `owner.liveness.LocalOwners`).
A wait that meets a session whose owner is gone, or that no owner claimed, has it recovered
through the `recover` it was given (recovery.py `recover_lost`), so it ends on a receipt, or
on the unknown recovery could not end, never on a person's `settled recover`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

from settled.errors import NotSettled, SettledError
from settled.records import LiveSession, OwnerFacts, OwnerInfo, SessionRecord
from settled.states import ADMITTED, SETTLED, UNKNOWN
from settled.status import session_status
from settled.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol, TypeAlias

    LastWords: TypeAlias = Callable[[str], dict[str, Any] | None]  # session -> its last words
    # (session, lapsed_lease, closing) -> what recovery did (recovery.py `recover_lost`)
    RecoverLost: TypeAlias = Callable[[str, bool, bool], object]
else:
    Protocol = object  # a protocol is the type checker's; at run time a plain base

WAKE_BOUND_S = 1.0  # the longest an evented sleep lasts: for changes no event announces
POLL_S = 0.05  # the sleep where nothing can wake it (no owner here to watch, no log watch)
# A log watch is an inotify instance, and closing one waits for an RCU grace period when its
# mark is fresh: 0.1 ms at best, 8-20 ms often (measured here), more than a short command's
# whole life through `settled run`. So a follower arms it only once the session has outlived
# ARM_AFTER_S; until then the owner's exit still wakes it at once, and new bytes are looked
# for every EARLY_LOOK_S.
ARM_AFTER_S = 0.05
EARLY_LOOK_S = 0.005


class Liveness(Protocol):
    """Whether a recorded owner is alive, a handle to wait on its exit, and a way to wake it."""

    def facts(self, owner: OwnerInfo, now: float | None = None) -> OwnerFacts: ...

    def facts_many(self, owners: Sequence[OwnerInfo], now: float | None = None) -> list[OwnerFacts]:
        """`facts` of each, as it would answer them one by one (recovery looks at them all)."""
        ...

    def exit_handle(self, owner: OwnerInfo) -> int | None: ...

    def await_exit(self, handle: int | None, seconds: float, also: int | None = None) -> bool:
        """Sleep up to `seconds`, waking when the owner exits or `also` (an fd) is readable;
        whether the owner has exited."""
        ...

    def close_handle(self, handle: int) -> None: ...

    def ask_to_cancel(self, owner: OwnerInfo) -> None: ...


class Wake(Protocol):
    """What else may end a follower's pause: a descriptor readable when the session's log
    changes (log/watch.py `LogWatch`)."""

    def arm(self) -> tuple[int | None, bool]:
        """(the descriptor to poll, or None when nothing is watched; whether the watch was
        set up by this call, so that changes before it were missed)."""
        ...

    def clear(self) -> None: ...


class SessionWatch:
    def __init__(
        self,
        store: Store,
        liveness: Liveness,
        last_words: LastWords | None = None,
        recover: RecoverLost | None = None,
    ) -> None:
        """`last_words` reads what an owner that ended without a receipt recorded (why it
        could not write one): an unknown session's status shows it as `reason`. `recover`
        recovers a session whose owner is gone (none: a waiter only reads)."""
        self.store, self.liveness = store, liveness
        self._last_words = last_words
        self._recover = recover

    def recover_lost(
        self, session: str, *, lapsed_lease: bool = False, closing: bool = False
    ) -> str | None:
        """Have the session recovered now if its owner is gone, or settled never started if no
        owner claimed it (recovery.py `recover_lost` decides, and leaves a live owner alone).
        Why that could not run (the store or the disk refused it), else None: it never raises,
        and the session is then as it was (unknown, its status says)."""
        if self._recover is None:
            return None
        try:
            self._recover(session, lapsed_lease, closing)
        except (SettledError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def owner_facts(self, record: SessionRecord) -> OwnerFacts | None:
        return None if record.owner is None else self.liveness.facts(record.owner)

    def owners_facts(
        self, records: Sequence[SessionRecord | LiveSession]
    ) -> list[OwnerFacts | None]:
        """`owner_facts` of each record, from one look at all their owners."""
        owners = [record.owner for record in records if record.owner is not None]
        looked = iter(self.liveness.facts_many(owners))
        return [None if record.owner is None else next(looked) for record in records]

    def status(self, session: str) -> dict[str, Any]:
        return self.status_of(self.store.get_session(session))

    def status_of(self, record: SessionRecord) -> dict[str, Any]:
        """The status of a record just read (an admission's): read again only where its owner
        is gone, as `status` does."""
        session = record.session
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
        A session whose owner's process is gone is recovered here first (`recover_lost`), and
        one no owner claimed within the claim bound is settled never started: the wait ends
        on that receipt, or on the unknown recovery found no evidence to end (with
        `recovery_failed` when recovery itself could not run).

        Sleeps on the owner's exit handle (it writes the receipt just before it exits), so a
        waiter wakes at once and otherwise looks only every `WAKE_BOUND_S`. Without one (no
        owner yet, or an owner on another host) it sleeps in `Store.await_change`, which a
        store with notifications ends at the session's next change; the poll remains for
        everything else.
        """
        give_up = None if timeout is None else time.monotonic() + timeout
        recovered, unclaimed_look = False, 0.0
        with self.pauses(session) as sleep:
            while True:
                view = self.status(session)
                if view["state"] == SETTLED and "receipt" in view:
                    return view
                if view["state"] == UNKNOWN and not self._owner_still_runs(session):
                    if recovered:  # a stale lease alone is recovery's business, not a waiter's
                        return view
                    recovered = True  # its owner is gone: recovered here, once
                    failed = self.recover_lost(session)
                    if failed is not None:
                        return {**self.status(session), "recovery_failed": failed}
                    continue
                now = time.monotonic()
                unclaimed = view["state"] == ADMITTED and view["owner"] is None
                if unclaimed and now - unclaimed_look >= WAKE_BOUND_S:  # past the claim bound:
                    unclaimed_look = now  # settled never started (looked at once a second)
                    self.recover_lost(session)
                    continue
                if give_up is not None and now >= give_up:
                    raise NotSettled(
                        f"session {session} is still {view['state']} after {timeout} s; it goes "
                        f"on (wait again, or read its output with `settled logs {session} "
                        "--follow`)"
                    )
                sleep(WAKE_BOUND_S if give_up is None else min(WAKE_BOUND_S, give_up - now))

    @contextlib.contextmanager
    def pauses(self, session: str, wake: Wake | None = None) -> Iterator[Callable[[float], None]]:
        """A sleep for a waiter or a follower of the session, `pause(seconds)`: it ends when
        the owner exits (the receipt is recorded just before) or, given a `wake` (the log's
        watch), when the log changes, and after `seconds` at most. Where nothing can wake it
        (no owner here to watch: none yet, one on another host, or one gone; or a log that
        cannot be watched) it sleeps `POLL_S` at most, in `Store.await_change` when there is
        no owner: a follower of a lost owner polls, it never spins."""
        pause = _Pause(self, session, wake)
        try:
            yield pause
        finally:
            pause.close()

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
        """Whether a waiter keeps waiting: a live session's owner process runs, or an unknown
        session's owner is alive by its local beat (cut off from the store, it comes back
        with its receipt unless recovery takes the session over: states.py)."""
        record = self.store.get_session(session)
        facts = self.owner_facts(record)
        if record.state == UNKNOWN:
            return facts is not None and facts.alive and record.receipt is None
        return record.live and facts is not None and facts.process_alive


class _Pause:
    """One follower's or waiter's sleep (`SessionWatch.pauses`): the owner's exit handle,
    taken once an owner is recorded, and the log's watch, polled together."""

    def __init__(self, watch: SessionWatch, session: str, wake: Wake | None) -> None:
        self._store, self._liveness = watch.store, watch.liveness
        self._session, self._wake = session, wake
        self._handle: int | None = None
        self._exited = False
        self._arm_at = time.monotonic() + ARM_AFTER_S

    def __call__(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if self._handle is None and not self._exited:  # until an owner is recorded here
            owner = self._store.get_session(self._session).owner
            self._handle = None if owner is None else self._liveness.exit_handle(owner)
        if self._handle is None:  # no owner here to watch: the store says when it changes
            self._store.await_change((self._session,), min(seconds, POLL_S))
            return
        if self._wake is None:
            exited = self._liveness.await_exit(self._handle, seconds)
        elif time.monotonic() < self._arm_at:  # young: the exit wakes it, bytes are looked for
            exited = self._liveness.await_exit(self._handle, min(seconds, EARLY_LOOK_S))
        else:
            fd, fresh = self._wake.arm()
            if fresh:
                return  # the watch starts now: the caller looks again before sleeping on it
            if fd is None:  # the log cannot be watched (yet): poll it
                exited = self._liveness.await_exit(self._handle, min(seconds, POLL_S))
            else:
                exited = self._liveness.await_exit(self._handle, seconds, fd)
                self._wake.clear()  # before the caller looks: a later byte wakes the next pause
        if exited:
            self._liveness.close_handle(self._handle)
            self._handle, self._exited = None, True

    def close(self) -> None:
        if self._handle is not None:
            self._liveness.close_handle(self._handle)
            self._handle = None
