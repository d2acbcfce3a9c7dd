"""What a SWE-ReX answer carries of a settled session's streams: all of it, or a cut it names.

Owns: reading a settled stream for `settled serve --swerex`: the whole of it up to a cap
(``SETTLED_SWEREX_OUTPUT_CAP`` bytes, default 64 MiB); past the cap its head and its tail, cut
at UTF-8 character boundaries, with a marker line between them naming the omitted byte range,
the stream's length and the session whose log holds it all; and a marker line when the owner
drained bytes it did not store (the home's log cap or reserve; the receipt counts them).

Must never: cut silently; read more than twice the cap of a stream.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping
from typing import Any

from settled.errors import BadInput
from settled.runtime import Runtime

OUTPUT_CAP_ENV = "SETTLED_SWEREX_OUTPUT_CAP"
DEFAULT_OUTPUT_CAP = 64 << 20
REPORT_TAIL = 1 << 20  # the state report is read from at most the last MiB of its stream


def output_cap(environ: Mapping[str, str]) -> int:
    """The per-stream output cap of an answer, from ``SETTLED_SWEREX_OUTPUT_CAP`` (bytes)."""
    text = environ.get(OUTPUT_CAP_ENV, "").strip()
    if not text:
        return DEFAULT_OUTPUT_CAP
    if not text.isdigit() or int(text) < 4096:
        raise BadInput(f"{OUTPUT_CAP_ENV}={text!r}: give a number of bytes, at least 4096")
    return int(text)


def stream_text(
    runtime: Runtime, session: str, stream: str, status: dict[str, Any], errors: str, cap: int
) -> str:
    """The stream whole up to the cap, else its head and tail with a marker naming what is
    omitted; and a marker when the owner drained bytes it did not store."""
    end = runtime.final_cursor(session, stream) or 0
    if end <= cap:
        text = runtime.read(session, stream, 0, end).decode(errors=errors) if end else ""
    else:
        half = cap // 2
        head = _head_text(runtime.read(session, stream, 0, half), errors)
        tail = _tail_text(runtime.read(session, stream, end - half, half), errors)
        text = (
            f"{head}\n[settled: omitted {stream} bytes {half}..{end - half} of {end} "
            f"(the answer's cap is {cap} bytes); the whole stream is session "
            f"{session}'s log on the server]\n{tail}"
        )
    fact = ((status.get("receipt") or {}).get("output") or {}).get(stream) or {}
    lost = int(fact.get("not_stored") or 0) + int(fact.get("dropped") or 0)
    if lost:
        text += f"\n[settled: {lost} more bytes of {stream} were drained but not stored]\n"
    return text


def report_tail(runtime: Runtime, session: str) -> bytes:
    """The end of the stderr stream, where an action's state report is (at most REPORT_TAIL)."""
    end = runtime.final_cursor(session, "stderr") or 0
    start = max(0, end - REPORT_TAIL)
    return runtime.read(session, "stderr", start, end - start) if end > start else b""


def _head_text(data: bytes, errors: str) -> str:
    """A prefix as text, a multi-byte character cut at its end left out."""
    return codecs.getincrementaldecoder("utf-8")(errors).decode(data, final=False)


def _tail_text(data: bytes, errors: str) -> str:
    """A suffix as text, the continuation bytes of a character cut at its start left out."""
    skip = 0
    while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:
        skip += 1
    return data[skip:].decode(errors=errors)
