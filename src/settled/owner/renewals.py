"""What the lease keeper's thread writes for a running owner: the renewal, then the writes the
supervise loop asked for (the run's record, `settling`), each through a store outage.

The loop never waits on the store: it only asks (lease.py), and this module's `renew` runs in
the keeper's thread on a store connection of its own, opened at the first renewal that reaches
the store (a SQLite connection serves one thread). A renewal that meets an outage or a refusing
disk fails that beat (store_retry.py, within half a heartbeat period) and the next beat tries
again; the writes the loop asked for stay pending until one succeeds. A renewal revives a
session that went unknown while its owner was cut off (states.py); a StaleWrite of `settling`
is read back (done already by this owner, or waiting for that revival), and any other is the
fence: raised, so the loop leaves as a fenced owner.

Must never: run on the supervise loop's thread, renew without the loop's request (the keeper
decides that), or fsync the interleave index once its owner closes the logs.
"""

from __future__ import annotations

import _thread
import contextlib
from collections.abc import Iterator

from settled.errors import StaleWrite, StorageFailed, StoreUnreachable
from settled.owner.lease import HEARTBEATS_PER_LEASE
from settled.owner.store_retry import settling_outcome, with_retries
from settled.store import Store, open_store

TYPE_CHECKING = False  # loaded by every fresh owner while its command runs: no typing
if TYPE_CHECKING:
    from settled.owner.lease import Renew
    from settled.owner.supervise import Streams


class KeeperWrites:
    """One owner's renewals and pending writes; `connect` is its lease keeper's `Connect`."""

    def __init__(
        self, home: str, session: str, generation: int, lease_s: float, *, threads: bool
    ) -> None:
        """`lease_s`: the lease a renewal grants; a renewal waits out an outage for half a
        heartbeat period (HEARTBEATS_PER_LEASE). `threads`: whether its store may pool."""
        self.home, self.session, self.generation = home, session, generation
        self.lease_s, self.threads = lease_s, threads
        self.patience_s = lease_s / HEARTBEATS_PER_LEASE / 2
        self.streams: Streams | None = None  # set once the command's logs exist
        self.trouble: str | None = None  # the first renewal the store could not write
        self.launch: tuple[str, str | None, int, int | None] | None = None  # kind, ref, pid, start
        self.settling = False
        self._syncing = _thread.allocate_lock()  # the index's fsync, against its close
        self._logs_closing = False

    def logs_closing(self) -> None:
        """The owner is about to close the logs: no renewal fsyncs the index from now on (a
        closed writer's sync returns its cursor; the index's would reach a closed fd)."""
        with self._syncing:
            self._logs_closing = True

    @contextlib.contextmanager
    def connect(self) -> Iterator[Renew]:
        """Entered in the keeper's thread at its first renewal."""
        held: list[Store] = []
        try:
            yield lambda alive_at: self.renew(held, alive_at)
        finally:
            for store in held:
                store.close()

    def renew(self, held: list[Store], alive_at: float) -> str | None:
        """Renew the lease from `alive_at` (when the loop asked) and publish the durable cursors,
        then make the pending writes; the cancel reason back. Safe beside the loop's appends:
        `sync` reads a writer's cursor once, and an append moves the cursor only after its
        write returned, so the fsync covers every byte it names."""
        assert self.streams is not None  # the loop asks only once the streams exist
        durable = {name: writer.sync() for name, writer in self.streams.writers.items()}
        with self._syncing:
            if self.streams.index is not None and not self._logs_closing:
                self.streams.index.sync()

        def attempt() -> str | None:
            if not held:
                held.append(open_store(self.home, threads=self.threads))
            cancel = held[0].heartbeat(
                self.session,
                self.generation,
                alive_at + self.lease_s,
                durable["stdout"],
                durable["stderr"],
            )
            self._record_launch(held[0])
            self._record_settling(held[0])
            return cancel

        try:
            cancel, _ = with_retries(attempt, self.patience_s)
        except (StorageFailed, StoreUnreachable) as exc:
            # Not a reason to stop draining: the lease is not extended, this beat fails and the
            # next one tries again. On this host the local beat keeps the owner alive meanwhile
            # (local_beat.py); elsewhere, or past the lease, the session may show unknown, and
            # this owner's next renewal revives it unless recovery took it over (StaleWrite).
            self.trouble = self.trouble or str(exc)
            return None
        return cancel

    def _record_launch(self, store: Store) -> None:
        """The pid and the boundary's ref, unless the launcher recorded them already. Not
        fsynced, as the launcher's: a pid names nothing after a power cut."""
        pending = self.launch
        if pending is None:
            return
        kind, ref, pid, start_time = pending
        record = store.get_session(self.session)
        if record.command_pid != pid or record.boundary_ref != ref:
            store.record_launch(
                self.session, self.generation, kind, ref, pid, start_time, durable=False
            )
        self.launch = None

    def _record_settling(self, store: Store) -> None:
        """A StaleWrite is read back: settling or settled by this owner (a commit whose answer
        was lost, or its receipt first) is done; unknown at this generation waits for the
        revival (this renewal's heartbeat made it, or the next will)."""
        if not self.settling:
            return
        try:
            store.settle_begin(self.session, self.generation)
        except StaleWrite:
            outcome = settling_outcome(store.get_session(self.session), self.generation)
            if outcome == "fenced":
                raise
            if outcome == "wait":
                return
        self.settling = False
