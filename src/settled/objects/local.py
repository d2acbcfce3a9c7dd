"""The local object store: the ``ObjectStore`` protocol (``settled.objects``) on a directory.

Owns ``LocalObjectStore``: ``<root>/<algo>/<hex[:2]>/<hex[2:]>``, private read-only (0o400)
objects in private (0o700) directories (the settled home is the owner's alone; nothing reads an
object as another user), temporary files in ``<root>/tmp`` (same filesystem, so a link is
atomic), and ``<root>/quarantine``, where an object that no longer hashes to its name is moved
(never deleted: it is evidence) so that the next write of those bytes can put the right ones in
place. An object has one version here, its digest (see ``settled.objects``), and its ``Stamp`` is
its file's ``lstat`` identity.

A local write is: temp file, write, fchmod 0o400, fsync, ``os.link`` into place (which never
replaces an existing name), fsync of the fan-out directory (and of every directory it had to
create, and of their parents). If the object is already present the temp is removed and the
existing object stands (dedupe). Inside ``batch()`` the fan-out directory fsyncs are deferred to
the end of the batch, each directory once; the object's own bytes are still fsynced before its
link, so a name in the store never points at bytes that were not durable. A staged write
(``ObjectWriter.stage()`` inside ``staging()``) skips the per-object fsync: its temp file is made
durable by one ``syncfs(2)`` for the whole group, and only then linked (``publish.Publisher``
decides which to use). (About 540 lines, over the usual 400: the writer, the staged object and
the store share the batch's and the directories' state, and split they would share internals.)

Must never: overwrite or modify an existing object, or take an object's name away except to
quarantine it (``quarantine``: only for an object just found not to hash to its name); link an
object whose bytes were not fsynced; swallow or silently retry a failed fsync; accept a digest
it cannot parse (a digest is a path); hold more than one chunk (1 MiB) of a stream in memory;
follow a symlink or open anything but a regular file when reading an object back; know about
manifests, scans or the settled store and database.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO, Final

import blake3

from settled import faults
from settled.errors import SettledError
from settled.objects import (
    CHUNK,
    DigestMismatch,
    DurabilityError,
    ObjectMissing,
    ObjectUnreadable,
    ObjectWriter,
    Reread,
    StagedObject,
    Stamp,
    StoredObject,
    VersionMissing,
)
from settled.objects.hashing import (
    ALGORITHMS,
    BLAKE3,
    DEFAULT_ALGORITHM,
    HEX_LENGTH,
    Buffer,
    check_algorithm,
    format_digest,
    new_hasher,
    parse_digest,
)
from settled.objects.packs import Found, Packs, PackState, PackWriter, key_from

OBJECT_MODE: Final = 0o400
DIR_MODE: Final = 0o700
TEMP_DIR: Final = "tmp"
QUARANTINE_DIR: Final = "quarantine"
_REREAD_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_BLAKE3_PREFIX: Final = f"{BLAKE3}:"
_BLAKE3_CUT: Final = len(_BLAKE3_PREFIX)
_BLAKE3_LENGTH: Final = _BLAKE3_CUT + HEX_LENGTH
_BLAKE3_BYTE: Final = key_from(BLAKE3, "00" * 32)[32:]


class StoreUnusable(SettledError):
    def __init__(self, path: str) -> None:
        super().__init__(f"object store path {path!r} is not a directory; move it aside")
        self.path = path


def _fsync(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as error:
        raise DurabilityError(path, error) from error


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _fsync(fd, path)
    finally:
        os.close(fd)


def _write_all(fd: int, data: Buffer, path: str) -> None:
    view = memoryview(data).cast("B")
    try:
        faults.point("checkpoint.blob_write")
        while view:
            view = view[os.write(fd, view) :]
    except OSError as error:
        raise DurabilityError(path, error) from error


def _read_into(source: BinaryIO | int, buffer: bytearray) -> int:
    if isinstance(source, int):
        return os.readv(source, [buffer])
    readinto = getattr(source, "readinto", None)
    if readinto is not None:
        got = readinto(buffer)
        return 0 if got is None else int(got)
    data = source.read(len(buffer))
    buffer[: len(data)] = data
    return len(data)


def _stamp_of(st: os.stat_result) -> Stamp:
    return Stamp(st.st_ctime_ns, st.st_ino, st.st_mtime_ns, st.st_size, st.st_dev)


def _files_in(directory: str) -> set[str]:
    """The names of the regular files in ``directory`` (by the listing's type: never followed)."""
    try:
        with os.scandir(directory) as listing:
            return {item.name for item in listing if item.is_file(follow_symlinks=False)}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _names_in(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


class _BatchDirs:
    """Fan-out directories whose fsync a batch owes; a commit after the batch ended syncs now."""

    def __init__(self) -> None:
        self.dirs: set[str] = set()
        self.open = True
        self.lock = threading.Lock()

    def defer(self, path: str) -> bool:
        with self.lock:
            if self.open:
                self.dirs.add(path)
            return self.open


class _Batch(threading.local):
    current: _BatchDirs | None = None


class _Group:
    """A staging group: the pack its small objects go to (opened at the first one), made
    durable and visible by ``sync``, dropped unnamed if the group ends without it."""

    def __init__(self, store: LocalObjectStore) -> None:
        self.store = store
        self.pack: PackWriter | None = None
        self.synced = False
        self.packs_present: set[str] = set()  # packs seen on disk during this group
        self.fanouts: dict[str, set[str]] = {}  # "algo/xx" -> the files there, listed once
        self.lock = threading.Lock()

    def add(self, key: bytes, data: Buffer) -> bool:
        with self.lock:
            if self.synced:
                raise ValueError("stage() after the group's sync")
            if self.pack is None:
                self.store._ensure_dir(self.store.packs.dir)
                self.pack = PackWriter(self.store.packs.dir, self.store.temp_dir)
            return self.pack.add(key, data)

    def sync(self) -> None:
        with self.lock:
            if self.pack is not None and not self.synced:
                self.store.packs.add(self.pack.finish())
            self.synced = True

    def close(self) -> None:
        with self.lock:
            if self.pack is not None and not self.synced:
                self.pack.discard()


class _Staging(threading.local):
    groups: list[_Group]

    def __init__(self) -> None:
        self.groups = []


class LocalObjectStore:
    """``ObjectStore`` on a local directory (for example ``<home>/objects``)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))  # may be a symlink; nothing below it may
        self._prefix = os.path.join(self.root, "")  # the root and one "/"
        self._known_dirs: set[str] = set()
        self._lock = threading.Lock()
        self._batch = _Batch()
        self._staging = _Staging()
        self.packs = Packs(self.root)
        self._ensure_dir(self.root)
        self.temp_dir = os.path.join(self.root, TEMP_DIR)
        self._ensure_dir(self.temp_dir)

    def __repr__(self) -> str:
        return f"LocalObjectStore({self.root!r})"

    @property
    def location(self) -> str:
        return self.root

    # -- naming --------------------------------------------------------------------------------

    def path_of(self, digest: str) -> str:
        """Where ``digest`` is (or would be) as a file of its own; a packed one is not there."""
        return self._file(*parse_digest(digest))  # a concatenation: os.path.join cost 6 us

    def location_of(self, digest: str) -> tuple[str, int, int] | None:
        """Where the bytes a read of ``digest`` finds lie: ``(file, offset, size)``, the file
        its own (offset 0) or its pack; None if the store does not hold it. For diagnostics
        and tests: readers go through ``open``, ``reread`` and ``stamp``."""
        algo, hexdigest, key = self._parse(digest)
        found = self.packs.where(key)
        if found is None:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(self._file(algo, hexdigest))
                return self._file(algo, hexdigest), 0, st.st_size
            found = self.packs.locate(key)
        if found is None:
            return None
        index, offset, size = found
        return self.packs.pack_path(index.name), offset, size

    # -- writing -------------------------------------------------------------------------------

    def writer(
        self, algo: str = DEFAULT_ALGORITHM, *, size_hint: int | None = None
    ) -> ObjectWriter:
        """A writer for one object; ``size_hint`` (bytes expected) only tunes the hasher."""
        return _LocalWriter(self, check_algorithm(algo), size_hint)

    def put_bytes(self, data: Buffer, algo: str = DEFAULT_ALGORITHM) -> str:
        with self.writer(algo, size_hint=len(data)) as writer:
            writer.write(data)
            return writer.commit().digest

    def put_stream(
        self,
        source: BinaryIO | int,
        expected_digest: str | None = None,
        algo: str = DEFAULT_ALGORITHM,
    ) -> str:
        """Store everything ``source`` yields, reading 1 MiB at a time; refuse a wrong digest."""
        if expected_digest is not None:
            algo = parse_digest(expected_digest)[0]
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        with self.writer(algo) as writer:
            while got := _read_into(source, buffer):
                writer.write(view[:got])
            actual = writer.digest()
            if expected_digest is not None and actual != expected_digest:
                raise DigestMismatch(expected_digest, actual)
            return writer.commit().digest

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writers made in this thread inside the batch (committed on any thread) defer their
        fan-out directory fsync to the batch's end: each directory once. Commit them before."""
        state = self._batch
        outer = state.current is None
        batch = state.current = state.current or _BatchDirs()
        try:
            yield
        finally:
            if outer:
                state.current = None
                with batch.lock:
                    batch.open = False
        if outer:  # on success only: a failed batch publishes nothing anyone relies on
            for path in sorted(batch.dirs):
                _fsync_dir(path)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Callable[[], None]]:
        """A group of staged writes: the small ones (all in memory) appended to one pack, which
        ``sync`` fsyncs and then names by its index (``packs``); a large one fsynced when
        staged and linked at ``publish()``. Measured here: 100,000 100-byte objects as files
        spent ~40% of a first checkpoint creating inodes; a pack is one file."""
        group = _Group(self)
        groups = self._staging.groups
        groups.append(group)
        try:
            yield group.sync
        finally:
            groups.remove(group)
            group.close()

    def _group(self) -> _Group | None:
        groups = self._staging.groups
        return groups[-1] if groups else None

    def stage_bytes(self, data: Buffer, algo: str = DEFAULT_ALGORITHM) -> StagedObject:
        """Inside ``staging()``, an object of at most one chunk is hashed here and appended to
        the group's pack (named by the group's sync), with no writer, temp file or copy of its
        own: a first checkpoint stages one of these per small file (~6 us less each than a
        writer). Its dedupe asks the packs only: loose objects are few (manifests, a small
        publish's objects, large files) and looking for one cost a listing of its fan-out or
        an lstat per object, so one already stored as a file is stored again in the pack (a
        second copy of the same bytes, which every reader accepts). Anything else goes
        through ``writer().stage()``."""
        group = self._group()
        if group is None or len(data) > CHUNK:
            with self.writer(algo, size_hint=len(data)) as writer:
                writer.write(data)
                return writer.stage()
        if algo == BLAKE3:
            hexdigest = blake3.blake3(data).hexdigest()
        else:
            hasher = new_hasher(algo)
            hasher.update(data)
            hexdigest = hasher.hexdigest()
        key = key_from(algo, hexdigest)
        digest = f"{algo}:{hexdigest}"
        if self.packs.present(key, group.packs_present):  # the dedupe that costs no syscall
            return _PackedStaged(digest, len(data), created=False)
        return _PackedStaged(digest, len(data), created=group.add(key, data))

    def _present(self, algo: str, hexdigest: str, key: bytes, group: _Group) -> bool:
        """Whether a staged object is already stored (dedupe): in a pack this store knows of,
        or as a file, looked for in a listing of its fan-out directory taken once per group
        (one ``getdents`` a directory instead of an ``lstat`` an object: a home whose manifests
        fill most fan-outs made that an lstat for most files). A copy another process adds
        meanwhile is at worst stored twice."""
        if self.packs.present(key, group.packs_present):
            return True
        fanout = f"{algo}/{hexdigest[:2]}"
        names = group.fanouts.get(fanout)
        if names is None:
            names = group.fanouts[fanout] = _files_in(os.path.join(self.root, fanout))
        return hexdigest[2:] in names

    def quarantine(self, digest: str) -> str | None:
        """Move whatever holds ``digest``'s name out of it, into ``<root>/quarantine/`` (kept as
        evidence, never deleted), so the next write of those bytes can link the right ones.
        Returns where it went, or None if nothing held the name. Only for an object found not
        to hash to its name (or not a regular file): the caller has just re-hashed it. A packed
        object (the copy a read finds first) has its bytes copied there, then its pack's index
        replaced by one without it."""
        algo, hexdigest, key = self._parse(digest)
        quarantine = os.path.join(self.root, QUARANTINE_DIR)
        self._ensure_dir(quarantine)
        target = os.path.join(
            quarantine, f"{algo}-{hexdigest}.{time.time_ns()}.{secrets.token_hex(4)}"
        )
        if self.packs.where(key) is not None:
            moved = self._quarantine_packed(key, target)
            if moved is not None:
                return moved
        source = self._file(algo, hexdigest)
        try:
            os.rename(source, target)  # same filesystem; the new name is fresh, never replaced
        except FileNotFoundError:
            return self._quarantine_packed(key, target)
        _fsync_dir(quarantine)
        _fsync_dir(os.path.dirname(source))
        return target

    def _quarantine_packed(self, key: bytes, target: str) -> str | None:
        found = self.packs.evidence(key)
        if found is None:
            return None
        index, evidence = found
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(target, flags, OBJECT_MODE)
        try:
            _write_all(fd, evidence, target)
            _fsync(fd, target)
        finally:
            os.close(fd)
        _fsync_dir(os.path.dirname(target))
        self.packs.drop(index, key, self.temp_dir)
        return target

    # -- reading -------------------------------------------------------------------------------
    # A digest is looked for in the packs this process knows of (no system call), then as a
    # file, then in packs other processes wrote since this one last listed them.

    def _parse(self, digest: str) -> tuple[str, str, bytes]:
        """``(algo, hex, key)`` of a digest; ``BadDigest`` if it is not one. The common form
        is checked without the regular expression (a read-back parses 100,000 of them): its
        hex decoded and encoded back to the same text is exactly lowercase hex, no space (a
        plain ``try``: ``contextlib.suppress`` cost ~0.8 us a digest, most of this check)."""
        if len(digest) == _BLAKE3_LENGTH and digest.startswith(_BLAKE3_PREFIX):
            hexdigest = digest[_BLAKE3_CUT:]
            try:
                raw = bytes.fromhex(hexdigest)
            except ValueError:
                raw = b""
            if raw.hex() == hexdigest:
                return BLAKE3, hexdigest, raw + _BLAKE3_BYTE
        algo, hexdigest = parse_digest(digest)
        return algo, hexdigest, key_from(algo, hexdigest)

    def _file(self, algo: str, hexdigest: str) -> str:
        return f"{self._prefix}{algo}/{hexdigest[:2]}/{hexdigest[2:]}"

    def has(self, digest: str) -> bool:
        algo, hexdigest, key = self._parse(digest)
        found = self.packs.where(key)
        if found is not None and self.packs.state(key, {}, found) is not None:
            return True
        try:
            return stat.S_ISREG(os.lstat(self._file(algo, hexdigest)).st_mode)
        except FileNotFoundError:
            return self.packs.state(key, {}) is not None

    def open(self, digest: str, version: str | None = None) -> BinaryIO:
        """The object's bytes; its only version is its digest (``VersionMissing`` otherwise)."""
        algo, hexdigest, key = self._parse(digest)
        if version is not None and version != digest:
            raise VersionMissing(digest, version)
        if self.packs.where(key) is None:
            try:
                fd = os.open(
                    self._file(algo, hexdigest), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                )
                return os.fdopen(fd, "rb")
            except FileNotFoundError:
                pass
        got = self.packs.reread(digest, algo, key, keep=True)  # ObjectMissing if none has it
        assert got.data is not None
        return io.BytesIO(got.data)

    def read(self, digest: str, version: str | None = None) -> bytes:
        with self.open(digest, version) as handle:
            return handle.read()

    def stamps(self, digests: Sequence[str]) -> list[Stamp | Exception]:
        """One ``lstat`` each, in order (~12 us an object: nothing to overlap); a packed
        object's pack and index are looked at once per call."""
        results: list[Stamp | Exception] = []
        seen: dict[str, PackState | None] = {}
        for digest in digests:
            try:
                results.append(self._stamp(digest, seen))
            except (OSError, SettledError) as error:
                results.append(error)
        return results

    def stamp(self, digest: str) -> Stamp:
        """The ``lstat`` identity of the object file (the read-back's hot loop: one syscall);
        for a packed object, of its pack and its index (``packs.stamp_of``)."""
        return self._stamp(digest, {})

    def _stamp(self, digest: str, seen: dict[str, PackState | None]) -> Stamp:
        algo, hexdigest, key = self._parse(digest)
        found = self.packs.where(key)
        if found is not None:
            packed = self.packs.stamp(key, seen, found)
            if packed is not None:
                return packed
        try:
            st = os.lstat(self._file(algo, hexdigest))
        except FileNotFoundError:
            packed = self.packs.stamp(key, seen)
            if packed is None:
                raise ObjectMissing(digest) from None
            return packed
        if not stat.S_ISREG(st.st_mode):
            raise ObjectUnreadable(digest, "not a regular file")
        return _stamp_of(st)

    def reread(self, digest: str, *, keep: bool = False) -> Reread:
        """Open without following, fstat before and after, hash every byte: the copy's stamp
        is returned only if the two fstats agree (nothing changed it while it was read)."""
        algo, hexdigest, key = self._parse(digest)
        found = self.packs.where(key)
        if found is not None:
            with contextlib.suppress(ObjectMissing):  # gone from its pack: a file, maybe
                return self.packs.reread(digest, algo, key, keep=keep, found=found)
        started = time.time_ns()
        try:
            fd = os.open(self._file(algo, hexdigest), _REREAD_FLAGS)
        except FileNotFoundError:
            return self.packs.reread(digest, algo, key, keep=keep)  # ObjectMissing if not
        except OSError as error:  # ELOOP: a symlink holds the name
            raise ObjectUnreadable(digest, f"cannot open: {error.strerror}") from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise ObjectUnreadable(digest, "not a regular file")
            hasher = new_hasher(algo, size_hint=before.st_size)
            chunks: list[bytes] = []
            size = 0
            while chunk := os.read(fd, CHUNK):
                hasher.update(chunk)
                size += len(chunk)
                if keep:
                    chunks.append(chunk)
            after = os.fstat(fd)
        except OSError as error:
            raise ObjectUnreadable(digest, f"cannot read: {error.strerror}") from None
        finally:
            os.close(fd)
        stamp = _stamp_of(after)
        unchanged = _stamp_of(before) == stamp
        data = b"".join(chunks) if keep else None
        actual = format_digest(algo, hasher.hexdigest())
        return Reread(actual, size, data, stamp if unchanged else None, started)

    def rereads(self, digests: Sequence[str]) -> list[Reread | Exception]:
        """``reread`` of each, in order; the packed ones a pack at a time (one open and one
        pair of fstats of the pack for all of its objects asked for), the others one by one."""
        results: list[Reread | Exception | None] = [None] * len(digests)
        by_pack: dict[str, list[tuple[int, str, str, bytes, Found]]] = {}
        for i, digest in enumerate(digests):
            try:
                algo, _, key = self._parse(digest)
            except SettledError as error:
                results[i] = error
                continue
            found = self.packs.where(key)
            if found is None:
                results[i] = self._reread_or_error(digest)
            else:
                by_pack.setdefault(found[0].name, []).append((i, digest, algo, key, found))
        for items in by_pack.values():
            for (i, digest, *_), got in zip(items, self.packs.rereads(items), strict=True):
                missing = isinstance(got, ObjectMissing)  # gone from its pack: a file, maybe
                results[i] = self._reread_or_error(digest) if missing else got
        done = [result for result in results if result is not None]
        assert len(done) == len(digests), "every digest has its result"
        return done

    def _reread_or_error(self, digest: str) -> Reread | Exception:
        try:
            return self.reread(digest)
        except SettledError as error:  # what reread says of the object; OSError propagates
            return error

    def recorded(self) -> LocalObjectStore:
        """Itself: one copy per digest, written once, so there is no older upload to read."""
        return self

    def verify(self, digest: str) -> bool:
        """Re-hash the stored bytes; False if they do not match ``digest`` or it is missing."""
        algo = parse_digest(digest)[0]
        try:
            handle = self.open(digest)
        except ObjectMissing:
            return False
        hasher = new_hasher(algo)
        with handle:
            while chunk := handle.read(CHUNK):
                hasher.update(chunk)
        return format_digest(algo, hasher.hexdigest()) == digest

    def list_digests(self, algo: str | None = None) -> Iterator[str]:
        """Walk ``<root>/<algo>/<xx>/``, sorted; anything there that is not a regular file
        named by a digest (a temp, a stray) is not an object and is skipped."""
        for name in ALGORITHMS if algo is None else (check_algorithm(algo),):
            top = os.path.join(self.root, name)
            for fanout in _names_in(top):
                for rest in _names_in(os.path.join(top, fanout)):
                    if len(fanout) + len(rest) != HEX_LENGTH:
                        continue
                    digest = f"{name}:{fanout}{rest}"
                    with contextlib.suppress(SettledError):  # not a digest: not an object
                        if self.has(digest):
                            yield digest
        for digest in self.packs.digests():
            if (algo is None or digest.startswith(f"{algo}:")) and not self._is_file(digest):
                yield digest  # (a digest stored both ways was listed above)

    def _is_file(self, digest: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.path_of(digest)).st_mode)
        except FileNotFoundError:
            return False

    # -- directories ---------------------------------------------------------------------------

    def _ensure_dir(self, path: str) -> None:
        """Create ``path`` (and missing parents) durably: fsync the parent of each one made."""
        if path in self._known_dirs:
            return
        parent = os.path.dirname(path)
        if parent != path and not os.path.isdir(parent):
            self._ensure_dir(parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)
        if not os.path.isdir(path) or (path != self.root and os.path.islink(path)):
            raise StoreUnusable(path)
        if os.stat(path).st_mode & 0o077:  # made by an earlier version (0o755), or by umask
            os.chmod(path, DIR_MODE)
        # Made here or by a concurrent writer: either way its name must be durable before use.
        _fsync_dir(parent)
        with self._lock:
            self._known_dirs.add(path)

    def _fanout_dir(self, digest: str) -> str:
        algo, hexdigest = parse_digest(digest)
        self._ensure_dir(os.path.join(self.root, algo))  # made private too, if it exists
        path = os.path.join(self.root, algo, hexdigest[:2])
        self._ensure_dir(path)
        return path

    def _sync_fanout(self, path: str, batch: _BatchDirs | None) -> None:
        if batch is None or not batch.defer(path):
            _fsync_dir(path)


