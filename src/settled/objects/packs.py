"""Packs: many small objects of the local store in one file, made visible by an index written last.

Owns the pack format: ``PackWriter`` (a publish group's small objects appended to one pack
file, then made durable and visible by ``finish``), ``PackIndex`` (one pack's index: read,
checked against its own hash, searched) and ``Packs`` (the packs of one store: which holds a
digest, and taking one object's name away for the quarantine). ``local.LocalObjectStore``
uses them for the objects a group stages; everything else sees only the ``ObjectStore``
protocol, whose every guarantee holds for a packed object as for a loose one.

Why. This machine's ext4 runs without a journal, and its inode allocator skips every inode freed
in the last 60 s (360 s while its table block is dirty), reading each one's table entry: with
other people deleting files, creating one file cost 14-450 us, and the first checkpoint of
100,000 small files spent ~40% of its time in ``ext4_create`` (one temp file an object, then a
link and an unlink). A pack is one file per group, whatever its size; its durability is one
fsync of the pack, one of the index and one of the directory (no ``syncfs``, which flushed
everybody's dirty pages); and a read-back re-reads objects from one file.

Layout, in ``<root>/packs/``: ``<name>.pack`` holds the objects' bytes back to back and nothing
else; ``<name>.idx`` names them: ``MAGIC``, a header (count, fan-out bits, pack size), a fan-out
table of ``2**bits + 1`` counts (records whose digest's top ``bits`` bits are below each
value), the sorted keys (32 digest bytes and an algorithm byte each), their locations (offset,
size) and the BLAKE3 hash of everything before it. The pack is written and fsynced first, then
the index (written in ``<root>/tmp``, fsynced, linked under its name), then the directory is
fsynced: an object is named only once the bytes holding it are durable, and a crash before the
link leaves a pack that nothing names. An index is never rewritten, except by ``Packs.drop``,
which replaces it with one that no longer names a quarantined object.

Must never: name an object before the pack bytes holding it are durable; trust an index that
does not hash to its trailer, or a location outside its pack; replace an index except to take
a quarantined object's name away; read anything but a regular file, never following a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import os
import secrets
import stat
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final

import blake3

from settled import faults
from settled.errors import SettledError
from settled.objects import (
    CHUNK,
    DurabilityError,
    ObjectMissing,
    ObjectUnreadable,
    Reread,
    Stamp,
)
from settled.objects.hashing import (
    ALGORITHMS,
    BLAKE3,
    format_digest,
    new_hasher,
    parse_digest,
)

PACKS_DIR: Final = "packs"
DICT_KEYS: Final = 500_000  # keys looked up by a dictionary (~70 MB); past it, by searching
_SLOT_SHIFT: Final = 40
_RECORD_MASK: Final = (1 << _SLOT_SHIFT) - 1
MAGIC: Final = b"STLPIDX1"
_HEADER: Final = struct.Struct("<8sIB3xQ")  # magic, count, fan-out bits, pack size
_LOCATION: Final = struct.Struct("<QQ")  # offset, size
_KEY: Final = 33  # the digest's 32 bytes, then its algorithm's number
_TRAILER: Final = 32
_ALGO_BYTE: Final = {algo: number for number, algo in enumerate(ALGORITHMS, start=1)}
_ALGO_OF: Final = {number: algo for algo, number in _ALGO_BYTE.items()}
_ALGO_BYTES: Final = {algo: bytes((number,)) for algo, number in _ALGO_BYTE.items()}
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class PackUnusable(SettledError):
    """An index that is not one (wrong magic, wrong size, or not what its trailer hashes to)."""


def key_of(digest: str) -> bytes:
    """The index key of a digest (``hashing.BadDigest`` if it is not one)."""
    return key_from(*parse_digest(digest))


def key_from(algo: str, hexdigest: str) -> bytes:
    return bytes.fromhex(hexdigest) + _ALGO_BYTES[algo]


def digest_of(key: bytes) -> str:
    return format_digest(_ALGO_OF[key[32]], key[:32].hex())


def _fsync(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as error:
        raise DurabilityError(path, error) from error


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _fsync(fd, path)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray | memoryview, path: str) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as error:
        raise DurabilityError(path, error) from error


Identity = tuple[int, int, int, int, int]  # dev, ino, size, mtime_ns, ctime_ns


def identity_of(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class PackIndex:
    """One pack's index, as read (and checked) from its file with that file's identity."""

    name: str
    pack_size: int
    bits: int
    fanout: array[int]
    keys: bytes
    locations: memoryview
    identity: Identity  # of the index file when it was read

    @property
    def count(self) -> int:
        return len(self.keys) // _KEY

    def find(self, key: bytes) -> tuple[int, int] | None:
        """(offset, size) of the object with this key, or None."""
        record = self.record(key)
        return None if record is None else self.location(record)

    def record(self, key: bytes) -> int | None:
        """The number of the record naming ``key``, or None."""
        bucket = int.from_bytes(key[:2], "big") >> (16 - self.bits)
        start, end = self.fanout[bucket] * _KEY, self.fanout[bucket + 1] * _KEY
        at = self.keys.find(key, start, end)
        while at >= 0 and at % _KEY:  # a match across two keys is no match
            at = self.keys.find(key, at + 1, end)
        return None if at < 0 else at // _KEY

    def location(self, record: int) -> tuple[int, int]:
        offset, size = _LOCATION.unpack_from(self.locations, record * _LOCATION.size)
        return int(offset), int(size)

    def digests(self) -> Iterator[str]:
        for key in self.keys_():
            yield digest_of(key)

    def keys_(self) -> Iterator[bytes]:
        keys = self.keys
        for at in range(0, len(keys), _KEY):
            yield keys[at : at + _KEY]


def index_bytes(records: dict[bytes, tuple[int, int]], pack_size: int) -> bytes:
    """An index of ``records`` (key -> offset, size) in a pack of ``pack_size`` bytes."""
    keys = sorted(records)
    bits = max(8, min(16, (len(keys) - 1).bit_length()))
    shift = 16 - bits
    counts = [0] * ((1 << bits) + 1)
    for key in keys:  # each key counted in the bucket after its own: the table is cumulative
        counts[((key[0] << 8 | key[1]) >> shift) + 1] += 1
    fanout = array("I", itertools.accumulate(counts))
    locations = struct.pack(f"<{2 * len(keys)}Q", *itertools.chain.from_iterable(
        records[key] for key in keys
    ))  # fmt: skip
    header = _HEADER.pack(MAGIC, len(keys), bits, pack_size)
    body = b"".join((header, _little(fanout).tobytes(), *keys, locations))
    return body + blake3.blake3(body).digest()


def parse_index(name: str, data: bytes, identity: Identity) -> PackIndex:
    if len(data) < _HEADER.size + _TRAILER or data[:8] != MAGIC:
        raise PackUnusable(f"pack index {name!r} is not one (no {MAGIC!r} header)")
    body, trailer = data[:-_TRAILER], data[-_TRAILER:]
    if blake3.blake3(body).digest() != trailer:
        raise PackUnusable(f"pack index {name!r} does not hash to its trailer")
    _, count, bits, pack_size = _HEADER.unpack_from(data)
    if not 8 <= bits <= 16:
        raise PackUnusable(f"pack index {name!r} has {bits} fan-out bits")
    fanout_end = _HEADER.size + 4 * ((1 << bits) + 1)
    keys_end = fanout_end + count * _KEY
    if len(body) != keys_end + count * _LOCATION.size:
        raise PackUnusable(f"pack index {name!r} is not the size its count says")
    fanout = array("I")
    fanout.frombytes(data[_HEADER.size : fanout_end])
    fanout = _little(fanout)
    if fanout[0] != 0 or fanout[-1] != count:  # a bucket out of order only finds nothing
        raise PackUnusable(f"pack index {name!r} has a fan-out table that does not add up")
    locations = memoryview(data)[keys_end : len(body)]
    for offset, size in _LOCATION.iter_unpack(locations):
        if offset + size > pack_size:
            raise PackUnusable(f"pack index {name!r} names bytes past the end of its pack")
    return PackIndex(name, pack_size, bits, fanout, data[fanout_end:keys_end], locations, identity)


def _little(values: array[int]) -> array[int]:
    if array("I", [1]).tobytes()[0] != 1:  # a big-endian machine: the file is little-endian
        values.byteswap()
    return values


@functools.cache
def _writeback() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)`` (libc's, through ctypes:
    Python has no binding), or None where there is none: a pack is then written to disk by its
    fsync alone, as durable and later. Loaded at the first full buffer, not at import."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int

    def start(fd: int, offset: int, length: int) -> None:
        if call(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return start


_SYNC_FILE_RANGE_WRITE: Final = 2  # start writing the range's dirty pages; wait for nothing


_BUFFER_SIZE: Final = 2 * CHUNK  # flushed from CHUNK on, and an object is at most a chunk
_spare_buffers: list[bytearray] = []  # at most one, kept for the next writer (2 MiB)
_spare_lock = threading.Lock()


def _take_buffer() -> bytearray:
    with _spare_lock:
        if _spare_buffers:
            return _spare_buffers.pop()
    return bytearray(_BUFFER_SIZE)


def _give_back(buffer: bytearray) -> None:
    """A writer's buffer, kept for the next one: its pages stay mapped, so filling it again
    costs no page fault (a close's first checkpoint fills ~4 MiB of it)."""
    with _spare_lock:
        if not _spare_buffers:
            _spare_buffers.append(buffer)


class PackWriter:
    """One pack being written: ``add`` objects (each once), then ``finish`` or ``discard``."""

    def __init__(self, packs_dir: str, temp_dir: str) -> None:
        self.packs_dir, self.temp_dir = packs_dir, temp_dir
        self.name = f"pack-{secrets.token_hex(16)}"
        self.path = os.path.join(packs_dir, f"{self.name}.pack")
        self._fd: int | None = os.open(self.path, _WRITE_FLAGS, 0o600)
        self._buffer = _take_buffer()
        self._view = memoryview(self._buffer)
        self._filled = 0  # bytes of the buffer added since the last flush
        self._size = 0
        self.records: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def add(self, key: bytes, data: bytes | bytearray | memoryview) -> bool:
        """Append an object's bytes (hashed to ``key`` by the caller); False if already added."""
        try:
            faults.point("checkpoint.blob_write")  # as for every object a store writes
        except OSError as error:
            raise DurabilityError(self.path, error) from error
        with self._lock:
            if key in self.records or self._fd is None:
                return False
            size = len(data)
            self.records[key] = (self._size, size)
            if self._filled + size > len(self._buffer):  # no room: write what is there first
                self._flush()
            if size > len(self._buffer):
                _write_all(self._fd, data, self.path)
            else:
                self._view[self._filled : self._filled + size] = data
                self._filled += size
            self._size += size
            if self._filled >= CHUNK:
                self._flush()
            return True

    def _flush(self, *, last: bool = False) -> None:
        """Write the buffer out (one reused for the writer's life, and kept for the next
        writer: a buffer grown and freed per chunk took a page fault for every 4 KiB object
        added); unless it is the last, ask the kernel to start writing it to
        disk now (``_writeback``), so the fsync at ``finish`` waits for the rest only: a first
        checkpoint's pack is ~4 MiB, whose fsync alone took ~3 ms here. Only that fsync makes
        anything durable; the hint, refused, changes nothing but the wait."""
        assert self._fd is not None
        filled, self._filled = self._filled, 0
        if filled == 0:
            return
        start = self._size - filled
        _write_all(self._fd, self._view[:filled], self.path)
        hint = None if last else _writeback()
        if hint is not None:
            with contextlib.suppress(OSError):
                hint(self._fd, start, filled)

    def finish(self) -> PackIndex:
        """Make every added object durable, then visible: pack fsynced, index written, fsynced
        and linked, directory fsynced. Raises ``DurabilityError`` (nothing named) on failure."""
        with self._lock:
            assert self._fd is not None
            self._flush(last=True)
            self._release_buffer()
            os.fchmod(self._fd, 0o400)
            _fsync(self._fd, self.path)
            os.close(self._fd)
            self._fd = None
            data = index_bytes(self.records, self._size)
            temp = os.path.join(self.temp_dir, f"{os.getpid()}.{secrets.token_hex(8)}.idx")
            fd = os.open(temp, _WRITE_FLAGS, 0o400)
            try:
                _write_all(fd, data, temp)
                _fsync(fd, temp)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            try:
                os.link(temp, os.path.join(self.packs_dir, f"{self.name}.idx"))
            finally:
                os.unlink(temp)
            fsync_dir(self.packs_dir)
            return parse_index(self.name, data, identity_of(st))

    def _release_buffer(self) -> None:
        if self._buffer:
            self._view.release()
            _give_back(self._buffer)
            self._buffer = bytearray()  # nothing more is added once finished or discarded

    def discard(self) -> None:
        """Drop a pack that was never named (its bytes were never reachable)."""
        with self._lock:
            self._release_buffer()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)


