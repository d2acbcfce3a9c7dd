"""Workspace entries, the scan index, and manifests: the canonical record of a tree.

Owns ``Entry`` (one path: type, mode, size, digest | target, plus the stat cache), ``Index`` (a
scan's entries with their stat cache, serializable as the next scan's cache), ``Manifest`` (the
same entries without the stat cache, plus parent, watermark and generation), the manifest's
canonical bytes and id (``<algo>:<hash of the canonical bytes>``), and writing, reading back and
verifying manifests in an ``ObjectStore``.

No ``created_at``: the id covers every byte of the manifest, and a manifest is a pure function
of the tree and its lineage, so a checkpoint retried after a crash writes the very same object
and reads back the very same id. Time belongs to the checkpoint receipt (``issued_at``).

Must never: write a manifest that names a blob the store lacks; return a manifest whose bytes do
not hash to the id asked for, or that is not canonical, sorted, and free of paths that escape
the tree; put the stat cache (ino, dev, times) into a manifest; talk to the settled database.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final, NamedTuple

from settled.canonical import canonical_bytes
from settled.errors import SettledError
from settled.workspace.hashing import check_algorithm, digest_bytes, parse_digest
from settled.workspace.objects import ObjectMissing, ObjectStore

MANIFEST_VERSION: Final = "settled.manifest/v1"
INDEX_VERSION: Final = "settled.index/v1"
ROOT: Final = "."
FILE, DIR, SYMLINK = "file", "dir", "symlink"
DEVICES: Final = frozenset({"chardev", "blockdev"})
TYPES: Final = {
    stat.S_IFREG: FILE,
    stat.S_IFDIR: DIR,
    stat.S_IFLNK: SYMLINK,
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "chardev",
    stat.S_IFBLK: "blockdev",
}
ENTRY_TYPES: Final = tuple(TYPES.values())
_MANIFEST_KEYS: Final = frozenset(
    {"v", "algorithm", "entries", "parent", "watermark", "generation"}
)


class ManifestError(SettledError):
    """A manifest that cannot be written, read or trusted."""


class IndexMismatch(ManifestError):
    """A previous index (or a dirty set) that cannot be used for this scan."""


class UnsafePath(ManifestError):
    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"path {path!r} {reason}; refused")
        self.path = path


class ManifestInvalid(ManifestError):
    def __init__(self, manifest_id: str, reason: str) -> None:
        super().__init__(f"manifest {manifest_id} is not a valid {MANIFEST_VERSION}: {reason}")
        self.manifest_id = manifest_id


class ManifestCorrupt(ManifestError):
    def __init__(self, manifest_id: str, actual: str) -> None:
        super().__init__(f"manifest object {manifest_id} reads back as {actual}: refused")
        self.manifest_id, self.actual = manifest_id, actual


class MissingBlob(ManifestError):
    def __init__(self, digest: str, path: str) -> None:
        super().__init__(
            f"blob {digest} of {path!r} is not in the object store: publish blobs before the "
            "manifest; no manifest written"
        )
        self.digest, self.path = digest, path


def join(parent: str, name: str) -> str:
    return name if parent == ROOT else f"{parent}/{name}"


def parent_of(path: str) -> str:
    return path.rpartition("/")[0] or ROOT


def check_path(path: object) -> str:
    """A relative, '/'-separated, normalized, UTF-8 path inside the tree (or ``"."``)."""
    if not isinstance(path, str) or not path:
        raise UnsafePath(path, "is not a non-empty string")
    if path == ROOT:
        return path
    if path.startswith("/"):
        raise UnsafePath(path, "is absolute")
    if "\0" in path:
        raise UnsafePath(path, "contains NUL")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise UnsafePath(path, "has an empty, '.' or '..' component")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafePath(path, "is not valid UTF-8") from None
    return path


class Entry(NamedTuple):
    """One tree entry. ``ino``..``ctime_ns`` are the stat cache: kept in an ``Index``, zero in a
    ``Manifest``, never part of a manifest's bytes. (A NamedTuple: immutable, and four times
    cheaper to build than a frozen dataclass, which matters at 100,000 entries per scan.)"""

    path: str
    type: str
    mode: int
    size: int
    digest: str | None = None  # files
    target: str | None = None  # symlinks
    rdev: int | None = None  # character and block devices
    ino: int = 0
    dev: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0

    @classmethod
    def from_stat(
        cls, path: str, st: os.stat_result, digest: str | None = None, target: str | None = None
    ) -> Entry:
        """The entry an lstat describes (``digest`` for files, ``target`` for symlinks)."""
        kind = TYPES.get(stat.S_IFMT(st.st_mode))
        if kind is None:
            raise UnsafePath(path, f"has an unknown file type {oct(st.st_mode)}")
        size = st.st_size if kind in (FILE, SYMLINK) else 0
        rdev = st.st_rdev if kind in DEVICES else None
        return cls(path, kind, stat.S_IMODE(st.st_mode), size, digest, target, rdev,
                   st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)  # fmt: skip

    def without_stat(self) -> Entry:
        return Entry(
            self.path, self.type, self.mode, self.size, self.digest, self.target, self.rdev
        )

    def canonical(self) -> dict[str, Any]:
        """The manifest form: path, type, mode, size and digest | target | rdev."""
        form: dict[str, Any] = {"path": self.path, "type": self.type, "mode": self.mode}
        form["size"] = self.size
        if self.type == FILE:
            form["digest"] = self.digest
        elif self.type == SYMLINK:
            form["target"] = self.target
        elif self.type in DEVICES:
            form["rdev"] = self.rdev
        return form

    @classmethod
    def from_canonical(cls, form: Any, algorithm: str) -> Entry:
        if not isinstance(form, dict):
            raise ValueError(f"entry {form!r} is not an object")
        kind, path = form.get("type"), check_path(form.get("path"))
        if kind not in ENTRY_TYPES:
            raise ValueError(f"entry {path!r} has unknown type {kind!r}")
        extra = {FILE: "digest", SYMLINK: "target"}.get(kind, "rdev" if kind in DEVICES else None)
        if set(form) != {"path", "type", "mode", "size"} | ({extra} if extra else set()):
            raise ValueError(f"entry {path!r} has fields {sorted(form)}")
        entry = cls(
            path, kind, form["mode"], form["size"], **({extra: form[extra]} if extra else {})
        )
        entry.check(algorithm)
        return entry

    def check(self, algorithm: str) -> None:
        """Refuse an entry whose fields do not fit its type (``ValueError`` naming the path)."""
        path = self.path
        if not _is_int(self.mode) or not 0 <= self.mode <= 0o7777:
            raise ValueError(f"entry {path!r} has mode {self.mode!r}")
        if not _is_int(self.size) or self.size < 0:
            raise ValueError(f"entry {path!r} has size {self.size!r}")
        if self.size and self.type not in (FILE, SYMLINK):
            raise ValueError(f"entry {path!r} is a {self.type} of size {self.size}, not 0")
        if self.type == FILE and parse_digest(self.digest)[0] != algorithm:
            raise ValueError(f"entry {path!r} digest {self.digest} is not {algorithm}")
        if self.type == SYMLINK:
            target = self.target
            if not isinstance(target, str) or not target or "\0" in target:
                raise ValueError(f"entry {path!r} has symlink target {target!r}")
            if self.size != len(target.encode("utf-8")):
                raise ValueError(f"entry {path!r} size {self.size} != target length")
        if self.type in DEVICES and not _is_int(self.rdev):
            raise ValueError(f"entry {path!r} has rdev {self.rdev!r}")
        if path == ROOT and self.type != DIR:
            raise ValueError(f"the root entry is a {self.type}, not a dir")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Index:
    """A scan's entries in canonical order (sorted by path; the root is ``"."``) with the stat
    cache. A stat match vouches for an entry only if its mtime and ctime are strictly older
    than ``trusted_before_ns`` (the racy-git rule)."""

    algorithm: str
    scan_started_ns: int
    trusted_before_ns: int
    entries: tuple[Entry, ...]

    @cached_property
    def by_path(self) -> dict[str, Entry]:
        return {entry.path: entry for entry in self.entries}

    @cached_property
    def paths(self) -> list[str]:
        return [entry.path for entry in self.entries]

    def to_bytes(self) -> bytes:
        rows = [
            [e.path, e.type, e.mode, e.size, e.digest, e.target, e.rdev,
             e.ino, e.dev, e.mtime_ns, e.ctime_ns]
            for e in self.entries
        ]  # fmt: skip
        return canonical_bytes(
            {"v": INDEX_VERSION, "algorithm": self.algorithm, "entries": rows,
             "scan_started_ns": self.scan_started_ns, "trusted_before_ns": self.trusted_before_ns}
        )  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> Index:
        try:
            raw = json.loads(data)
            if raw["v"] != INDEX_VERSION:
                raise ValueError(f"version {raw['v']!r} is not {INDEX_VERSION}")
            rows = raw["entries"]
            if any(len(row) != len(Entry._fields) for row in rows):
                raise ValueError(f"an entry row does not have the {len(Entry._fields)} fields")
            entries = tuple(Entry(*row) for row in rows)
            index = cls(check_algorithm(raw["algorithm"]), int(raw["scan_started_ns"]),
                        int(raw["trusted_before_ns"]), entries)  # fmt: skip
        except (KeyError, TypeError, ValueError, SettledError) as error:
            raise IndexMismatch(f"stored index is unusable: {error}") from None
        if any(a.path >= b.path for a, b in itertools.pairwise(entries)):
            raise IndexMismatch("stored index entries are not sorted and unique")
        return index


@dataclass(frozen=True)
class Manifest:
    """A tree's canonical record. Entries carry no stat cache (see ``Entry.without_stat``)."""

    algorithm: str
    entries: tuple[Entry, ...]
    parent: str | None = None  # the previous manifest id of this workspace
    watermark: int | None = None  # the mutation sequence number the tree covers
    generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "algorithm": self.algorithm,
            "entries": [entry.canonical() for entry in self.entries],
            "parent": self.parent,
            "watermark": self.watermark,
            "generation": self.generation,
        }

    def to_bytes(self) -> bytes:
        return canonical_bytes(self.to_dict())

    @property
    def id(self) -> str:
        return digest_bytes(self.algorithm, self.to_bytes())

    @classmethod
    def from_dict(cls, raw: Any, manifest_id: str = "(unwritten)") -> Manifest:
        """Parse and validate; ``ManifestInvalid`` names the first problem."""
        try:
            if not isinstance(raw, dict) or set(raw) != _MANIFEST_KEYS:
                raise ValueError(f"top-level fields are not {sorted(_MANIFEST_KEYS)}")
            if raw["v"] != MANIFEST_VERSION:
                raise ValueError(f"version {raw['v']!r}")
            algorithm = check_algorithm(raw["algorithm"])
            if not isinstance(raw["entries"], list):
                raise ValueError("entries is not a list")
            manifest = cls(
                algorithm,
                tuple(Entry.from_canonical(form, algorithm) for form in raw["entries"]),
                raw["parent"],
                raw["watermark"],
                raw["generation"],
            )
            manifest.check()
        except (ValueError, SettledError) as error:
            raise ManifestInvalid(manifest_id, str(error)) from None
        return manifest

    def check(self) -> None:
        """Lineage fields typed, entries sorted and unique, one root, every parent a dir."""
        if self.parent is not None:
            parse_digest(self.parent)
        if self.watermark is not None and (not _is_int(self.watermark) or self.watermark < 0):
            raise ValueError(f"watermark {self.watermark!r} is not a sequence number")
        if not _is_int(self.generation) or self.generation < 0:
            raise ValueError(f"generation {self.generation!r} is not a generation")
        kinds: dict[str, str] = {}
        last = ""
        for entry in self.entries:
            entry.check(self.algorithm)
            if entry.path <= last:
                raise ValueError(f"entries not sorted and unique at {entry.path!r}")
            kinds[entry.path], last = entry.type, entry.path
        if kinds.get(ROOT) != DIR:
            raise ValueError("no root entry '.'")
        for path in kinds:
            if path != ROOT and kinds.get(parent_of(path)) != DIR:
                raise ValueError(f"parent of {path!r} is not a directory in the manifest")

    def files(self) -> dict[str, list[str]]:
        """Digest -> paths of the files with that content."""
        found: dict[str, list[str]] = {}
        for entry in self.entries:
            if entry.type == FILE and entry.digest is not None:
                found.setdefault(entry.digest, []).append(entry.path)
        return found


