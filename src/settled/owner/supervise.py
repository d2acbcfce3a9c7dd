"""The owner's event loop: drain both pipes, keep the deadline, stop the tree, gather evidence.

One thread, one selector: output fds, the boundary's exit fd, a signal wake-up pipe, the lease
keeper's eventfd and timers. The deadline is checked on every turn of the loop on the owner's
monotonic clock, so it fires on a silent command and on a flooding one alike. The lease is renewed
by the keeper's thread (lease.py) and only when this loop asks, every heartbeat period, so nothing
here blocks on the store while a pipe waits to be drained; a loop that was away for more than
`STALE_BEATS` periods waits for its renewal before it acts, as the inline renewal made it do.
The final drain to EOF happens only after the boundary is proven empty: never wait for EOF while
a descendant may hold a pipe.
"""

from __future__ import annotations

import os
import select
import time

from settled import faults
from settled.log.writer import drain_once
from settled.owner.lease import STALE_BEATS

TYPE_CHECKING = False  # loaded by every fresh owner: no dataclasses, typing, signal, selectors
if TYPE_CHECKING:
    from collections.abc import Callable

    from settled.boundary.base import Boundary, Evidence
    from settled.log.flush import Flusher
    from settled.log.interleave import IndexWriter
    from settled.log.writer import StreamSummary, StreamWriter
    from settled.owner.lease import LeaseKeeper
    from settled.owner.signals import OwnerSignals

READ_BUFFER = 1 << 20
STOP_POLL_S = 0.005
# The first look at the boundary after a stop began comes this soon, each next one twice as late
# (up to STOP_POLL_S): a pidns init reports the main's status, then exits ~0.1-0.5 ms later, and
# a flat 5 ms poll made every exit wait ~5 ms for its death evidence (a close's largest wait).
STOP_POLL_FIRST_S = 0.00025
# The loop runs its `soon` work (the owner's: threads, a store read) on the first turn it would
# wait; a command that never lets it wait (a flood) gets it after this many turns all the same.
SOON_AFTER_TURNS = 4
POST_EVIDENCE_DRAIN_S = 10.0
EVIDENCE_TIMEOUT_S = 30.0
SIGTERM = 15  # on every Linux architecture, without the signal module's enums


class Outcome:
    """What the loop observed, filled in as it goes."""

    def __init__(self) -> None:
        self.wait_status: int | None = None
        self.reason = "exited"
        self.started = 0.0
        self.exited: float | None = None
        self.stop_decided: float | None = None
        self.evidence_at: float | None = None
        self.evidence: Evidence | None = None
        self.stragglers: list[dict[str, object]] = []
        self.drain_complete = False


class Streams:
    """The two pipes and their logs. The drain's only bookkeeping per read is the writer's
    append (write and hash), one in-memory move of the index and an integer compare: the
    index is written at stream switches, and fsyncs happen behind the drain in the flusher's
    thread, poked every `flusher.every` bytes of a stream (log/flush.py)."""

    def __init__(
        self,
        fds: dict[str, int],
        writers: dict[str, StreamWriter],
        *,
        index: IndexWriter | None = None,
        flusher: Flusher | None = None,
    ) -> None:
        """`index`: the order of the two streams' stored bytes; `flusher`: started by the
        owner (before its boundary, if it must)."""
        self.fds = fds
        self.writers = writers
        self.buffer = bytearray(READ_BUFFER)
        self.open = {"stdout", "stderr"}
        self.index = index
        self.drained = False  # bytes were drained before the loop (owner/early.py)
        self.flusher = flusher
        self._flush_at: dict[str, int] = {}  # poke the flusher at this cursor
        self._flush_every = 0  # 0: no flusher, fsyncs at beats only
        if self.flusher is not None and self.flusher.every is not None:
            self.flusher.attach([*self.writers.values(), *([self.index] if self.index else [])])
            self._flush_every = self.flusher.every
            self._flush_at = dict.fromkeys(self.writers, self._flush_every)

    def drain(self, name: str) -> None:
        """One read of the stream: a splice into its log where the writer may (in the kernel,
        its digest behind), else readv into the buffer and append (write and hash)."""
        writer = self.writers[name]
        before = writer.cursor
        fd = self.fds[name]
        if self.index is not None:
            self.index.before_storing(name)
        try:
            moved = writer.splice_from(fd, READ_BUFFER) if writer.splicing else None
            if moved is None:
                moved = drain_once(fd, self.buffer, writer)
            if moved == 0:
                self.open.discard(name)
        except (BlockingIOError, InterruptedError):
            pass
        after = writer.cursor
        if after != before:
            if self.index is not None:
                # after the log write, so the index never names bytes the log lacks
                self.index.record(name, before, after)
            if self._flush_every and after >= self._flush_at[name]:
                self._flush_at[name] = after + self._flush_every
                assert self.flusher is not None  # a flush interval comes with its flusher
                self.flusher.poke()

    def close(self) -> dict[str, StreamSummary]:
        """Stop the flusher, then close (and so fsync) each log, the index and the pipes."""
        if self.flusher is not None:
            self.flusher.close()
        summaries = {name: writer.close() for name, writer in self.writers.items()}
        if self.index is not None:
            self.index.close()
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        return summaries


