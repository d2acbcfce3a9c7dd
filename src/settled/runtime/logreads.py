"""Reading a session's output: by cursor (`read`, `read_merged`), as it grows (`follow`,
`follow_merged`, woken by a stored byte or the owner's exit), as the model's view (`view`,
`window`), from this home's log or its sealed copy (`_log_dir`: any host reads a sealed session;
another host's unsealed one is LogElsewhere, never an empty read).

Must never: serve a byte past a stream's final cursor once settled (the receipt's, so never past
what recovery proved), nor, while a session runs, a merged cursor that could not resume.
"""

from __future__ import annotations

import contextlib
import functools
import os

from settled import grammar
from settled.errors import LogElsewhere
from settled.home import log_path, session_dir
from settled.runtime.composition import MAX_WAIT, Composition
from settled.sessions import WAKE_BOUND_S

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any, TypeVar

    from settled.log.interleave import Chunk
    from settled.log.reader import StreamLog
    from settled.log.view import Window

    _T = TypeVar("_T")


STREAMS = ("stdout", "stderr")


def _session_stream(session: str, stream: str) -> str:
    """The session id, once it and the stream name are inside their grammar (a stream name
    is part of a log's path)."""
    grammar.check_choice("stream", stream, STREAMS)
    return grammar.check_id("session", session)