def build_manifest(
    index: Index, *, parent: str | None = None, watermark: int | None = None, generation: int = 0
) -> Manifest:
    """The manifest of a scan: the index's entries without their stat cache."""
    entries = tuple(entry.without_stat() for entry in index.entries)
    return Manifest(index.algorithm, entries, parent, watermark, generation)


def write_manifest(store: ObjectStore, manifest: Manifest) -> str:
    """Store the manifest as an object, last: refuses if any blob it names is not present."""
    try:
        manifest.check()
    except (ValueError, SettledError) as error:
        raise ManifestInvalid("(unwritten)", str(error)) from None
    for digest, paths in manifest.files().items():
        if not store.has(digest):
            raise MissingBlob(digest, paths[0])
    return store.put_bytes(manifest.to_bytes(), manifest.algorithm)


def read_manifest(store: ObjectStore, manifest_id: str) -> Manifest:
    """Read back exactly ``manifest_id``: re-hashed, canonical and valid, or refused."""
    algorithm = parse_digest(manifest_id)[0]
    data = store.read(manifest_id)
    actual = digest_bytes(algorithm, data)
    if actual != manifest_id:
        raise ManifestCorrupt(manifest_id, actual)
    try:
        raw = json.loads(data)
    except ValueError as error:
        raise ManifestInvalid(manifest_id, f"not JSON: {error}") from None
    if canonical_bytes(raw) != data:
        raise ManifestInvalid(manifest_id, "bytes are not canonical JSON")
    manifest = Manifest.from_dict(raw, manifest_id)
    if manifest.algorithm != algorithm:
        raise ManifestInvalid(manifest_id, f"algorithm {manifest.algorithm} differs from its id")
    return manifest


