"""The session owner once its command runs (or could not start): supervision to the receipt.

Loaded by the owner's launch path (launch.py) after its command started, while the first drain
(early.py) reads both pipes: the store, the log writers and the interleave index (adopting the
files created before the command), the lease keeper's thread, the supervise loop, the receipt
and the journal client. Owns the session from the
running command to its receipt: the drain, the deadline, the lease, death evidence, the logs'
summaries, the terminal mutation, the receipt (or, when it cannot be written, the last words),
then the seal of its logs, after the receipt and never at its cost (owner/sealing.py).
Also writes the receipt of a session whose command never started. Must never: run a second
command, or write for a session its generation no longer holds (the store refuses: StaleWrite).

A store outage is waited out (store_retry.py), never by the supervise loop: the loop only asks,
and the lease keeper's thread makes every store write of a running command (the renewal, the
run's record, `settling`: renewals.py); the receipt is retried until the store is back, within
the owner's store patience, while the keeper renews the lease. A retried write whose first
attempt may have committed (its connection lost after COMMIT) is read back: found done by this
owner at its generation, it is done, not a failure. Over 400 lines: it is the one owner from
running command to receipt, and its settle's steps read best in one place.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from contextlib import AbstractContextManager

from settled import faults, nothreads
from settled.backends import seals_logs
from settled.boundary import linux
from settled.boundary.base import Boundary
from settled.boundary.isolation import IsolationPlan
from settled.boundary.pidns import threads_refused
from settled.errors import StaleWrite, StorageFailed, StoreUnreachable
from settled.home import SpaceGuard, journal_socket, storage_error
from settled.identity import CommandSpec
from settled.log.flush import FLUSH_ENV, Flusher, flush_every
from settled.log.interleave import IndexWriter
from settled.log.writer import StreamWriter
from settled.owner.early import EarlyDrain
from settled.owner.last_words import LastWords
from settled.owner.lease import (
    HEARTBEATS_PER_LEASE,
    STALE_BEATS,
    LeaseKeeper,
    Renew,
    lease_seconds,
)
from settled.owner.local_beat import LocalBeat
from settled.owner.renewals import KeeperWrites
from settled.owner.signals import OwnerSignals
from settled.owner.store_retry import PATIENCE_ENV, patience_s, receipt_recorded, with_retries
from settled.owner.supervise import Outcome, Streams, Supervisor
from settled.receipts import exit_fact, not_started_fact, process_receipt
from settled.store import Store, open_store

TYPE_CHECKING = False  # loaded by every fresh owner while its command runs: no typing
if TYPE_CHECKING:
    from typing import Any

    from settled.boundary.walls import Walls
    from settled.objects import ObjectStore
    from settled.records import SessionRecord

LOG_CAP_ENV = "SETTLED_LOG_CAP"


def _load_settle_path() -> None:
    """Import what the settle needs while the command runs (the early drain reads on): the
    journal's client is ~10 ms of imports in a fresh owner (a zygote's fork has it), which
    after the command's exit would stand between its death evidence and its receipt, and at
    load every owner whose command exits at once would queue for the CPU with it."""
    from settled.workspace.journal import wire  # noqa: F401


class OwnerSession:
    def __init__(
        self,
        home: str,
        orders: dict[str, Any],
        ready: Any,  # main.Ready: its `send` ends the readiness pipe
        signals: OwnerSignals,
        timings: dict[str, float],
        last_words: LastWords | None,
        lease: LeaseKeeper | None = None,
        flusher: Flusher | None = None,
        *,
        splice: bool = False,
        store: Store | None = None,
        record: SessionRecord | None = None,
        oom: int | None = None,
    ) -> None:
        """`lease` and `flusher`: started before the command (the keeper's connection is this
        session's `renewals`); a session whose command never started gets idle ones made
        here. `splice`: the logs were made for it (launch.py). `store`: the home's, opened
        ahead (a zygote's spare); this session closes it. `record`: the session's, read from
        it already (its admitted spec, key and digest). `oom`: the owner's oom_score_adj."""
        self.home, self.orders, self.ready, self.signals = home, orders, ready, signals
        self.timings, self.last_words = timings, last_words
        self.session, self.task = str(orders["session"]), str(orders["task"])
        self.generation = int(orders["generation"])
        self.boundary_kind: str | None = orders["boundary"]
        self.plan = IsolationPlan(**orders["plan"]) if orders["plan"] is not None else None
        self.sandbox: dict[str, Any] | None = orders["sandbox"]
        self.lease_s = lease_seconds()
        self.heartbeat_s = self.lease_s / HEARTBEATS_PER_LEASE
        self.oom = oom
        self.walls: Walls | None = None
        self.patience_s = patience_s()
        self._supervised = time.monotonic()  # reset when the loop starts (supervise)
        self.beat = LocalBeat(home, self.lease_s)  # the loop's requests (and the wait below)
        self.store, self.record = self._store_and_record(store, record)
        self.spec = CommandSpec.from_json(self.record.spec)
        self.streams: Streams | None = None
        self.spawn_via: str | None = None  # clone3 or fork, once the command started
        # what the keeper's thread writes (the loop never waits on the store): renewals.py
        self.writes = KeeperWrites(
            home, self.session, self.generation, self.lease_s, threads=_threads_allowed()
        )
        self.lease = lease or LeaseKeeper(self.renewals, stale_after=STALE_BEATS * self.heartbeat_s)
        self.lease.beat = self.beat
        self.flusher = flusher or Flusher(flush_every(os.environ.get(FLUSH_ENV)))
        self.splice = splice

    def _store_and_record(
        self, store: Store | None, record: SessionRecord | None
    ) -> tuple[Store, SessionRecord]:
        """The home's store (opened ahead, or now) and the session's record, through an outage
        within the owner's patience. The command runs meanwhile and the first drain reads both
        pipes (the loop has not started: its deadline is kept from its first turn on), and
        each retry is a local beat: this owner is alive, its store is not."""
        held = [store] if store is not None else []

        def read() -> SessionRecord:
            if not held:
                held.append(open_store(self.home, threads=_threads_allowed()))
            return record or held[0].get_session(self.session)

        found, _ = with_retries(read, self.patience_s, between=lambda: self.beat(time.time()))
        return held[0], found

    def close(self) -> None:
        self.lease.close()
        self.beat.close()
        self.flusher.close()
        self.store.close()

    # -- the running command, to its receipt ---------------------------------------------

    def supervise(
        self,
        boundary: Boundary,
        pipes: dict[str, int],
        logs: dict[str, int],
        early: EarlyDrain,
        started: float,
        pid: int,
        start_time: int | None,
        via: str,
        walls: Walls | None = None,
    ) -> int:
        """`logs`: the logs and index created before the command ran; `early`: the drain
        that read both pipes, in order, while this module loaded; `walls`: the command's
        limits and their cgroups (their counters read after death evidence)."""
        self.timings["supervised_at"] = time.time()  # the session's imports and store: loaded
        self._supervised = time.monotonic()
        self.spawn_via = via
        self.walls = walls
        streams = self.streams = self.writes.streams = self._open_streams(pipes, logs)
        # The first drain goes on reading while the loop is built, and hands over just before
        # the loop starts: a gap between the two would let both pipes fill, and the order
        # between a stdout and a stderr write made meanwhile could not be told.
        _load_settle_path()
        supervisor = Supervisor(
            boundary,
            streams,
            timeout=self.spec.timeout,
            grace=self.spec.grace,
            lease=self.lease,
            heartbeat_every=self.heartbeat_s,
            signals=self.signals,
            settling=self._settle_begin,
            soon=lambda: self._while_it_runs(boundary, pid, start_time),
            observe=walls.observe if walls is not None else None,
        )
        early.hand_to(streams)
        try:
            outcome = supervisor.run(started)
        except StaleWrite as exc:
            return self._fenced(exc)
        self.writes.logs_closing()  # the keeper renews on through the settle, syncs no more
        boundary.teardown()
        return self._settle(outcome, streams)

    def _while_it_runs(self, boundary: Boundary, pid: int, start_time: int | None) -> None:
        """What a running command needs, done by the loop once it first has time (it would
        wait), and before its first renewal: never if the command ended before that, when the
        receipt comes next and none of it is wanted. Makes sure the run is recorded and syncs
        the last words' block (the lease keeper's and the flusher's threads started before the
        command: no thread starts after it). A fenced session raises StaleWrite out of the
        loop."""
        self._record_running(boundary, pid, start_time)
        if self.last_words is not None:
            self.last_words.sync()

    def _record_running(self, boundary: Boundary, pid: int, start_time: int | None) -> None:
        """The launcher records the pid and the boundary's ref when the owner reports; this
        makes sure of it (a launcher that died first), through the keeper's thread at its
        next renewal (renewals.py): the loop's first, a heartbeat period in, not one asked for
        now (the claim named the boundary's ref already, which is what recovery inspects). A
        fenced session raises StaleWrite there."""
        self.writes.launch = (boundary.kind, boundary.ref, pid, start_time)
        self._renew_if_due()

    def _fenced(self, exc: StaleWrite) -> int:
        # Fenced: recovery took this session over (we were stopped or starved past our
        # lease). Its boundary, log and receipt are recovery's now; touch nothing, leave.
        print(f"owner fenced, exiting without a receipt: {exc}", file=sys.stderr)
        return 3

    def _settle_begin(self) -> None:
        """Record that the session is settling, through the keeper's thread (renewals.py).
        A store that refuses it or is out does not stop the owner: the receipt settles a
        running session as well (states.py), and draining matters more."""
        self.writes.settling = True  # carried by the next renewal, whenever one is made
        self._renew_if_due()

    def _renew_if_due(self) -> None:
        """Ask for a renewal once the loop has run a heartbeat period: before that, the lease
        of the claim still has four periods to spare, and a short command's receipt follows at
        once (settling it from running, states.py), so the keeper opens no store connection of
        its own for it (issue 39's owner cost)."""
        if time.monotonic() - self._supervised >= self.heartbeat_s:
            self.lease.request()

    def _open_streams(self, pipes: dict[str, int], logs: dict[str, int]) -> Streams:
        """The writers of the logs the command's pipes drain into: adopting the files created
        before it ran (`logs`, emptied here, made for splicing where `self.splice`), else
        creating them (a command that never ran); fsynced behind the drain by the flusher."""
        cap_text = os.environ.get(LOG_CAP_ENV)
        cap = int(cap_text) if cap_text else None
        space = SpaceGuard(self.home)  # both streams stop storing at the home's reserve
        paths = self.orders["logs"]
        splice = self.splice and "stdout" in logs
        writers = {
            name: StreamWriter(paths[name], cap, space, splice=splice, fd=logs.pop(name, None))
            for name in ("stdout", "stderr")
        }
        index = IndexWriter(paths["index"], fd=logs.pop("index", None))
        return Streams(dict(pipes), writers, index=index, flusher=self.flusher)

    def renewals(self) -> AbstractContextManager[Renew]:
        """Entered in the lease keeper's thread at its first renewal (renewals.py)."""
        return self.writes.connect()

    def _settle(self, outcome: Outcome, streams: Streams) -> int:
        summaries = streams.close()  # the flusher, then each log (fsynced), the index, the pipes
        self._renew_if_due()  # renewed through the settle; closed once the receipt is written
        assert outcome.evidence is not None
        terminal_mutation = self._terminal_mutation()
        now = time.monotonic()
        self.timings.update(
            {
                "exited_after_s": round((outcome.exited or now) - outcome.started, 6),
                "evidence_after_exit_s": round(
                    (outcome.evidence_at or now) - (outcome.exited or now), 6
                ),
                "settled_at": time.time(),
            }
        )
        if outcome.stop_decided is not None and outcome.reason in ("timeout", "cancelled"):
            self.timings["stop_to_evidence_s"] = round(
                (outcome.evidence_at or now) - outcome.stop_decided, 6
            )
        elapsed = (outcome.exited - outcome.started) if outcome.exited else None
        ended = exit_fact(
            outcome.wait_status,
            outcome.reason,
            shell=self.spec.shell is not None,
            elapsed_s=elapsed,
        )
        resources = None
        if self.walls is not None:
            self.walls.remove()  # its counters were read after death evidence (observe)
            resources = self.walls.facts(self.oom)
            if oom_killed(outcome.wait_status, outcome.reason, self.walls.oom_kills()):
                ended["reason"] = "oom"
                ended["oom_kill"] = self.walls.oom_kills()
        receipt = self._receipt(
            death=outcome.evidence.to_json("owner"),
            exit=ended,
            resources=resources,
            network=self._network(
                outcome.stop_decided if (outcome.reason != "exited" or outcome.stragglers) else None
            ),
            output={
                **{name: s.to_json() for name, s in summaries.items()},
                "drain": "complete" if outcome.drain_complete else "incomplete",
            },
            stragglers=outcome.stragglers,
            terminal_mutation=terminal_mutation,
        )
        faults.point("owner.before_receipt")
        event = "receipt" if outcome.evidence.proven else "lose"
        return self._sealed(self._write_receipt(receipt, event))

    def _write_receipt(self, receipt: dict[str, Any], event: str = "receipt") -> int:
        """Write the receipt, through a store outage within the owner's store patience while
        the keeper renews the lease (asked before each retry); then the keeper ends. If the
        disk refuses it or the store stays out, leave the reason in the last words (whose
        block was reserved before the command ran), so recovery and status can say why this
        session is unknown instead of finding a silent owner. Fenced: exit 3, nothing said."""
        self.writes.settling = False  # the receipt settles a running session as well
        try:
            self._receipt_written(receipt, event)
        except StaleWrite as exc:
            return self._fenced(exc)
        except StoreUnreachable as exc:
            failure = f"{exc} (retried for {self.patience_s:g} s, {PATIENCE_ENV})"
        except StorageFailed as exc:
            failure = str(exc)
        except OSError as exc:
            failure = str(storage_error(exc, self.home, "writing the receipt") or exc)
        else:
            self.ready.close()  # a waiter in the launching process wakes now (receipt_wake.py)
            return 0
        finally:
            self.lease.close()
        self.say_last_words(
            f"the owner could not write its receipt: {failure}",
            receipt=receipt["digest"],
            output={
                name: {k: receipt["output"][name].get(k) for k in ("cursor", "dropped")}
                for name in ("stdout", "stderr")
            },
        )
        return 4

    def _receipt_written(self, receipt: dict[str, Any], event: str) -> None:
        """Write the receipt, retried through an outage. A retry refused as stale is read
        back: the receipt recorded at this generation is this one (the first attempt
        committed, its answer lost) or this owner was fenced (StaleWrite raised)."""

        def attempt() -> None:
            faults.point("owner.receipt_write")
            try:
                self.store.write_receipt(self.session, self.generation, receipt, event=event)
            except StaleWrite:
                found = self.store.get_session(self.session)
                if not receipt_recorded(found, self.generation, receipt["digest"]):
                    raise

        with_retries(attempt, self.patience_s, between=self.lease.request)

    def say_last_words(self, reason: str, **facts: Any) -> None:
        """Record why this owner ends without a receipt (also on its owner.log, if it can)."""
        if self.writes.trouble:
            facts.setdefault("store_trouble", self.writes.trouble)
        if self.last_words is not None:
            self.last_words.record(reason, **facts)
        with contextlib.suppress(OSError, ValueError):
            print(f"settled owner: {reason}", file=sys.stderr, flush=True)

    def never_ran(
        self,
        reason: str,
        stage: str,
        error: str,
        pipes: dict[str, int] | None = None,
        *,
        planned: bool = True,
        logs: dict[str, int] | None = None,
    ) -> int:
        """Settle a session whose command never started: its receipt says why, not an exit code.
        `planned`: it got as far as its isolation plan (the receipt then shows it); `logs`:
        the logs created for it, if it got that far."""
        if not planned:
            self.plan = None
        self.lease.close()  # it never renewed; it ends before the receipt all the same
        for fd in (pipes or {}).values():
            os.close(fd)
        streams = self._open_streams({}, logs if logs is not None else {})
        summaries = {n: s.to_json() for n, s in streams.close().items()}
        self.timings["settled_at"] = time.time()
        receipt = self._receipt(
            death={
                "boundary": self.boundary_kind,
                "proven": True,
                "evidence": f"the command never started ({stage}): no process of it ever ran",
                "source": "owner",
                "observed": {"stage": stage},
            },
            exit={**not_started_fact(stage, error), "reason": reason},
            output={
                "stdout": summaries["stdout"],
                "stderr": summaries["stderr"],
                "drain": "complete",
            },
            stragglers=[],
            terminal_mutation={"seq": None, "source": "none", "why": "the command never ran"},
            network=self._network(None),  # a session the proxy served lets its ledger go
        )
        code = self._write_receipt(receipt)
        self.ready.send(state="settled", owner_pid=os.getpid(), error=error)
        return self._sealed(code)

    def _sealed(self, code: int) -> int:
        """After the receipt (`code` 0: it was written), seal each stream into the object store
        where the home's objects live outside it (owner/sealing.py), trying again with bounded
        backoff: the receipt never waits on the object store, and a seal that still fails is
        the close's to retry and name. Returns `code`: a seal never changes the owner's exit."""
        if code != 0 or not seals_logs(self.home):
            return code
        from settled.objects import open_object_store  # after the receipt: off the launch path
        from settled.owner.sealing import seal_bound, seal_session, seal_with_retries

        objects: list[ObjectStore] = []  # opened once, at the first attempt

        def attempt() -> dict[str, str]:
            try:
                objects[:] = objects or [open_object_store(self.home)]
                record = self.store.get_session(self.session)
                return seal_session(self.home, self.store, objects[0], record)
            except BaseException as exc:  # the store or the object store: try again
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                return {"stdout": f"{type(exc).__name__}: {exc}"}

        failures = seal_with_retries(attempt, seal_bound())
        if failures:
            with contextlib.suppress(OSError, ValueError):
                print(f"settled owner: logs not sealed: {failures}", file=sys.stderr, flush=True)
        return code

    def _terminal_mutation(self) -> dict[str, Any]:
        """The journal's watermark read after death evidence: every write of the session's
        processes completed before it, so each is at or below this sequence number."""
        # imported after evidence, off the launch path
        from settled.workspace.journal import wire as journal_wire

        return journal_wire.terminal_mutation(journal_socket(self.home), self.task)

    def _network(self, killed_at: float | None) -> dict[str, Any] | None:
        """`--network proxy`: the session's ledger, sealed now that nothing of the command
        runs (the proxy aborts what is still open), and what the receipt says of it. The
        kill's start, if settled killed anything, decides which ends the ledger trusts
        (netledger.entries): `killed_at`, CLOCK_MONOTONIC, None if it killed nothing."""
        if self.plan is None or self.plan.network != "proxy":
            return None
        from settled.netproxy.sealing import sealed_facts  # after evidence: off the launch path

        return sealed_facts(self.home, self.session, list(self.spec.allow_hosts), killed_at)

    def _isolation(self) -> dict[str, Any] | None:
        if self.plan is None:
            return None
        from settled.boundary.isolation import isolation_facts

        return isolation_facts(self.plan, self.sandbox)

    def _receipt(self, **facts: Any) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        recorded = self._isolation()
        isolation = (
            {**recorded, "env_removed": list(self.spec.env_removed)}
            if recorded is not None
            else {"policy": self.spec.isolation, "applied": False,
                  "why": "the command never started, so no isolation was built"}
        )  # fmt: skip
        owner: dict[str, Any] = {
            "pid": os.getpid(),
            "maxrss_kib": _peak_rss_kib() or usage.ru_maxrss,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 6),
        }
        if self.spawn_via is not None:  # how the command started, and through which binding
            owner["spawn"] = self.spawn_via
        owner["calls"] = linux.BINDING
        return process_receipt(
            isolation=isolation,
            session=self.session,
            task=self.task,
            key=self.record.key,
            command_digest=self.record.digest,
            generation=self.generation,
            owner=owner,
            timings=self.timings,
            **facts,
        )


def oom_killed(wait_status: int | None, reason: str, kills: int) -> bool:
    """Whether the command's end is the memory controller's doing: it killed inside the
    session, and the main process died of SIGKILL (itself, or with its namespace's init),
    which settled sent only for a deadline or a cancel (their own reasons)."""
    return (
        kills > 0
        and reason == "exited"
        and wait_status is not None
        and os.WIFSIGNALED(wait_status)
        and os.WTERMSIG(wait_status) == 9
    )


def _threads_allowed() -> bool:
    """Whether this owner may still start threads (its store's pool): never once its command
    runs (settled.nothreads), nor where it unshared a PID namespace for its children."""
    return nothreads.refused() is None and not threads_refused()


def _peak_rss_kib() -> int | None:
    """This process's own peak resident set (VmHWM). Not ru_maxrss: a fresh owner is
    posix_spawned (vfork), and exec folds the spawning caller's peak into ru_maxrss."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
