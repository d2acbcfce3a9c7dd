"""``settled verify``: every object a manifest reaches, checked like ``restic check``.

Owns ``verify_manifest`` and its report, ``Verification``: read the manifest by its exact id and
re-hash it; read, re-hash and fully parse (``parse_tree``: every entry valid, names sorted and
safe) every tree it reaches; then each blob is checked present, a regular file and of the size
its entries give (the default), or, with ``read_data``, re-hashed byte for byte. A sparse file's
objects are its extents (each of its extent's length); with ``read_data`` its digest is checked
too, over its extents' bytes and its holes as zeros (``sparse.logical_digest``: CPU for the
holes, never a read of them), so every byte the entry names is checked. Every missing, damaged
or invalid object is named with every path that uses it. The members of a hard-link group
(``Entry.link``) are one inode, so they must agree: a member whose content, size, mode or owner
differs from the group's first is named (``link_group``), with both paths.

Unlike the checkpoint's read-back (``readback``), nothing is trusted: the verified-object record
is never consulted, only refreshed for each object that re-hashed right (so a later read-back
need not read it again). Nothing is healed or moved either: this is the audit, not the repair.

Must never: modify the store; stop at the first problem; count an object it did not check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from settled.errors import SettledError
from settled.objects import ObjectMissing, ObjectStore, ObjectUnreadable
from settled.objects.hashing import algorithm_of
from settled.workspace.manifest import (
    DIR,
    FILE,
    ROOT,
    Entry,
    Manifest,
    ManifestError,
    parse_tree,
    read_head,
)
from settled.workspace.readback import DAMAGED, INVALID, MISSING, Problem, rehash
from settled.workspace.sparse import Extent, logical_digest
from settled.workspace.verified import Verified, VerifiedRecord

LINK_GROUP = "link_group"  # a problem's object prefix: a hard-link group whose members disagree

_SparseKey = tuple[str, int, tuple[Extent, ...]]  # a sparse file's digest, size and extents


def _sparse_key(entry: Entry) -> _SparseKey:
    assert entry.digest is not None and entry.extents is not None
    return entry.digest, entry.size, entry.extents


@dataclass(frozen=True)
class Verification:
    manifest_id: str
    read_data: bool
    objects: int  # distinct objects reached: the manifest, its trees and its blobs
    trees: int
    blobs: int
    bytes_read: int  # of the manifest, the trees and (with read_data) the blobs
    problems: tuple[Problem, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest_id,
            "verified": self.ok,
            "read_data": self.read_data,
            "objects": self.objects,
            "trees": self.trees,
            "blobs": self.blobs,
            "bytes_read": self.bytes_read,
            "problems": [problem.to_json() for problem in self.problems],
        }


def verify_manifest(
    store: ObjectStore,
    manifest_id: str,
    *,
    read_data: bool = False,
    record: VerifiedRecord | None = None,
) -> Verification:
    """Check everything ``manifest_id`` reaches; ``read_data`` re-hashes every blob too."""
    check = _Check(store)
    check.run(manifest_id, read_data)
    if record is not None:
        record.record(check.identities)
        record.forget(check.problems)
    return check.result(manifest_id, read_data)


class _Check:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.problems: dict[str, Problem] = {}
        self.tree_paths: dict[str, list[str]] = {}
        self.blob_paths: dict[str, list[str]] = {}
        self.sizes: dict[str, set[int]] = {}
        self.sparse: dict[_SparseKey, list[str]] = {}  # sparse files' content -> their paths
        self.identities: list[tuple[str, Verified]] = []
        self.bytes_read = 0
        self.groups: dict[str, tuple[tuple[object, ...], str]] = {}  # link key -> first member
        self.group_paths: dict[str, list[str]] = {}  # a disagreeing group -> its members

    def run(self, manifest_id: str, read_data: bool) -> None:
        got = self._rehash(manifest_id)
        if got is None:
            return
        try:
            head = read_head(self.store, manifest_id)
        except (ManifestError, SettledError) as error:
            self.problems[manifest_id] = Problem(manifest_id, INVALID, detail=str(error))
            return
        if isinstance(head, Manifest):  # a flat v1 manifest: its entries are in it
            for entry in head.entries:
                if entry.type == FILE and entry.digest is not None:
                    self._blob(entry.digest, entry.path, entry.size)
        else:
            assert head.root.tree is not None
            self._trees(head.root.tree)
        for digest in sorted(self.blob_paths):
            if read_data:
                self._read_blob(digest)
            else:
                self._stat_blob(digest)
        if read_data:
            for key in sorted(self.sparse):
                self._check_sparse(key, algorithm_of(manifest_id))

    def _check_sparse(self, key: _SparseKey, algo: str) -> None:
        """A sparse file's digest against its extents and holes (extents found damaged are
        named already: the file is not hashed again over them)."""
        digest, size, extents = key
        if any(extent[2] in self.problems for extent in extents):
            return
        actual = logical_digest(self.store, algo, size, extents)
        self.bytes_read += sum(length for _, length, _ in extents)
        if actual != digest:
            detail = f"its extents and holes hash to {actual or '(an extent is missing)'}"
            self.problems[digest] = Problem(digest, DAMAGED, detail=detail)

    def _trees(self, root: str) -> None:
        """Every tree, each occurrence of a shared one walked (for its paths), each read once."""
        read: dict[str, bytes | None] = {}
        pending = [(root, ROOT)]
        while pending:
            tree, path = pending.pop()
            self.tree_paths.setdefault(tree, []).append(path)
            if tree not in read:
                read[tree] = self._rehash(tree)
            data = read[tree]
            if data is None:
                continue
            try:
                entries = parse_tree(data, tree, path)
            except ManifestError as error:
                self.problems[tree] = Problem(tree, INVALID, detail=str(error))
                read[tree] = None
                continue
            for entry in entries:
                if entry.link is not None:
                    self._link_member(entry)
                if entry.type == FILE and entry.digest is not None and entry.extents is not None:
                    for _, length, digest in entry.extents:
                        self._blob(digest, entry.path, length)
                    self.sparse.setdefault(_sparse_key(entry), []).append(entry.path)
                elif entry.type == FILE and entry.digest is not None:
                    self._blob(entry.digest, entry.path, entry.size)
                elif entry.type == DIR and entry.tree is not None:
                    pending.append((entry.tree, entry.path))

    def _link_member(self, entry: Entry) -> None:
        """A hard-link group's member agrees with its first (one inode: one content, size,
        mode and owner), else the group is named as a problem with both paths."""
        assert entry.link is not None
        facts = (entry.digest, entry.size, entry.extents, entry.mode, entry.uid, entry.gid)
        first = self.groups.setdefault(entry.link, (facts, entry.path))
        if first[0] != facts:
            key = f"{LINK_GROUP}:{entry.link}"
            detail = (
                f"{entry.path!r} records another content, size, mode or owner than {first[1]!r}"
            )
            self.problems.setdefault(key, Problem(key, INVALID, detail=detail))
            self.group_paths.setdefault(key, [first[1]]).append(entry.path)

    def _blob(self, digest: str, path: str, size: int) -> None:
        self.blob_paths.setdefault(digest, []).append(path)
        self.sizes.setdefault(digest, set()).add(size)

    def _rehash(self, digest: str) -> bytes | None:
        """The object's bytes if they hash to its name, else None and its problem."""
        got = rehash(self.store, digest, keep=True)
        self.bytes_read += got.size
        if got.problem is not None:
            self.problems[digest] = got.problem
            return None
        if got.identity is not None:
            self.identities.append((digest, got.identity))
        return got.data

    def _read_blob(self, digest: str) -> None:
        got = rehash(self.store, digest)
        self.bytes_read += got.size
        if got.problem is not None:
            self.problems[digest] = got.problem
        elif self.sizes[digest] != {got.size}:
            self._wrong_size(digest, got.size)
        elif got.identity is not None:
            self.identities.append((digest, got.identity))

    def _stat_blob(self, digest: str) -> None:
        try:
            size = self.store.stamp(digest).size
        except ObjectMissing:
            self.problems[digest] = Problem(digest, MISSING)
            return
        except ObjectUnreadable as error:  # not a regular file
            self.problems[digest] = Problem(digest, INVALID, detail=error.detail)
            return
        except (OSError, SettledError) as error:
            self.problems[digest] = Problem(digest, INVALID, detail=str(error))
            return
        if self.sizes[digest] != {size}:
            self._wrong_size(digest, size)

    def _wrong_size(self, digest: str, size: int) -> None:
        said = ", ".join(str(s) for s in sorted(self.sizes[digest]))
        detail = f"is {size} bytes; its entries say {said}"
        self.problems[digest] = Problem(digest, DAMAGED, detail=detail)

    def result(self, manifest_id: str, read_data: bool) -> Verification:
        paths = {**self.blob_paths, **self.tree_paths, **self.group_paths}
        for (digest, _, _), used_by in self.sparse.items():
            paths[digest] = [*paths.get(digest, []), *used_by]
        problems = tuple(
            Problem(p.object, p.problem, tuple(sorted(paths.get(d, []))), p.detail)
            for d, p in sorted(self.problems.items())
        )
        objects = 1 + len((self.tree_paths.keys() | self.blob_paths.keys()) - {manifest_id})
        return Verification(
            manifest_id, read_data, objects, len(self.tree_paths), len(self.blob_paths),
            self.bytes_read, problems,
        )  # fmt: skip
