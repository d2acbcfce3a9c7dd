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
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from settled import faults
from settled.boundary.base import Boundary, Evidence
from settled.log.flush import Flusher
from settled.log.interleave import IndexWriter
from settled.log.writer import StreamSummary, StreamWriter, drain_once
from settled.owner.lease import STALE_BEATS, LeaseKeeper
from settled.owner.signals import OwnerSignals

READ_BUFFER = 1 << 20
STOP_POLL_S = 0.005
POST_EVIDENCE_DRAIN_S = 10.0
EVIDENCE_TIMEOUT_S = 30.0


@dataclass
class Outcome:
    wait_status: int | None = None
    reason: str = "exited"
    started: float = 0.0
    exited: float | None = None
    stop_decided: float | None = None
    evidence_at: float | None = None
    evidence: Evidence | None = None
    stragglers: list[dict[str, object]] = field(default_factory=list)
    drain_complete: bool = False


@dataclass
class Streams:
    """The two pipes and their logs. The drain's only bookkeeping per read is the writer's
    append (write and hash), one in-memory move of the index and an integer compare: the
    index is written at stream switches, and fsyncs happen behind the drain in the flusher's
    thread, poked every `flusher.every` bytes of a stream (log/flush.py)."""

    fds: dict[str, int]
    writers: dict[str, StreamWriter]
    buffer: bytearray = field(default_factory=lambda: bytearray(READ_BUFFER))
    open: set[str] = field(default_factory=lambda: {"stdout", "stderr"})
    index: IndexWriter | None = None  # the order of the two streams' stored bytes
    drained: bool = False  # bytes were drained before the loop (owner/early.py)
    flusher: Flusher | None = None  # started by the owner (before its boundary, if it must)
    _flush_at: dict[str, int] = field(default_factory=dict, init=False)  # poke at this cursor
    _flush_every: int = field(default=0, init=False)  # 0: no flusher, fsyncs at beats only

    def __post_init__(self) -> None:
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
    ) -> None:
        self.boundary, self.streams = boundary, streams
        self.timeout, self.grace = timeout, grace
        self.lease, self.heartbeat_every = lease, heartbeat_every
        self.signals = signals
        self.settling = settling
        self.outcome = Outcome()
        self._cancel: str | None = None
        self._kill_at: float | None = None
        self._stopping = False
        self._selector = selectors.DefaultSelector()

    # -- the loop ------------------------------------------------------------------------

    def run(self, started: float) -> Outcome:
        """Supervise to death evidence. The lease keeper (started by the owner) renews only when
        this loop asks and is closed before this returns; a renewal's failure is raised here,
        even one that came back after the loop's last look."""
        try:
            self._supervise(started)
            self.lease.stop()  # no renewal is asked for after the loop, as before
            outcome = self._finish()
        finally:
            self.lease.close()
        self.lease.collect()
        return outcome

    def _supervise(self, started: float) -> None:
        out = self.outcome
        out.started = started
        deadline = started + self.timeout if self.timeout is not None else None
        next_beat, last_turn = started + self.heartbeat_every, started
        for name, fd in self.streams.fds.items():
            os.set_blocking(fd, False)
            self._selector.register(fd, selectors.EVENT_READ, name)
        self._selector.register(self.boundary.exit_fd(), selectors.EVENT_READ, "exit")
        self._selector.register(self.signals.wake_r, selectors.EVENT_READ, "wake")
        self._selector.register(self.lease.fileno(), selectors.EVENT_READ, "lease")
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
            wait = self._next_wait(now, deadline, next_beat)
            for key, _ in self._selector.select(wait):
                name = key.data
                if name in ("stdout", "stderr"):
                    self.streams.drain(name)
                    if name not in self.streams.open:
                        self._selector.unregister(key.fd)
                    if not drained_once:
                        drained_once = True
                        faults.point("owner.mid_drain")
                elif name == "exit":
                    self._on_exit_fd(key.fd)
                elif name == "lease":
                    self._cancel = self._cancel or self.lease.on_wake()
                else:
                    self.signals.drain()
                    self._cancel = self._cancel or self.signals.stop_reason
                    if self._cancel is None:  # USR1: look at the store now
                        self.lease.request()
            if out.exited is not None and not self._stopping:
                self._on_main_exit()

    def _renew(self, away: float) -> None:
        """Ask the keeper for a renewal. After a gap in the loop (stopped, starved) the lease may
        have run out and the session been fenced: wait for the store's answer before acting."""
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
            candidates.append(STOP_POLL_S)
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
            self.boundary.signal_all(signal.SIGTERM)
        else:  # no grace: KILL over the boundary now; TERM one by one would only delay it
            self.boundary.kill_all()
        self.settling()  # recorded after the signal, so the store's latency is not the kill's

    def _on_main_exit(self) -> None:
        """The main process is gone: whoever is left in the boundary is a straggler."""
        self._stopping = True
        now = time.monotonic()
        self.outcome.stop_decided = now
        self.settling()
        self._kill_at = now + self.grace  # also bounds a straggler that appears after this look
        left = self.boundary.describe_members()
        if left:
            self.outcome.stragglers = [{**m, "stopped_by": "TERM"} for m in left]
            if self.grace > 0:
                self.boundary.signal_all(signal.SIGTERM)

    def _finish(self) -> Outcome:
        out = self.outcome
        survivors = set(self.boundary.members())
        for straggler in out.stragglers:
            if straggler["pid"] in survivors:
                straggler["stopped_by"] = "KILL"
        self.boundary.await_empty(EVIDENCE_TIMEOUT_S)
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
        selector = selectors.DefaultSelector()
        for fd, name in pending.items():
            selector.register(fd, selectors.EVENT_READ, name)
        while self.streams.open and time.monotonic() < give_up:
            for key, _ in selector.select(max(0.0, give_up - time.monotonic())):
                self.streams.drain(key.data)
                if key.data not in self.streams.open:
                    selector.unregister(key.fd)
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