class LogReads(Composition):
    """The Runtime's reads of the sessions' output."""

    def final_cursor(self, session: str, stream: str) -> int | None:
        """The stream's final cursor once the session settled; None while it may still grow."""
        record = self.store.get_session(_session_stream(session, stream))
        if record.receipt is not None:
            return int(record.receipt["output"][stream]["cursor"])
        if not record.live:
            from settled.log.reader import stored_length

            return stored_length(log_path(self.home, session, stream))
        return None

    def read(self, session: str, stream: str, start: int = 0, size: int = 1 << 20) -> bytes:
        """Up to ``size`` stored bytes of the stream from cursor ``start`` (CursorOutOfRange
        past what is stored)."""
        grammar.check_cursor("start", start)
        grammar.check_int("size", size, 1, grammar.MAX_CURSOR)
        from settled.log.reader import read_range

        final = self.final_cursor(_session_stream(session, stream), stream)  # bounds the read
        return read_range(self._log_file(session, stream), start, size, final)

    def follow(
        self, session: str, stream: str, start: int = 0, timeout: float | None = None
    ) -> Iterator[bytes]:
        """The stream from cursor ``start`` as it grows, ending exactly at its final cursor;
        ``timeout`` bounds the whole follow (TimeoutError names the cursor reached)."""
        from settled.log.reader import follow

        grammar.check_cursor("start", start)
        timeout = grammar.optional_seconds("timeout", timeout, MAX_WAIT)
        self.store.get_session(_session_stream(session, stream))
        path = self._log_file(session, stream)
        final = functools.partial(self.final_cursor, session, stream)
        return self._woken(session, lambda pause: follow(
            path, start, final, timeout=timeout, sleep=pause,
            poll_interval=WAKE_BOUND_S))  # fmt: skip

    def _merged_limits(self, session: str, directory: str) -> tuple[dict[str, int], bool]:
        """The cursors each stream may be served to in the merged view, and whether final
        (settled or recovered: the receipt's cursors, so never past what recovery proved)."""
        finals = {name: self.final_cursor(session, name) for name in STREAMS}
        if all(v is not None for v in finals.values()):
            return {k: int(v or 0) for k, v in finals.items()}, True
        from settled.log.reader import stored_length

        now = {n: stored_length(os.path.join(directory, f"{n}.log")) for n in STREAMS}
        return now, False

    def read_merged(self, session: str, start: int = 0, size: int = 1 << 20) -> list[Chunk]:
        """Up to ``size`` bytes of both streams in the order the owner stored them, from
        merged cursor ``start`` (a byte offset into the merged view), as chunks tagged with
        stream, stream cursor and merged cursor. A chunk with ``ordered`` False is a tail the
        index did not cover (an old session without one, or a sealed copy read on another
        host: stdout then stderr). While the session runs, only the ordered prefix is served,
        so every merged cursor resumes."""
        from settled.log import interleave

        grammar.check_cursor("start", start)
        grammar.check_int("size", size, 1, grammar.MAX_CURSOR)
        directory = self._log_dir(grammar.check_id("session", session), STREAMS)
        limits, final = self._merged_limits(session, directory)
        if not final:
            limits = interleave.ordered_limits(directory, limits)
        return interleave.read_merged(directory, limits, start, size)

    def follow_merged(
        self, session: str, start: int = 0, timeout: float | None = None
    ) -> Iterator[Chunk]:
        """The merged view from merged cursor ``start`` as it grows, ending at both final
        cursors; ``timeout`` bounds the whole follow."""
        from settled.log import interleave

        grammar.check_cursor("start", start)
        timeout = grammar.optional_seconds("timeout", timeout, MAX_WAIT)
        directory = self._log_dir(grammar.check_id("session", session), STREAMS)
        limits = functools.partial(self._merged_limits, session, directory)
        return self._woken(session, lambda pause: interleave.follow_merged(
            directory, limits, start, timeout=timeout, sleep=pause,
            poll_interval=WAKE_BOUND_S))  # fmt: skip

    def _woken(
        self, session: str, make: Callable[[Callable[[float], None]], Iterator[_T]]
    ) -> Iterator[_T]:
        """A follow whose pauses end when a byte is stored or the session's owner exits
        (checked eagerly by the caller; this generator only runs it), so new bytes and the end
        of a stream are seen at once."""
        with self.pauses(session) as pause:
            yield from make(pause)

    @contextlib.contextmanager
    def pauses(self, session: str) -> Iterator[Callable[[float], None]]:
        """A sleep for whoever follows the session's output, `pause(seconds)`: it wakes at once
        when a byte is stored in the session's log (an inotify watch, log/watch.py) and when
        the session's owner exits, so a relay sees output and the end of a command then, not
        at a poll (sessions.pauses); `seconds` bounds it. Where neither can be watched, it polls."""
        from settled.log.watch import LogWatch  # ctypes only once a follower first waits

        watch = LogWatch(session_dir(self.home, grammar.check_id("session", session)))
        try:
            with self.sessions.pauses(session, wake=watch) as pause:
                yield pause
        finally:
            watch.close()

    def view(self, session: str, stream: str, budget: int) -> str:
        """The model view of everything stored of the stream, within ``budget`` UTF-8 bytes,
        its marker naming the omitted range as ``settled logs --from`` reads it."""
        grammar.check_int("budget", budget, 0, grammar.MAX_BUDGET)
        return self.window(_session_stream(session, stream), stream, 0, budget)[0].text

    def window(
        self, session: str, stream: str, cursor: int, budget: int, *, marker: str | None = None
    ) -> tuple[Window, bool]:
        """The model view of the stream from ``cursor`` to what exists now (its final cursor
        once settled, else the bytes stored), within ``budget`` UTF-8 bytes; and whether that
        end is the final cursor. ``marker`` words the line naming the omitted range (a
        template over stream, a, b, n and session; default ``log.view.MARKER``). Reads at
        most ``2 * budget`` bytes; a cursor past the end raises CursorOutOfRange."""
        from settled.log.reader import stored_length
        from settled.log.view import MARKER, read_window

        grammar.check_cursor("cursor", cursor)
        grammar.check_int("budget", budget, 0, grammar.MAX_BUDGET)
        final = self.final_cursor(session, stream)
        path = self._log_file(session, stream)
        end = final if final is not None else stored_length(path)
        view = read_window(path, cursor, end, budget, stream, session, marker=marker or MARKER)
        return view, final == end

    def _log_file(self, session: str, stream: str) -> str:
        """Where the stream's bytes are read (`_log_dir`)."""
        return os.path.join(self._log_dir(session, (stream,)), f"{stream}.log")

    def _log_dir(self, session: str, streams: tuple[str, ...]) -> str:
        """The directory whose `<stream>.log` files hold `streams`: the home's logs; else (a
        session of another host, or a home rebuilt) their sealed copies, rebuilt under
        `HOME/sealed/<session>/` and checked by hash against the receipt's digests first;
        else, for a session of another host (running, unknown, or its seal failed),
        LogElsewhere. A session of this host whose logs are not written yet reads as empty."""
        if all(os.path.exists(log_path(self.home, session, s)) for s in streams):
            return session_dir(self.home, session)
        from settled.receipts import sealed_copy

        record = self.store.get_session(session)
        recorded = self.store.log_seals(record.task, session).get(session, {})
        copies = {s: sealed_copy(record.receipt, recorded, s) for s in streams}
        missing = [s for s, copy in copies.items() if copy is None]
        if not missing and record.receipt is not None:
            return self._rebuilt(session, record.receipt, copies)
        host = self.store.get_task(record.task).host
        if missing and host not in (None, self.host):
            raise LogElsewhere(session, missing[0], host)
        return session_dir(self.home, session)  # this home's, not written yet: empty so far

    def _rebuilt(
        self, session: str, receipt: dict[str, Any], copies: dict[str, dict[str, Any] | None]
    ) -> str:
        """Each sealed copy rebuilt once into `HOME/sealed/<session>/<stream>.log`, every
        chunk and the whole checked against the receipt's digest (log/seal.py)."""
        from settled.log.seal import fetch_sealed

        directory = os.path.join(self.home, "sealed", session)
        for stream, sealed in copies.items():
            assert sealed is not None
            digest = str(receipt["output"][stream]["digest"])
            dest = os.path.join(directory, f"{stream}.log")
            fetch_sealed(self.workspace.objects, sealed, digest, dest)
        index = (copies.get("stdout") or {}).get("index")
        if index is not None:
            self._rebuilt_index(directory, str(index))
        return directory

    def _rebuilt_index(self, directory: str, name: str) -> None:
        """The sealed interleave index beside the rebuilt logs (once), checked against its
        name: the merged view elsewhere keeps the owner's order. The index decides only the
        order of bytes the receipt's digests cover (log/interleave.pieces)."""
        from settled.atomic import replacing
        from settled.log.interleave import index_path
        from settled.log.seal import SealBroken
        from settled.objects.hashing import algorithm_of, digest_bytes

        dest = index_path(directory)
        if os.path.exists(dest):
            return
        data = self.workspace.objects.read(name)
        if digest_bytes(algorithm_of(name), data) != name:
            raise SealBroken(f"the sealed interleave index {name} is damaged")
        with replacing(dest, 0o400) as out:
            out.write(data)

    def stream_log(self, session: str, stream: str) -> StreamLog:
        """The session's ``stream`` log ("stdout" or "stderr"), to read by cursor without a
        Runtime: its reads touch only the file, so an async streamer can poll it from worker
        threads that hold no store. The session is looked up only when the home holds no log
        of it (another host's: its sealed copy, or LogElsewhere)."""
        from settled.log.reader import StreamLog as StreamLog  # the type of stream_log()

        _session_stream(session, stream)
        path = log_path(self.home, session, stream)
        if not os.path.exists(path):  # another host's session: its sealed copy, or LogElsewhere
            path = self._log_file(session, stream)
        return StreamLog(path, stream)