class _Poller:
    """The part of `selectors.EpollSelector` the loop uses, on `select.epoll` itself: every
    fd is registered for reading, and any event on it (EOF and errors too) makes it ready."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._names: dict[int, str] = {}

    def register(self, fd: int, name: str) -> None:
        self._epoll.register(fd, select.EPOLLIN)
        self._names[fd] = name

    def unregister(self, fd: int) -> None:
        self._epoll.unregister(fd)
        del self._names[fd]

    def select(self, timeout: float | None) -> list[tuple[int, str]]:
        """(fd, name) of each ready fd; waits up to `timeout` s (None: until one is)."""
        ready = self._epoll.poll(-1 if timeout is None else max(0.0, timeout))
        return [(fd, self._names[fd]) for fd, _events in ready]

    def close(self) -> None:
        self._epoll.close()


class Supervisor:
    """Runs one command inside one boundary to death evidence; knows nothing of the store."""

    def __init__(
        self,
        boundary: Boundary,
        streams: Streams,
        *,
        timeout: float | None,
        grace: float,
        lease: LeaseKeeper,
        heartbeat_every: float,
        signals: OwnerSignals,
        settling: Callable[[], None],
        soon: Callable[[], None] | None = None,
        observe: Callable[[], None] | None = None,
    ) -> None:
        """`soon`: work the running command needs but its first drain and its exit must not
        wait for: run on the loop's first turn that would wait (a quick command's exit is
        seen first, and it never runs), after SOON_AFTER_TURNS turns that did not, and before
        the lease is first asked for anything. `observe`: read what the kernel counted in
        the boundary's cgroups (limits.py), once the boundary is empty and before its evidence
        removes any of them."""
        self.boundary, self.streams = boundary, streams
        self.timeout, self.grace = timeout, grace
        self.lease, self.heartbeat_every = lease, heartbeat_every
        self.signals = signals
        self.settling = settling
        self._soon = soon
        self._observe = observe
        self._turns_before_soon = 0
        self.outcome = Outcome()
        self._cancel: str | None = None
        self._kill_at: float | None = None
        self._stopping = False
        self._stop_poll = STOP_POLL_FIRST_S
        self._empty_fd: int | None = None  # watched once stopping (-1: nothing to watch)
        self._selector = _Poller()

    # -- the loop ------------------------------------------------------------------------

    def run(self, started: float) -> Outcome:
        """Supervise to death evidence. The lease keeper (started by the owner) renews when this
        loop asks, and outlives it: the owner asks for renewals while it settles and closes the
        keeper once its receipt is written. A renewal's failure is raised here, even one that
        came back after the loop's last look."""
        self._supervise(started)
        outcome = self._finish()
        self.lease.collect()
        return outcome

    def _supervise(self, started: float) -> None:
        out = self.outcome
        out.started = started
        deadline = started + self.timeout if self.timeout is not None else None
        next_beat, last_turn = started + self.heartbeat_every, started
        for name, fd in self.streams.fds.items():
            os.set_blocking(fd, False)
            self._selector.register(fd, name)
        self._selector.register(self.boundary.exit_fd(), "exit")
        self._selector.register(self.signals.wake_r, "wake")
        self._selector.register(self.lease.fileno(), "lease")
        drained_once = self.streams.drained  # owner.mid_drain fires once, at the first drain
        while True:
            now = time.monotonic()
            if now >= next_beat:
                if self._cancel is None:  # once cancelled, no more renewals (as inline)
                    self._renew(away=now - last_turn)
                next_beat = now + self.heartbeat_every
            last_turn = now
            if not self._stopping:
                if deadline is not None and now >= deadline:
                    self._begin_stop(now, "timeout")
                elif self._cancel is not None:
                    self._begin_stop(now, "cancelled")
            if self._stopping and (out.exited is not None or self._kill_at is not None):
                if self.boundary.is_empty():
                    break
                if self._kill_at is not None and now >= self._kill_at:
                    break
            if self._stopping and self._empty_fd is None:
                self._watch_emptiness()
            wait = self._next_wait(now, deadline, next_beat)
            if self._soon is not None and out.exited is None:
                ready = self._selector.select(0.0)
                self._turns_before_soon += 1
                if not ready or self._turns_before_soon >= SOON_AFTER_TURNS:
                    self._run_soon()
                    if not ready:
                        continue  # it took a while: the clocks are read again
            else:
                ready = self._selector.select(wait)
            for fd, name in ready:
                if name in ("stdout", "stderr"):
                    self.streams.drain(name)
                    if name not in self.streams.open:
                        self._selector.unregister(fd)
                    if not drained_once:
                        drained_once = True
                        faults.point("owner.mid_drain")
                elif name == "exit":
                    self._on_exit_fd(fd)
                elif name == "empty":  # looked at next turn; it stays readable: watched once
                    self._selector.unregister(fd)
                elif name == "lease":
                    self._cancel = self._cancel or self.lease.on_wake()
                else:
                    self.signals.drain()
                    self._cancel = self._cancel or self.signals.stop_reason
                    if self._cancel is None:  # USR1: look at the store now
                        self._run_soon()
                        self.lease.request()
            if out.exited is not None and not self._stopping:
                self._on_main_exit()

    def _watch_emptiness(self) -> None:
        """Once stopping, wake when the boundary says it may be empty (a PID namespace's init
        exited) rather than at the next look: the looks back off from 0.25 ms to 5 ms, and an
        init that exits between two of them waited for the second."""
        self._empty_fd = self.boundary.empty_fd()
        if self._empty_fd is None:
            self._empty_fd = -1  # nothing to watch: the looks alone
        else:
            self._selector.register(self._empty_fd, "empty")

    def _run_soon(self) -> None:
        soon, self._soon = self._soon, None
        if soon is not None:
            soon()

    def _renew(self, away: float) -> None:
        """Ask the keeper for a renewal. After a gap in the loop (stopped, starved) the lease may
        have run out and the session been fenced: wait for the store's answer before acting."""
        self._run_soon()  # the keeper's thread first
        if away > STALE_BEATS * self.heartbeat_every:
            self._cancel = self._cancel or self.lease.confirm()
        else:
            self.lease.request()

    def _next_wait(self, now: float, deadline: float | None, next_beat: float) -> float:
        candidates = [next_beat - now]
        if deadline is not None and not self._stopping:
            candidates.append(deadline - now)
        if self._kill_at is not None:
            candidates.append(self._kill_at - now)
        if self._stopping:
            candidates.append(self._stop_poll)
            self._stop_poll = min(STOP_POLL_S, 2 * self._stop_poll)
        return max(0.0, min(candidates))

    def _on_exit_fd(self, fd: int) -> None:
        status = self.boundary.collect_main()
        if status is not None:
            self.outcome.wait_status = status
            self.outcome.exited = time.monotonic()
            self._selector.unregister(fd)

    def _begin_stop(self, now: float, reason: str) -> None:
        """Timeout or cancel: TERM to everything in the boundary, then KILL after the grace."""
        self.outcome.reason = reason
        self.outcome.stop_decided = now
        self._stopping = True
        self._kill_at = now + self.grace
        if self.grace > 0:
            self.boundary.signal_all(SIGTERM)
        else:  # no grace: KILL over the boundary now; TERM one by one would only delay it
            self.boundary.kill_all()
        self.settling()  # recorded after the signal, so the store's latency is not the kill's

    def _on_main_exit(self) -> None:
        """The main process is gone: whoever is left in the boundary is a straggler, stopped
        (TERM, the grace, KILL) while the session is recorded as settling. With none left
        there is nothing to stop and the evidence is at hand: the receipt settles the running
        session in one step (states.py), and no `settling` write queues on the store's write
        lock behind those of every other owner whose command exited at the same moment."""
        self._stopping = True
        now = time.monotonic()
        self.outcome.stop_decided = now
        self._kill_at = now + self.grace  # also bounds a straggler that appears after this look
        left = self.boundary.describe_members()
        if left:
            self.outcome.stragglers = [{**m, "stopped_by": "TERM"} for m in left]
            if self.grace > 0:
                self.boundary.signal_all(SIGTERM)
            self.settling()  # after the signal, as in _begin_stop
            self._run_soon()  # a grace to wait out, and renewals with it

    def _finish(self) -> Outcome:
        out = self.outcome
        survivors = set(self.boundary.members())
        for straggler in out.stragglers:
            if straggler["pid"] in survivors:
                straggler["stopped_by"] = "KILL"
        self.boundary.await_empty(EVIDENCE_TIMEOUT_S)
        if self._observe is not None:  # the counters go with the cgroups evidence removes
            self._observe()
        out.evidence = self.boundary.evidence()
        out.evidence_at = time.monotonic()
        faults.point("owner.after_death_evidence")
        if out.wait_status is None:
            out.wait_status = _await_main(self.boundary)
            out.exited = out.exited or out.evidence_at  # it exited before the boundary was empty
        out.drain_complete = self._drain_to_eof(
            POST_EVIDENCE_DRAIN_S if out.evidence.proven else min(self.grace, 2.0)
        )
        self._selector.close()
        return out

    def _drain_to_eof(self, budget: float) -> bool:
        """After evidence no writer can remain, so EOF comes at once; bounded all the same."""
        give_up = time.monotonic() + budget
        pending = {self.streams.fds[n]: n for n in self.streams.open}
        selector = _Poller()
        for fd, name in pending.items():
            selector.register(fd, name)
        while self.streams.open and time.monotonic() < give_up:
            for fd, name in selector.select(give_up - time.monotonic()):
                self.streams.drain(name)
                if name not in self.streams.open:
                    selector.unregister(fd)
        selector.close()
        return not self.streams.open


def _await_main(boundary: Boundary) -> int | None:
    """After the boundary was killed the main status is due; poll briefly for it."""
    for _ in range(2000):
        status = boundary.collect_main()
        if status is not None:
            return status
        time.sleep(0.001)
    return None