class _LocalWriter:
    """Hash and stage bytes; spill to a temp file only past one chunk, so a small object that is
    already present costs no write at all."""

    def __init__(self, store: LocalObjectStore, algo: str, size_hint: int | None) -> None:
        self._store = store
        self._algo = algo
        self._hasher = new_hasher(algo, size_hint=size_hint)
        self._batch = store._batch.current
        self._pending = bytearray()
        self._fd: int | None = None
        self._temp: str | None = None
        self._size = 0
        self._digest: str | None = None
        self._done = False

    @property
    def size(self) -> int:
        return self._size

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    def write(self, data: Buffer) -> None:
        if self._digest is not None or self._done:
            raise ValueError("write after digest(), commit() or abort()")
        self._hasher.update(data)
        self._size += len(data)
        if self._fd is None and len(self._pending) + len(data) <= CHUNK:
            self._pending += data
            return
        fd, temp = self._open_temp()
        _write_all(fd, data, temp)

    def digest(self) -> str:
        if self._digest is None:
            self._digest = format_digest(self._algo, self._hasher.hexdigest())
        return self._digest

    def commit(self) -> StoredObject:
        """fsync the temp file, then link it into place (the object's name, durable after the
        fan-out directory's fsync: now, or at the end of the batch)."""
        return self._write_temp(sync=True).publish()

    def stage(self) -> StagedObject:
        """Inside ``staging()``, an object still all in memory (at most one chunk) is appended
        to the group's pack, named by the group's sync; a larger one is fsynced now and linked
        by ``publish()``. An object already present needs neither."""
        group = self._store._group()
        if group is None or self._fd is not None:
            return self._write_temp(sync=True)
        if self._done:
            raise ValueError("commit() or stage() after commit(), stage() or abort()")
        digest = self.digest()
        hexdigest = digest[len(self._algo) + 1 :]
        try:
            key = key_from(self._algo, hexdigest)
            if self._store._present(self._algo, hexdigest, key, group):
                return _PackedStaged(digest, self._size, created=False)
            return _PackedStaged(digest, self._size, created=group.add(key, self._pending))
        finally:
            self.abort()

    def _write_temp(self, *, sync: bool) -> _LocalStaged:
        if self._done:
            raise ValueError("commit() or stage() after commit(), stage() or abort()")
        digest = self.digest()
        store = self._store
        try:
            fanout = store._fanout_dir(digest)
            if store.has(digest):
                return _LocalStaged(store, digest, self._size, None, fanout, self._batch)
            fd, temp = self._open_temp()
            os.fchmod(fd, OBJECT_MODE)
            if sync:
                _fsync(fd, temp)
            self._fd = None
            os.close(fd)
            self._temp = None  # the staged object owns the temp file now
            return _LocalStaged(store, digest, self._size, temp, fanout, self._batch)
        finally:
            self.abort()

    def abort(self) -> None:
        self._done = True
        self._pending = bytearray()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._temp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._temp)
            self._temp = None

    def _open_temp(self) -> tuple[int, str]:
        if self._fd is not None and self._temp is not None:
            return self._fd, self._temp
        name = f"{os.getpid()}.{secrets.token_hex(8)}.tmp"
        temp = os.path.join(self._store.temp_dir, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(temp, flags, 0o600)
        self._temp = temp
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            _write_all(self._fd, pending, temp)
        return self._fd, temp


class _PackedStaged:
    """An object staged into its group's pack: visible once the group's sync returned."""

    visible_at_sync = True

    def __init__(self, digest: str, size: int, *, created: bool) -> None:
        self.digest, self.size, self.created = digest, size, created

    def publish(self) -> StoredObject:
        return StoredObject(self.digest, self.size, created=self.created, version=self.digest)

    def discard(self) -> None:
        """Nothing to drop: a pack that was never synced is discarded with its group."""


class _LocalStaged:
    """A staged local object: its fsynced temp file, or None if the object was present."""

    visible_at_sync = False  # renamed to its name by publish()

    def __init__(
        self,
        store: LocalObjectStore,
        digest: str,
        size: int,
        temp: str | None,
        fanout: str,
        batch: _BatchDirs | None,
    ) -> None:
        self.digest, self.size = digest, size
        self._store, self._temp, self._fanout, self._batch = store, temp, fanout, batch

    def publish(self) -> StoredObject:
        created = False
        if self._temp is not None:
            try:
                os.link(self._temp, self._store.path_of(self.digest))
                created = True
            except FileExistsError:
                pass  # a concurrent writer linked the same bytes first
            finally:
                self.discard()
        self._store._sync_fanout(self._fanout, self._batch)
        return StoredObject(self.digest, self.size, created=created, version=self.digest)

    def discard(self) -> None:
        if self._temp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._temp)
            self._temp = None
