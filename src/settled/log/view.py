"""The model view of a stream: decoded head and tail within a UTF-8 byte budget.

Owns: turning a stored byte stream into text for a model, computed at read time. If the whole
stream decodes within the budget it is returned as is (``errors="replace"``, each U+FFFD counted
as its 3 UTF-8 bytes). Otherwise the budget is split roughly half head, half tail, both cuts are
backed off to UTF-8 character boundaries, and a marker line names the omitted cursor range
exactly: the head shows bytes ``[0, a)``, the tail ``[b, total)``, the marker says ``a..b``.

Small budgets: when even the full marker does not fit, the view is only the short marker
``[settled: omitted STREAM bytes 0..TOTAL]``, cut to ``budget`` bytes if it is longer still.
The returned text, encoded as UTF-8, is never longer than ``budget`` bytes.

Must never: change what is stored; read a whole log (only head and tail, with pread); split on
lines; cut inside a multi-byte UTF-8 sequence; claim an omitted range other than the bytes not
shown.
"""

from __future__ import annotations

import os

from settled.log.reader import pread_exact


def model_view(path: str, budget: int, *, stream: str = "stdout", session: str = "SESSION") -> str:
    """The model view of the log at ``path``; reads at most ``2 * budget`` bytes from disk."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return render_view(b"", b"", 0, budget, stream, session=session)
    try:
        total = os.fstat(fd).st_size
        # Decoding never shrinks bytes, so no more than `budget` bytes of either end can show.
        size = min(total, budget)
        head = pread_exact(fd, 0, size)
        tail = head if size == total else pread_exact(fd, total - size, size)
    finally:
        os.close(fd)
    return render_view(head, tail, total, budget, stream, session=session)


def render_view(
    head: bytes, tail: bytes, total: int, budget: int, stream: str, *, session: str = "SESSION"
) -> str:
    """Pure: ``head`` is a prefix and ``tail`` a suffix of a ``total``-byte stream.

    If ``len(head) == total`` the head is the whole stream. A head or tail shorter than its
    share of the budget simply shows less; the marker stays exact.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if len(head) > total or len(tail) > total:
        raise ValueError(f"head/tail longer than the stream ({total} bytes)")
    if len(head) == total:
        whole = head.decode("utf-8", "replace")
        if _size(whole) <= budget:
            return whole
    # Every number in the marker is <= total, so this bounds the marker actually written.
    longest = _MARKER.format(stream=stream, a=total, b=total, n=total, session=session)
    avail = budget - _size(longest)
    if avail < 0:
        short = f"[settled: omitted {stream} bytes 0..{total}]"
        return short.encode()[:budget].decode("utf-8", "ignore")
    a, head_text = _fit_head(head, avail // 2)
    tail_offset = total - len(tail)
    start, tail_text = _fit_tail(tail, avail - _size(head_text), max(0, a - tail_offset))
    b = tail_offset + start
    return head_text + _marker(stream, a, b, session) + tail_text


_MARKER = (
    "\n[settled: omitted {stream} bytes {a}..{b} ({n} bytes); "
    "read them with: settled logs {session} --stream {stream} --from {a}]\n"
)


def _marker(stream: str, a: int, b: int, session: str) -> str:
    return _MARKER.format(stream=stream, a=a, b=b, n=b - a, session=session)


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