@dataclass(frozen=True)
class ObjectProblem:
    digest: str
    problem: str  # "missing" | "mismatch" | "not in manifest"
    paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class ManifestVerification:
    """What re-hashing a manifest and its blobs found; ``ok`` only if nothing was wrong."""

    manifest_id: str
    manifest_error: str | None = None  # the manifest itself failed: no blob was checked
    checked: int = 0
    problems: tuple[ObjectProblem, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.manifest_error is None and not self.problems


def verify_manifest(
    store: ObjectStore, manifest_id: str, digests_to_verify: Iterable[str] | None = None
) -> ManifestVerification:
    """Re-hash the manifest object and each referenced blob in ``digests_to_verify`` (or all)."""
    try:
        manifest = read_manifest(store, manifest_id)
    except (ManifestError, ObjectMissing) as error:
        return ManifestVerification(manifest_id, manifest_error=str(error))
    files = manifest.files()
    wanted = list(files) if digests_to_verify is None else sorted(set(digests_to_verify))
    problems = [ObjectProblem(d, "not in manifest") for d in wanted if d not in files]
    checked = 0
    for digest in (d for d in wanted if d in files):
        checked += 1
        if not store.has(digest):
            problems.append(ObjectProblem(digest, "missing", tuple(files[digest])))
        elif not store.verify(digest):
            problems.append(ObjectProblem(digest, "mismatch", tuple(files[digest])))
    return ManifestVerification(manifest_id, None, checked, tuple(problems))
