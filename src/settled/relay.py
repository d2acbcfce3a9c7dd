"""Relay a session's two streams to this process's stdout and stderr: `settled run` and `attach`.

Bytes are written as they are stored, each stream to its own descriptor, never re-split into
lines; the relay ends exactly at each stream's final cursor (named by the process receipt), so
nothing after the receipt and nothing before it is missed. Where it stands is always two
cursors, which is all a later `settled attach SESSION --from N --stderr-from M` needs to go on
from the same byte.

One thread, no store connection shared across threads: the relay reads each stream from its
cursor, and only when neither grew asks the store whether the session has settled. Between looks
it sleeps in the runtime's pause, which a byte stored in the session's log or the owner's exit
ends at once (an inotify watch and a pidfd, `Runtime.pauses`): no polling interval stands
between a byte and the terminal while the command runs.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

from settled.cli.frame import write_all

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import BinaryIO

    from settled.runtime import Runtime

STREAMS = ("stdout", "stderr")
LOOK_EVERY_S = 1.0  # the longest a pause lasts: its events (a stored byte, the exit) end it


@contextlib.contextmanager
def _no_interrupt() -> Iterator[None]:
    """Hold SIGINT while a chunk is written and counted, so the cursor a detach prints is
    exactly the first byte not shown: the signal is delivered when the block ends."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class Relay:
    """Where the relay of one session stands: the next cursor of each stream. (A plain class:
    `settled run` would import dataclasses, typing and inspect, ~6 ms, for it alone.)"""

    __slots__ = ("cursors", "session")

    def __init__(self, session: str, cursors: dict[str, int] | None = None) -> None:
        self.session = session
        self.cursors = dict.fromkeys(STREAMS, 0) if cursors is None else cursors

    def run(
        self,
        rt: Runtime,
        sinks: dict[str, BinaryIO],
        sleep: Callable[[float], None] | None = None,
    ) -> dict[str, tuple[int, int]]:
        """Copy both streams until each reached its final cursor; returns the streams whose
        stored bytes end before their final cursor (stream -> (stored end, final)), which a
        caller must report rather than pretend the output is whole. A KeyboardInterrupt
        leaves `cursors` at the first byte not yet written (every written byte is flushed).
        Between looks it calls `sleep(LOOK_EVERY_S)`, by default the runtime's pause, which
        ends when a byte is stored or the owner exits; a `sleep` given here must wake as early."""
        if sleep is not None:
            return self._relay(rt, sinks, sleep)
        with rt.pauses(self.session) as pause:
            return self._relay(rt, sinks, pause)

    def _relay(
        self, rt: Runtime, sinks: dict[str, BinaryIO], sleep: Callable[[float], None]
    ) -> dict[str, tuple[int, int]]:
        while True:
            if self._copy_new(rt, sinks):
                continue
            finals = {stream: rt.final_cursor(self.session, stream) for stream in STREAMS}
            if all(final is not None for final in finals.values()):
                if self._copy_new(rt, sinks):  # settled while we looked: read the rest now
                    continue
                return {
                    s: (self.cursors[s], final)
                    for s, final in finals.items()
                    if final is not None and self.cursors[s] < final
                }
            sleep(LOOK_EVERY_S)

    def _copy_new(self, rt: Runtime, sinks: dict[str, BinaryIO]) -> bool:
        moved = False
        for stream in STREAMS:
            chunk = rt.read(self.session, stream, self.cursors[stream])
            if chunk:
                with _no_interrupt():  # a Ctrl-C lands before or after, never between
                    sink = sinks[stream]
                    write_all(sink, chunk)
                    sink.flush()
                    self.cursors[stream] += len(chunk)
                moved = True
        return moved

    def resume_hint(self) -> str:
        """The command that goes on from exactly here."""
        return (
            f"settled attach {self.session} --from {self.cursors['stdout']} "
            f"--stderr-from {self.cursors['stderr']}"
        )
