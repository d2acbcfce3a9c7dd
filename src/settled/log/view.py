"""The model view of a stream: decoded head and tail within a UTF-8 byte budget.

Owns: turning stored bytes ``[start, end)`` of a stream (a window; the whole stream is the
window ``[0, total)``) into text for a model, computed at read time, for every face. If the
whole window decodes within the budget it is returned as is (``errors="replace"``, each U+FFFD
counted as its 3 UTF-8 bytes). Otherwise the budget is split roughly half head, half tail, both
cuts are backed off to UTF-8 character boundaries, and a marker line names the omitted cursor
range exactly: the head shows bytes ``[start, a)``, the tail ``[b, end)``, the marker says
``a..b``. The marker is a template each face words (how to read the omitted bytes there:
``settled logs --from`` on the command line, ``read_output(cursor=...)`` in MCP).

Small budgets: when even the full marker does not fit, the view is only the short marker
``[settled: omitted STREAM bytes START..END]``, cut to ``budget`` bytes if it is longer still.
The returned text, encoded as UTF-8, is never longer than ``budget`` bytes.

Must never: change what is stored; read a whole log (only head and tail, with pread); split on
lines; cut inside a multi-byte UTF-8 sequence; claim an omitted range other than the bytes not
shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from settled.errors import CursorOutOfRange
from settled.log.reader import read_range, stored_length

MARKER = (
    "\n[settled: omitted {stream} bytes {a}..{b} ({n} bytes); "
    "read them with: settled logs {session} --stream {stream} --from {a}]\n"
)
"""The marker of the command line's view; a template over ``stream``, ``a``, ``b``, ``n`` (the
omitted byte count) and ``session``."""


@dataclass(frozen=True)
class Window:
    """Bytes ``[start, end)`` of a stream as text for a model; ``omitted`` is the exact byte
    range not shown (absolute cursors), or None when every byte is in ``text``."""

    text: str
    start: int
    end: int
    omitted: tuple[int, int] | None


def model_view(path: str, budget: int, *, stream: str = "stdout", session: str = "SESSION") -> str:
    """The model view of the whole log at ``path``; reads at most ``2 * budget`` bytes."""
    return read_window(path, 0, stored_length(path), budget, stream, session).text


def read_window(
    path: str,
    start: int,
    end: int,
    budget: int,
    stream: str,
    session: str = "SESSION",
    *,
    marker: str = MARKER,
) -> Window:
    """The view of bytes ``[start, end)`` of the log at ``path`` (``end`` no more than it
    stores); reads at most ``2 * budget`` bytes. A ``start`` outside ``[0, end]`` raises
    :class:`CursorOutOfRange`."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if start < 0 or start > end:
        raise CursorOutOfRange(start, end, stream)
    # Decoding never shrinks bytes, so no more than `budget` bytes of either end can show.
    size = min(end - start, budget)
    head = read_range(path, start, size)
    tail = head if size == end - start else read_range(path, end - size, size)
    return window_view(head, tail, start, end, budget, stream, session, marker=marker)


def render_view(
    head: bytes, tail: bytes, total: int, budget: int, stream: str, *, session: str = "SESSION"
) -> str:
    """Pure: the view of a whole ``total``-byte stream; ``head`` is a prefix and ``tail`` a
    suffix of it (see :func:`window_view`)."""
    return window_view(head, tail, 0, total, budget, stream, session).text


def window_view(
    head: bytes,
    tail: bytes,
    start: int,
    end: int,
    budget: int,
    stream: str,
    session: str = "SESSION",
    *,
    marker: str = MARKER,
) -> Window:
    """Pure: ``head`` is bytes ``[start, ...)`` and ``tail`` bytes ``[..., end)`` of a stream.

    If ``len(head) == end - start`` the head is the whole window. A head or tail shorter than
    its share of the budget simply shows less; the marker stays exact.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if len(head) > end - start or len(tail) > end - start:
        raise ValueError(f"head/tail longer than the stream ({end - start} bytes)")
    if len(head) == end - start:
        whole = head.decode("utf-8", "replace")
        if _size(whole) <= budget:
            return Window(whole, start, end, None)
    # Every number in the marker is <= end, so this bounds the marker actually written.
    longest = marker.format(stream=stream, a=end, b=end, n=end, session=session)
    avail = budget - _size(longest)
    if avail < 0:
        short = f"[settled: omitted {stream} bytes {start}..{end}]"
        return Window(short.encode()[:budget].decode("utf-8", "ignore"), start, end, (start, end))
    shown, head_text = _fit_head(head, avail // 2)
    a = start + shown
    tail_offset = end - len(tail)
    skip, tail_text = _fit_tail(tail, avail - _size(head_text), max(0, a - tail_offset))
    b = tail_offset + skip
    line = marker.format(stream=stream, a=a, b=b, n=b - a, session=session)
    return Window(head_text + line + tail_text, start, end, (a, b))


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80


def _head_boundary(data: bytes, end: int) -> int:
    """Back ``end`` off so that ``data[:end]`` does not stop inside a multi-byte sequence."""
    for k in range(1, min(4, end) + 1):
        byte = data[end - k]
        if byte < 0x80:
            return end
        if byte >= 0xC0:  # a lead byte: is its sequence complete before `end`?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return end - k if need > k else end
    return end  # only continuation bytes (invalid anyway): no character to protect


def _tail_boundary(data: bytes, start: int) -> int:
    """Move ``start`` forward past continuation bytes of a sequence that began before it."""
    for _ in range(3):
        if start >= len(data) or not _is_continuation(data[start]):
            break
        start += 1
    return start


def _fit_head(data: bytes, limit: int) -> tuple[int, str]:
    """The longest-ish prefix ``data[:a]`` whose decoded text fits ``limit`` bytes."""
    end = _head_boundary(data, min(len(data), limit))
    while True:
        text = data[:end].decode("utf-8", "replace")
        excess = _size(text) - limit
        if excess <= 0:
            return end, text
        end = _head_boundary(data, max(0, end - excess))  # U+FFFD expansion: shrink, retry


def _fit_tail(data: bytes, limit: int, min_start: int) -> tuple[int, str]:
    """The longest-ish suffix ``data[s:]`` (``s >= min_start``) whose text fits ``limit`` bytes."""
    start = _tail_boundary(data, max(min_start, len(data) - limit))
    while True:
        text = data[start:].decode("utf-8", "replace")
        excess = _size(text) - limit
        if excess <= 0:
            return start, text
        start = _tail_boundary(data, min(len(data), start + excess))
