"""Sparse files: where a file's data lies, and the digest of its holes without reading them.

Owns ``data_ranges`` (the data extents of an open file, found with ``SEEK_DATA``/``SEEK_HOLE``,
or None when the file has no hole worth recording), ``hash_zeros`` (feeding a hole's zeros to a
hasher from one shared zero buffer: no read, no page fault), and ``logical_digest`` (the digest
of a sparse entry's full content, from its extent blobs and its holes).

Why the digest is the hash of the logical bytes (holes as zeros): a file's ``digest`` names its
content, whether the filesystem stores it sparse or dense, so two equal files hash equal and a
dense file's entry is exactly what it always was. BLAKE3 mixes every chunk's position into its
hash, so the hash of a hole cannot be looked up; it is computed, at memory speed and without
I/O (5-10 GiB/s here on two cores, so ~1-2 s of CPU for a 10 GiB hole), while the bytes read
and the bytes stored follow the data only. A digest over the extent list would cost nothing
for the hole, but a sparse and a dense copy of one content would then differ.

Which holes are recorded: those of at least ``MIN_HOLE`` bytes (a smaller hole is stored as
the zeros it reads as: an extent costs an object and a line of its tree, more than the hole
saves), and at most ``MAX_EXTENTS`` extents a file (past that, the smallest holes are merged
into data until it fits, so a hostile file of a million 4 KiB holes costs one tree line per
kept extent, not a million). A file whose ``st_blocks`` cover its size, less ``MIN_HOLE``,
is not even probed: it is read dense, as it always was.

The holes' budget (``holes_budget``): a hole costs its maker nothing (``truncate -s 16T``) and
its hash ~1 s of two cores per 17 GiB here, so one command could make a close hash for 16 min
per file, and for hours with a few. A scan therefore hashes at most ``DEFAULT_HOLES_BUDGET``
bytes a file does not have on disk (its size past its allocated blocks: holes, whether found by
``SEEK_DATA`` or read as zeros on a filesystem that cannot say), and refuses the file that would
pass it, naming it; ``SETTLED_MAX_HOLE_BYTES`` sets another budget.

Must never: report as a hole a range that holds data (only what the kernel calls a hole is
one); read a hole; do anything but ``lseek`` on the file it is given.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from functools import cache
from typing import Final

from settled.errors import BadInput
from settled.objects import CHUNK, ObjectMissing, ObjectStore
from settled.objects.hashing import Hasher, format_digest, new_hasher

MIN_HOLE: Final = 64 << 10
MAX_EXTENTS: Final = 1024
ZERO_CHUNK: Final = 4 << 20
HOLES_BUDGET_ENV: Final = "SETTLED_MAX_HOLE_BYTES"
DEFAULT_HOLES_BUDGET: Final = 1 << 40  # 1 TiB of holes a scan: ~1 min of two cores here

Range = tuple[int, int]  # (offset, length) of data
Extent = tuple[int, int, str]  # (offset, length, digest of those bytes)


@cache
def _zeros() -> memoryview:
    """One zero buffer for every hole (calloc'd: its pages are the kernel's zero page)."""
    return memoryview(bytes(ZERO_CHUNK))


def hash_zeros(hasher: Hasher, count: int) -> None:
    """Feed ``count`` zero bytes to ``hasher``, without reading or allocating them."""
    zeros = _zeros()
    while count > 0:
        step = min(count, ZERO_CHUNK)
        hasher.update(zeros[:step])
        count -= step


def holes_budget() -> int:
    """Bytes of holes one scan may hash: ``SETTLED_MAX_HOLE_BYTES`` if set, else the default."""
    return budget_from_env(HOLES_BUDGET_ENV, DEFAULT_HOLES_BUDGET, 0, "bytes")


def budget_from_env(name: str, default: int, least: int, unit: str) -> int:
    """A scan's budget: the whole number in the environment variable ``name`` if it is set
    (``BadInput`` naming it if it is not a whole number of at least ``least``), else
    ``default``. The holes budget's and the entries budget's (``scanerrors.entries_budget``)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        budget = int(raw)
    except ValueError:
        budget = least - 1
    if budget < least:
        raise BadInput(f"{name}={raw!r}: expected a whole number of {unit}, {least} or more")
    return budget


def unallocated(st: os.stat_result) -> int:
    """What a file's hash would read that it does not have on disk: its size past its blocks."""
    return max(0, st.st_size - st.st_blocks * 512)


def may_have_holes(st: os.stat_result) -> bool:
    """Whether a regular file's allocation leaves room for a hole worth recording."""
    return st.st_size >= MIN_HOLE and st.st_blocks * 512 <= st.st_size - MIN_HOLE


def data_ranges(fd: int, size: int) -> list[Range] | None:
    """The data extents of the open file of ``size`` bytes, holes under ``MIN_HOLE`` merged
    into data; None if no hole is left (or the filesystem cannot say): read it dense. Leaves
    the file's offset at 0, where a dense read starts."""
    try:
        found = _probe(fd, size)
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    if found is None:
        return None
    threshold = MIN_HOLE
    merged = _merge(found, size, threshold)
    while len(merged) > MAX_EXTENTS:
        threshold *= 2
        merged = _merge(merged, size, threshold)
    if sum(length for _, length in merged) >= size:
        return None
    return merged


def _probe(fd: int, size: int) -> list[Range] | None:
    """Every data extent the kernel reports below ``size``; None if it cannot report holes."""
    ranges: list[Range] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as error:
                if error.errno == errno.ENXIO:  # no data past pos: the rest is a hole
                    break
                raise
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            if end <= start:  # the file changed under the probe: the read will notice
                return None
            ranges.append((start, end - start))
            pos = end
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENXIO):
            return None  # a filesystem without SEEK_DATA: no hole is known, read it all
        raise
    return ranges


def _merge(ranges: Iterable[Range], size: int, threshold: int) -> list[Range]:
    """Merge every hole under ``threshold`` (leading and trailing ones too) into data."""
    out: list[list[int]] = []
    for offset, length in ranges:
        if out and offset - (out[-1][0] + out[-1][1]) < threshold:
            out[-1][1] = offset + length - out[-1][0]
        elif not out and offset < threshold:
            out.append([0, offset + length])
        else:
            out.append([offset, length])
    if out and size - (out[-1][0] + out[-1][1]) < threshold:
        out[-1][1] = size - out[-1][0]
    return [(offset, length) for offset, length in out]


def logical_digest(
    store: ObjectStore, algo: str, size: int, extents: Iterable[Extent]
) -> str | None:
    """What a sparse file of ``size`` bytes with ``extents`` hashes to in ``algo``, holes as
    zeros, its extents' bytes read from the store (None if one is missing). Each extent's own
    digest is the caller's to check; a blob of the wrong length shifts what follows, so the
    result differs then too."""
    hasher = new_hasher(algo, size_hint=size)
    pos = 0
    for offset, length, digest in extents:
        hash_zeros(hasher, offset - pos)
        try:
            source = store.open(digest)
        except ObjectMissing:
            return None
        with source:
            while data := source.read(CHUNK):
                hasher.update(data)
        pos = offset + length
    hash_zeros(hasher, size - pos)
    return format_digest(algo, hasher.hexdigest())
