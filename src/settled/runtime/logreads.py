"""Reading a session's output: by cursor (`read`, `read_merged`), as it grows (`follow`,
`follow_merged`, woken by a stored byte or the owner's exit), as the model's view (`view`,
`window`), from this home's log or its sealed copy (`_log_file`).

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
    from typing import TypeVar

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

    def _merged_limits(self, session: str) -> tuple[dict[str, int], bool]:
        """The cursors each stream may be served to in the merged view, and whether final
        (settled or recovered: the receipt's cursors, so never past what recovery proved)."""
        finals = {name: self.final_cursor(session, name) for name in ("stdout", "stderr")}
        if all(v is not None for v in finals.values()):
            return {k: int(v or 0) for k, v in finals.items()}, True
        from settled.log.reader import stored_length

        now = {n: stored_length(log_path(self.home, session, n)) for n in ("stdout", "stderr")}
        return now, False

    def read_merged(self, session: str, start: int = 0, size: int = 1 << 20) -> list[Chunk]:
        """Up to ``size`` bytes of both streams in the order the owner stored them, from
        merged cursor ``start`` (a byte offset into the merged view), as chunks tagged with
        stream, stream cursor and merged cursor. A chunk with ``ordered`` False is a tail the
        index did not cover (an old session without one: stdout then stderr). While the
        session runs, only the ordered prefix is served, so every merged cursor resumes."""
        from settled.log import interleave

        grammar.check_cursor("start", start)
        grammar.check_int("size", size, 1, grammar.MAX_CURSOR)
        self.store.get_session(session)
        limits, final = self._merged_limits(session)
        directory = session_dir(self.home, session)
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
        self.store.get_session(session)
        directory = session_dir(self.home, session)
        limits = functools.partial(self._merged_limits, session)
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
        """Where the stream's bytes are read: the home's log, else (a session of another
        host, or a home rebuilt) its sealed copy, rebuilt here and checked by hash first."""
        path = log_path(self.home, session, stream)
        if os.path.exists(path):
            return path
        record = self.store.get_session(session)
        fact = (record.receipt or {}).get("output", {}).get(stream, {})
        sealed = fact.get("sealed")
        if not isinstance(sealed, dict) or "chunks" not in sealed:
            host = self.store.get_task(record.task).host
            if host not in (None, self.host):
                raise LogElsewhere(session, stream, host)
            return path  # this home's, not written yet: an empty stream so far
        from settled.log.seal import fetch_sealed

        dest = os.path.join(self.home, "sealed", session, stream)
        return fetch_sealed(self.workspace.objects, sealed, str(fact["digest"]), dest)

    def stream_log(self, session: str, stream: str) -> StreamLog:
        """The session's ``stream`` log ("stdout" or "stderr"), to read by cursor without a
        Runtime: its reads touch only the file, so an async streamer can poll it from worker
        threads that hold no store. The session is not looked up here."""
        from settled.log.reader import StreamLog as StreamLog  # the type of stream_log()

        _session_stream(session, stream)
        return StreamLog(log_path(self.home, session, stream), stream)