class Packs:
    """The packs of one store, their indexes loaded as needed and kept while unchanged.

    A lookup asks one dictionary of the keys of every pack loaded, as long as it holds at most
    ``DICT_KEYS`` keys (~140 bytes each: the key, and its pack's slot and record number in one
    int), then the packs that did not fit, largest first: its cost is one dictionary lookup
    whatever the number of packs (a checkpoint adds one or two), and a read-back's closure of
    100,000 stamps does not search 100,000 times (~2 us each)."""

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, PACKS_DIR)
        self._loaded: dict[str, PackIndex] = {}
        self._large: list[PackIndex] = []  # the packs not in the dictionary, largest first
        self._by_key: dict[bytes, int] = {}  # key -> slot << 40 | its record in that pack
        self._slots: list[PackIndex | None] = []  # the packs in the dictionary, by slot
        self._slot_of: dict[str, int] = {}
        self._seen: tuple[int, int] | None = None  # the directory's (ino, mtime_ns) last listed
        self._lock = threading.Lock()
        self.unusable: dict[str, str] = {}  # index name -> why it is not used

    def _put(self, name: str, index: PackIndex | None) -> None:
        """Load, replace or forget one pack's index (under the lock)."""
        old = self._loaded.get(name)
        if old is not None and index is not None and same_records(old, index):
            self._swap(old, index)  # re-read with the same records (its file's identity moved)
            return
        self._loaded.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if old is not None and slot is not None:
            self._slots[slot] = None
            for key in old.keys_():
                if (self._by_key.get(key, -1) >> _SLOT_SHIFT) == slot:
                    del self._by_key[key]
        elif old is not None:
            self._large = [other for other in self._large if other.name != name]
        if index is not None:
            self._loaded[name] = index
            if len(self._by_key) + index.count <= DICT_KEYS:
                self._add_keys(index, index.keys_())
            else:
                self._large = sorted([*self._large, index], key=lambda i: -i.count)
        if old is not None:  # a key only it named in the dictionary may be in another pack
            for key in old.keys_():
                if key not in self._by_key:
                    for other in self._slots:
                        if other is not None and other.find(key) is not None:
                            self._add_keys(other, [key])
                            break

    def _swap(self, old: PackIndex, index: PackIndex) -> None:
        """Put ``index`` where ``old`` was: the same keys at the same records, so the
        dictionary's entries stay (a first read-back re-reads the index of the pack its scan
        wrote: the link that named it moved its ctime; re-adding its keys cost ~1 ms)."""
        self._loaded[index.name] = index
        slot = self._slot_of.get(index.name)
        if slot is not None:
            self._slots[slot] = index
        else:
            self._large = [index if other is old else other for other in self._large]

    def _add_keys(self, index: PackIndex, keys: Iterable[bytes]) -> None:
        slot = self._slot_of.get(index.name)
        if slot is None:
            slot = self._slot_of[index.name] = len(self._slots)
            self._slots.append(index)
        base = slot << _SLOT_SHIFT
        if isinstance(keys, list):  # a few keys again: their record numbers looked up
            for key in keys:
                record = index.record(key)
                if record is not None:
                    self._by_key.setdefault(key, base | record)
            return
        for record, key in enumerate(keys):
            self._by_key.setdefault(key, base | record)

    def pack_path(self, name: str) -> str:
        return f"{self.dir}/{name}.pack"

    def index_path(self, name: str) -> str:
        return f"{self.dir}/{name}.idx"

    def add(self, index: PackIndex) -> None:
        """A pack this process just finished: searchable without listing the directory."""
        with self._lock:
            self._put(index.name, index)

    def locate(self, key: bytes, *, refresh: bool = True) -> tuple[PackIndex, int, int] | None:
        """Which loaded pack holds ``key`` and where; on a miss, packs other processes wrote
        since the last listing are loaded first (unless ``refresh`` is False)."""
        found = self._search(key)
        if found is None and refresh and self.refresh():
            found = self._search(key)
        return found

    def where(self, key: bytes) -> tuple[PackIndex, int, int] | None:
        """Which pack this process knows of names ``key`` (no system call)."""
        return self._search(key)

    def _search(self, key: bytes) -> tuple[PackIndex, int, int] | None:
        value = self._by_key.get(key)
        if value is not None:
            index = self._slots[value >> _SLOT_SHIFT]
            if index is not None:
                offset, size = index.location(value & _RECORD_MASK)
                return index, offset, size
        for index in self._large:
            at = index.find(key)
            if at is not None:
                return index, at[0], at[1]
        return None

    def refresh(self) -> bool:
        """List the directory again if it changed; True if the set of packs changed."""
        try:
            st = os.stat(self.dir)
        except FileNotFoundError:
            return False
        seen = (st.st_ino, st.st_mtime_ns)
        if seen == self._seen:
            return False
        names = {n[:-4] for n in os.listdir(self.dir) if n.endswith(".idx")}
        with self._lock:
            changed = False
            for gone in set(self._loaded) - names:
                self._put(gone, None)
                changed = True
            for name in sorted(names - set(self._loaded) - set(self.unusable)):
                index = self._read(name)
                if index is not None:
                    self._put(name, index)
                    changed = True
            self._seen = seen
        return changed

    def current(self, index: PackIndex) -> PackIndex | None:
        """The index as its file is now: the same object if unchanged, re-read if replaced
        (``drop``), None if it is gone."""
        try:
            st = os.lstat(self.index_path(index.name))
        except FileNotFoundError:
            with self._lock:
                self._put(index.name, None)
            return None
        if identity_of(st) == index.identity:
            return index
        fresh = self._read(index.name)
        with self._lock:
            self._put(index.name, fresh)
        return fresh

    def _read(self, name: str) -> PackIndex | None:
        try:
            fd = os.open(self.index_path(name), _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.unusable[name] = "not a regular file"
                return None
            data = _read_all(fd, st.st_size)
        finally:
            os.close(fd)
        try:
            return parse_index(name, data, identity_of(st))
        except PackUnusable as error:
            self.unusable[name] = str(error)
            return None

    def digests(self) -> Iterator[str]:
        self.refresh()
        for index in list(self._loaded.values()):
            yield from index.digests()

    def drop(self, index: PackIndex, key: bytes, temp_dir: str) -> PackIndex | None:
        """Replace the pack's index with one that no longer names ``key`` (for the quarantine,
        which has kept its bytes aside). Under an exclusive lock on the pack, re-reading the
        index first, so two drops never undo each other. Returns the new index (None if the
        index is gone or no longer names ``key``)."""
        lock = os.open(self.pack_path(index.name), _OPEN_FLAGS)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            now = self._read(index.name)
            if now is None or now.find(key) is None:
                return None
            records = {}
            for at in range(0, len(now.keys), _KEY):
                other = now.keys[at : at + _KEY]
                if other != key:
                    offset, size = _LOCATION.unpack_from(now.locations, (at // _KEY) * 16)
                    records[other] = (int(offset), int(size))
            data = index_bytes(records, now.pack_size)
            temp = os.path.join(temp_dir, f"{os.getpid()}.{secrets.token_hex(8)}.idx")
            fd = os.open(temp, _WRITE_FLAGS, 0o400)
            try:
                _write_all(fd, data, temp)
                _fsync(fd, temp)
            finally:
                os.close(fd)
            os.rename(temp, self.index_path(index.name))  # the one replacement: see the module
            fsync_dir(self.dir)
            return self.current(now)
        finally:
            os.close(lock)

    # -- a packed object, as the store holds it now --------------------------------------------

    def state(
        self, key: bytes, seen: dict[str, PackState | None], found: Found | None = None
    ) -> Located | None:
        """The pack naming ``key`` as it is now (its index re-read if it was replaced), with
        the pack's lstat and the object's offset and size; None if no pack on disk names it.
        ``seen`` memoizes each pack's state for one call over many objects; ``found``: what
        ``where`` said, if it was asked."""
        found = found or self.locate(key)
        if found is None:
            return None
        name = found[0].name
        if name not in seen:
            seen[name] = None
            index = self.current(found[0])
            with contextlib.suppress(FileNotFoundError):
                pack = os.lstat(self.pack_path(name))
                if index is not None and stat.S_ISREG(pack.st_mode):
                    seen[name] = (index, pack)
        state = seen[name]
        if state is None:
            return None
        index, pack = state
        at = found[1:] if index is found[0] else index.find(key)
        return None if at is None else (index, pack, at[0], at[1])

    def stamp(
        self, key: bytes, seen: dict[str, PackState | None], found: Found | None = None
    ) -> Stamp | None:
        located = self.state(key, seen, found)
        return None if located is None else stamp_of(located[0], located[1], located[3])

    def reread(
        self, digest: str, algo: str, key: bytes, *, keep: bool, found: Found | None = None
    ) -> Reread:
        """The object's bytes from its pack, between two fstats of the pack; the copy's stamp
        only if they agree. ``ObjectMissing`` if no pack on disk names it. The pack is the
        file its name holds when opened; its index, the one its name holds now."""
        started = time.time_ns()
        found = found or self.locate(key)
        index = None if found is None else self.current(found[0])
        at = None
        if index is not None and found is not None:
            at = found[1:] if index is found[0] else index.find(key)
        if index is None or at is None:
            raise ObjectMissing(digest)
        offset, size = at
        try:
            fd = os.open(self.pack_path(index.name), _OPEN_FLAGS)
        except FileNotFoundError:
            raise ObjectMissing(digest) from None
        except OSError as error:
            raise ObjectUnreadable(digest, f"cannot open its pack: {error.strerror}") from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise ObjectUnreadable(digest, "its pack is not a regular file")
            data = read_at(fd, offset, size)
            after = os.fstat(fd)
        except OSError as error:
            raise ObjectUnreadable(digest, f"cannot read its pack: {error.strerror}") from None
        finally:
            os.close(fd)
        hasher = new_hasher(algo, size_hint=len(data))
        hasher.update(data)
        unchanged = identity_of(before) == identity_of(after)
        stamp = stamp_of(index, after, size) if unchanged else None
        actual = format_digest(algo, hasher.hexdigest())
        return Reread(actual, len(data), data if keep else None, stamp, started)

    def rereads(self, items: list[tuple[int, str, str, bytes, Found]]) -> list[Reread | Exception]:
        """``reread`` of objects ``where`` placed in one pack (``(i, digest, algo, key, found)``
        each): the pack opened once, every object read and hashed between one pair of fstats of
        it, so each copy's stamp holds only if the pack did not change during all of them."""
        started = time.time_ns()
        index = self.current(items[0][4][0])
        if index is None:
            return [ObjectMissing(digest) for _, digest, *_ in items]
        try:
            fd = os.open(self.pack_path(index.name), _OPEN_FLAGS)
        except FileNotFoundError:
            return [ObjectMissing(digest) for _, digest, *_ in items]
        except OSError as error:
            why = f"cannot open its pack: {error.strerror}"
            return [ObjectUnreadable(digest, why) for _, digest, *_ in items]
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                why = "its pack is not a regular file"
                return [ObjectUnreadable(digest, why) for _, digest, *_ in items]
            rest = _the_rest(index, items)
            results = _hash_items(fd, index, items + (rest or []))
            after = os.fstat(fd)
        except OSError as error:
            why = f"cannot read its pack: {error.strerror}"
            return [ObjectUnreadable(digest, why) for _, digest, *_ in items]
        finally:
            os.close(fd)
        unchanged = identity_of(before) == identity_of(after)
        whole = rest is not None and unchanged
        for (_, digest, *_), got in zip(items + (rest or []), results, strict=True):
            whole = whole and not isinstance(got, Exception) and got[0] == digest
        del results[len(items) :]
        stamps: dict[int, Stamp | None] = {}  # by size: one stamp per size, not per object
        out: list[Reread | Exception] = []
        append = out.append
        for got in results:
            if isinstance(got, Exception):
                append(got)
                continue
            size = got[1]
            stamp = stamps.get(size, _NO_STAMP)
            if stamp is _NO_STAMP:
                stamp = stamps[size] = stamp_of(index, after, size) if unchanged else None
            append(Reread(got[0], size, None, stamp, started, whole))
        return out

    def present(self, key: bytes, checked: set[str]) -> bool:
        """For the dedupe of a write: a pack this process knows of names ``key`` and its pack
        file is there (looked at once per pack in ``checked``). The directory is not listed
        again: a copy another process packed meanwhile is at worst stored twice."""
        found = self._search(key)
        if found is None:
            return False
        name = found[0].name
        if name not in checked:
            try:
                if not stat.S_ISREG(os.lstat(self.pack_path(name)).st_mode):
                    return False
            except FileNotFoundError:
                return False
            checked.add(name)
        return True

    def evidence(self, key: bytes) -> tuple[PackIndex, bytes] | None:
        """What the pack naming ``key`` holds for it now (for the quarantine to keep)."""
        found = self.locate(key)
        if found is None:
            return None
        index, offset, size = found
        try:
            fd = os.open(self.pack_path(index.name), _OPEN_FLAGS)
            try:
                return index, read_at(fd, offset, size)
            finally:
                os.close(fd)
        except OSError as error:
            return index, f"the pack could not be read: {error}".encode()


Found = tuple[PackIndex, int, int]  # the index naming an object, its offset and size
PackState = tuple[PackIndex, os.stat_result]  # a pack's index as it is now, and the pack's lstat
Located = tuple[PackIndex, os.stat_result, int, int]  # ... and the object's offset and size


def same_records(one: PackIndex, other: PackIndex) -> bool:
    """Two reads of one pack's index that name the same objects at the same places."""
    return (
        one.name == other.name
        and one.pack_size == other.pack_size
        and one.keys == other.keys
        and one.locations == other.locations
    )


def stamp_of(index: PackIndex, pack: os.stat_result, size: int) -> Stamp:
    """A packed object's copy: its pack's ctime and inode, and its index's ctime, each of which
    any change (a write, a chmod, a replaced index: the quarantine's) moves on, and which the
    verified-object record's racy rule checks like a file's ctime and mtime. Not a maximum of
    the two: two files can get the very same timestamp from the kernel's coarse clock."""
    return Stamp(pack.st_ctime_ns, pack.st_ino, index.identity[4], size, pack.st_dev)


_BLAKE3_PREFIX: Final = f"{BLAKE3}:"
_NO_STAMP: Final = Stamp(-1, -1, -1, -1, -1)  # a memo's miss (None is a stamp's absence)
SPAN_READ_MAX: Final = 64 << 20  # read the asked objects' span of a pack whole up to this
WHOLE_FROM: Final = 2  # a pack is re-hashed whole when at least 1/2 of it was asked for


def _the_rest(
    index: PackIndex, items: list[tuple[int, str, str, bytes, Found]]
) -> list[tuple[int, str, str, bytes, Found]] | None:
    """The members of the pack not among ``items``, to be re-hashed with them when they are
    few enough (``items`` at least ``1 / WHOLE_FROM`` of the pack): the pack is then verified
    as a whole, one row of the verified-object record instead of one per object. None if not
    worth it, or if ``items`` names an object twice or as placed by another index."""
    count = index.count
    if not items or count > WHOLE_FROM * len(items) or len(items) > count:
        return None
    asked: set[bytes] = set()
    for *_, key, found in items:
        if key in asked or (found[0] is not index and not same_records(found[0], index)):
            return None
        asked.add(key)
    rest: list[tuple[int, str, str, bytes, Found]] = []
    for record, key in enumerate(index.keys_()):
        if key not in asked:
            offset, size = index.location(record)
            rest.append((-1, digest_of(key), _ALGO_OF[key[32]], key, (index, offset, size)))
    return rest if len(asked) + len(rest) == count else None


def _span(
    index: PackIndex, items: list[tuple[int, str, str, bytes, Found]]
) -> tuple[int, int] | None:
    """The byte range of a pack that holds every object of ``items`` (as ``where`` found them),
    when reading it in one call reads at most twice their bytes and ``SPAN_READ_MAX``: a
    read-back of a pack just written (every object of it) is then one read, not one an object
    (~1.5 us each, with its bytes object). None: read them one by one."""
    if len(items) < 2:
        return None
    start, end, wanted = index.pack_size, 0, 0
    for *_, found in items:
        offset, size = found[1], found[2]
        start, end, wanted = min(start, offset), max(end, offset + size), wanted + size
    length = end - start
    return (start, end) if 0 < length <= min(SPAN_READ_MAX, 2 * wanted) else None


def _hash_items(
    fd: int, index: PackIndex, items: list[tuple[int, str, str, bytes, Found]]
) -> list[tuple[str, int] | Exception]:
    """What each object of ``items`` in the pack open at ``fd`` hashes to, and its size read:
    from one read of their span when ``_span`` allows it (the hot loop of a read-back of a pack
    just written: ~1,000 objects of a first checkpoint), else read one by one."""
    span = _span(index, items)
    whole = memoryview(read_at(fd, span[0], span[1] - span[0])) if span else None
    first, last = span if span else (0, -1)
    hash_blake3 = blake3.blake3
    results: list[tuple[str, int] | Exception] = []
    append = results.append
    same: dict[int, bool] = {id(index): True}  # the indexes ``where`` found them in
    for _, digest, algo, key, found in items:
        agrees = same.get(id(found[0]))
        if agrees is None:
            agrees = same[id(found[0])] = same_records(index, found[0])
        if agrees:
            offset, size = found[1], found[2]
        else:
            at = index.find(key)
            if at is None:
                append(ObjectMissing(digest))
                continue
            offset, size = at
        data: bytes | memoryview
        if whole is not None and first <= offset <= last - size:
            data = whole[offset - first : offset - first + size]
        elif size <= CHUNK:
            data = os.pread(fd, size, offset)
        else:
            data = read_at(fd, offset, size)
        if len(data) < size:  # a short read at the end of a shortened pack
            data = bytes(data) + read_at(fd, offset + len(data), size - len(data))
        if algo == BLAKE3:  # compared as bytes: the name's string is built only if it differs
            raw = hash_blake3(data).digest()
            actual = digest if raw == key[:32] else _BLAKE3_PREFIX + raw.hex()
            append((actual, len(data)))
        else:
            hasher = new_hasher(algo, size_hint=len(data))
            hasher.update(data)
            append((format_digest(algo, hasher.hexdigest()), len(data)))
    return results


def _read_all(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = os.read(fd, max(CHUNK, size - got))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)


def read_at(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` (fewer only if the file is shorter): one read, unless the
    kernel returns less."""
    first = os.pread(fd, size, offset)
    if len(first) == size or not first:
        return first
    chunks, got = [first], len(first)
    while got < size:
        chunk = os.pread(fd, min(CHUNK, size - got), offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
