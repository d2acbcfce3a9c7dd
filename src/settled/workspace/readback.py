"""The checkpoint's read-back: every object its manifest reaches, checked, or the receipt says
which subtrees it trusted and from where.

Owns ``read_back`` and what it reports (``ReadBack``, ``Problem``), and ``rehash``, the one way
an object is re-read here: the store's ``reread`` (for the local store: opened without
following, fstat before and after, every byte hashed), its outcome named as a ``Problem``.

What "checked" means. The manifest is re-read by its exact id and re-hashed, always. Then every
tree and blob it reaches is either re-hashed now, or trusted because the verified-object record
(``verified``) holds the identity its stored copy had when it last hashed right and the store's
``stamp`` now (an ``lstat``, for the local store) gives that identity unchanged (the racy-git
rule applied to the object store). Objects this checkpoint published (``fresh``) are always
re-hashed. A packed object is also trusted when its pack was verified whole (every member it
names re-hashed right between one pair of fstats, ``Reread.whole``) and the pack and its index
are unchanged since: one row per pack (``VerifiedRecord.packs``), which a read-back that asked
for at least half of a pack's members records instead of one row per object (a close re-hashed
the earlier checkpoint's 1,000 blobs and wrote 1,000 random-key rows, slower as the table
grew). A re-hash that matches refreshes the record; one that does not, or an object that is
gone, is a ``Problem``, named with every path that uses it.

Two scopes. ``closure`` (the close, and any full scan) walks everything the manifest reaches.
The listing of a tree comes from the scan's in-memory index when its node is there and names
that very tree (a node's tree id is the hash of the tree bytes built from its rows, so the
listing is the tree's content, and re-hashing the tree is all its check needs: no parse, which
cost ~0.5 ms a 100-entry tree here); otherwise the tree is read, re-hashed and parsed.
A sparse file's objects are its extents' (its digest names its logical content, which no object
holds; the scan computed it from the very bytes it published as extents).
Cost: an lstat and a record compare per object. Measured here (2 shared vCPUs, load 2-4, where
an lstat alone costs ~5 us): 1.2-1.35 s for a 100,000-file workspace whose objects are all
unchanged since verified, where the read-back that checked only what was published took 0.06 s.

``since_parent`` (an incremental checkpoint while the task is open) descends only into the
trees this checkpoint published: it checks each of their entries (blobs, and the roots of the
subtrees they reuse) the same way, but does not descend into a reused subtree; its contents
are trusted from the parent checkpoint, whose read-back checked them (in its own scope, back to
a closure read-back). The receipt says so: ``trusted_subtrees`` and ``trusted_from``, and it
is not ``verified`` (issue 36: an object of a reused subtree deleted from the store since the
parent's read-back is not seen), but ``unchecked`` names what it left to the parent; only a
read-back of the whole closure (or one that reused no subtree) is ``verified``. Its cost
follows the change: the entries of the directories that changed (after 100 changed files in
100 directories of 100 files, ~11,000 objects: 0.14-0.16 s here, against 0.03-0.06 s before).

A listing taken from the index is not held after its tree is walked (a workspace of millions
of entries would be held whole again); to name a problem's paths, it is read again.

About 440 lines, over the usual 400: the walk, its two sources of listings, the trust check
and the naming of paths share one walker's state, and split they would share internals.

Must never: trust an object the record does not vouch for; count an object as checked that
was neither re-hashed nor trusted; follow a symlink or open anything but a regular file in the
store; modify the store (quarantining is the caller's decision).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from settled.errors import SettledError
from settled.objects import (
    ObjectMissing,
    ObjectStore,
    ObjectUnreadable,
    Reread,
    Stamp,
)
from settled.workspace.index import DirNode, Index
from settled.workspace.manifest import (
    DIR,
    EXTENTS,
    FILE,
    ROOT,
    IndexMismatch,
    Manifest,
    ManifestCorrupt,
    ManifestError,
    MissingObject,
    join,
    read_head,
)
from settled.workspace.verified import Verified, VerifiedRecord

CLOSURE: Final = "closure"
SINCE_PARENT: Final = "since_parent"
MISSING, DAMAGED, INVALID = "missing", "damaged", "invalid"
QUARANTINABLE: Final = frozenset({DAMAGED, INVALID})  # present, but not what its name says


@dataclass(frozen=True)
class Problem:
    """An object the manifest reaches that is missing, damaged (its bytes hash to something
    else), invalid (not a regular file, or a tree that does not parse), or the wrong size."""

    object: str
    problem: str
    paths: tuple[str, ...] = ()  # every path of the manifest that uses it ("." for the root)
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"object": self.object, "problem": self.problem}
        out["paths"] = list(self.paths)
        if self.detail:
            out["detail"] = self.detail
        return out

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        shown = ", ".join(self.paths[:10]) + (
            f" and {len(self.paths) - 10} more" if len(self.paths) > 10 else ""
        )
        return f"{self.object} {self.problem}{detail}, used by {shown or 'the manifest'}"


@dataclass(frozen=True)
class Rehash:
    """One object re-read: its problem (None if it hashed to its name), its bytes if kept,
    how many bytes were read, and the identity to record (None if it changed while read)."""

    problem: Problem | None
    data: bytes | None = None
    size: int = 0
    identity: Verified | None = None


def rehash(store: ObjectStore, digest: str, *, keep: bool = False) -> Rehash:
    """Re-read ``digest`` from the store and hash every byte; ``keep`` returns the bytes."""
    try:
        got = store.reread(digest, keep=keep)
    except SettledError as error:  # missing, unreadable, or not a digest
        return _rehashed(digest, error)
    return _rehashed(digest, got)


def _rehashed(digest: str, got: Reread | Exception) -> Rehash:
    if isinstance(got, ObjectMissing):
        return Rehash(Problem(digest, MISSING))
    if isinstance(got, ObjectUnreadable):  # a symlink holds the name, or not a regular file
        return Rehash(Problem(digest, INVALID, detail=got.detail))
    if isinstance(got, Exception):  # not a digest, or unreadable
        return Rehash(Problem(digest, INVALID, detail=str(got)))
    if got.actual != digest:
        return Rehash(Problem(digest, DAMAGED, detail=f"reads back as {got.actual}"), size=got.size)
    identity = None if got.stamp is None else Verified.of_stamp(got.stamp, got.started_ns)
    return Rehash(None, got.data, got.size, identity)


@dataclass(frozen=True)
class ReadBack:
    """What one read-back checked and found; ``ok`` only if no object had a problem."""

    manifest_id: str
    scope: str
    objects_reached: int  # distinct objects: the manifest, and every tree and blob reached
    rehashed: int  # re-hashed now (the manifest included)
    trusted: int  # unchanged since a re-hash the verified-object record holds
    trees_rehashed: int
    blobs_rehashed: int
    trusted_subtrees: int  # since_parent: reused subtrees whose contents were not walked
    bytes_read: int
    problems: tuple[Problem, ...] = field(default=())
    record: str | None = None  # why the verified-object record could not be used, if not

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def whole(self) -> bool:
        """Every object the manifest reaches was re-hashed now or trusted from the
        verified-object record's own re-hash: none of it only from a parent's read-back."""
        return self.scope == CLOSURE or self.trusted_subtrees == 0

    def summary(self, trusted_from: str | None) -> dict[str, Any]:
        """The receipt's ``read_back``: ``verified`` only if nothing had a problem and the
        whole closure was checked (``whole``); else ``unchecked`` says what was not."""
        out: dict[str, Any] = {
            "id": self.manifest_id,
            "verified": self.ok and self.whole,
            "problems_found": len(self.problems),
            "scope": self.scope,
            "objects_reached": self.objects_reached,
            "rehashed": self.rehashed,
            "trusted": self.trusted,
            "trees_verified": self.trees_rehashed,
            "blobs_verified": self.blobs_rehashed,
            "trusted_subtrees": self.trusted_subtrees,
            "trusted_from": trusted_from if self.scope == SINCE_PARENT else None,
            "bytes_read": self.bytes_read,
        }
        if not self.whole:
            out["unchecked"] = (
                f"the objects below {self.trusted_subtrees} reused subtrees, trusted from the "
                f"read-back of {trusted_from}; a full checkpoint (--full) or the close checks them"
            )
        if self.record is not None:
            out["record"] = self.record
        return out


Listing = DirNode | list[dict[str, Any]]  # a tree's entries: its index node, or parsed forms


def read_back(
    store: ObjectStore,
    manifest_id: str,
    *,
    record: VerifiedRecord | None,
    index: Index | None = None,
    root_tree: str | None = None,
    fresh: Collection[str] = (),
    open_trees: Collection[str] | None = None,
    manifest_version: str | None = None,
) -> ReadBack:
    """Read back ``manifest_id`` and check what it reaches (see the module's docstring).

    ``index``: the scan's index, for listings without reading trees. ``root_tree``: the tree
    the manifest must name (the walk starts there even if the manifest cannot be read, so one
    read-back finds every problem). ``fresh``: objects never to trust (published now).
    ``open_trees``: None for the closure; else the only trees to descend into (since_parent).
    ``manifest_version``: the manifest is read at exactly this version (the one its write
    returned), so the read-back names the very upload it re-hashed.
    """
    walk = _Walk(store, record, index, frozenset(fresh))
    trees = None if open_trees is None else frozenset(open_trees)
    walk.run(manifest_id, root_tree, trees, manifest_version)
    return walk.result(manifest_id, CLOSURE if open_trees is None else SINCE_PARENT)


class _Walk:
    def __init__(
        self,
        store: ObjectStore,
        record: VerifiedRecord | None,
        index: Index | None,
        fresh: frozenset[str],
    ) -> None:
        self.store, self.record, self.index, self.fresh = store, record, index, fresh
        self.trees: dict[str, str] = {}  # tree id -> the first path it was reached at
        self.blobs: set[str] = set()
        self.listings: dict[str, Listing] = {}  # trees read from the store, parsed
        self.indexed: set[str] = set()  # trees listed from the index's nodes
        self.problems: dict[str, Problem] = {}
        self.done: set[str] = set()  # objects re-hashed (with or without a problem)
        self.identities: list[tuple[str, Verified]] = []
        # packs re-hashed whole: (volume, copy) -> a member's stamp and when the re-hash began
        self.whole_packs: dict[tuple[int, int], tuple[Stamp, int]] = {}
        self.trees_rehashed = self.blobs_rehashed = self.trusted = 0
        self.subtrees = self.bytes_read = 0
        self.root: str | None = None

    def run(
        self,
        manifest_id: str,
        root_tree: str | None,
        open_trees: frozenset[str] | None,
        version: str | None = None,
    ) -> None:
        self.root = self._manifest(manifest_id, root_tree, version)
        pending = [] if self.root is None else [(self.root, ROOT)]
        while pending:
            tree, path = pending.pop()
            if tree in self.trees:
                continue
            self.trees[tree] = path
            if open_trees is not None and tree not in open_trees:
                self.subtrees += 1  # checked below; its contents are trusted from the parent
                continue
            # What a tree names: its index node (re-hashed or trusted below, like any object;
            # if it is damaged, what it should name is still walked), else the tree read now.
            listing: Listing | None = self._from_index(tree, path)
            if listing is None:
                listing = self._read_tree(tree)
                if listing is None:
                    continue
            if isinstance(listing, DirNode):  # read again from the index if a problem needs
                self.indexed.add(tree)  # it: held, millions of entries would stay in memory
            else:
                self.listings[tree] = listing
            self._enter(listing, path, pending)
        # trees and blobs in one call: the store reads a pack's members together (and can
        # verify the pack whole, which the blobs alone, without its trees, never were)
        trees = [t for t in self.trees if t not in self.done]
        self._check(trees + [b for b in self.blobs if b not in self.done and b not in self.trees])
        if self.record is not None:
            self.record.record(self.identities)
            self.record.record_packs(self.whole_packs.values())
            self.record.forget(self.problems)

    def _manifest(self, manifest_id: str, root_tree: str | None, version: str | None) -> str | None:
        """Re-hash and parse the manifest; the root tree to walk from (None: nothing to walk)."""
        self.done.add(manifest_id)
        try:
            head = read_head(self.store, manifest_id, version)
        except MissingObject:
            self.problems[manifest_id] = Problem(manifest_id, MISSING)
            return root_tree
        except ManifestCorrupt as error:
            self.problems[manifest_id] = Problem(manifest_id, DAMAGED, detail=str(error))
            return root_tree
        except (ManifestError, SettledError, OSError) as error:
            self.problems[manifest_id] = Problem(manifest_id, INVALID, detail=str(error))
            return root_tree
        if isinstance(head, Manifest):
            detail = "a flat v1 manifest: checkpoints never write one any more"
            self.problems[manifest_id] = Problem(manifest_id, INVALID, detail=detail)
            return None
        if root_tree is not None and head.root.tree != root_tree:
            detail = f"names root tree {head.root.tree}, not the scanned {root_tree}"
            self.problems[manifest_id] = Problem(manifest_id, INVALID, detail=detail)
            return root_tree
        return head.root.tree

    def _enter(self, listing: Listing, path: str, pending: list[tuple[str, str]]) -> None:
        """Note the blobs a tree names and queue its subtrees (the hot loop of a closure)."""
        add, trees = self.blobs.add, self.trees
        if isinstance(listing, DirNode):  # its entries' paths are under ``path`` already
            for entry in listing.entries.values():
                kind = entry.type
                if kind == FILE and entry.digest is not None:
                    if entry.extents is None:
                        add(entry.digest)
                    else:  # a sparse file's digest is not an object: its extents are
                        self.blobs.update(digest for _, _, digest in entry.extents)
                elif kind == DIR and entry.tree is not None and entry.tree not in trees:
                    pending.append((entry.tree, entry.path))
            return
        for form in listing:
            if form["type"] == FILE:
                if EXTENTS in form:
                    self.blobs.update(extent[2] for extent in form[EXTENTS])
                else:
                    add(form["digest"])
            elif form["type"] == DIR and form["tree"] not in trees:
                pending.append((form["tree"], join(path, form["name"])))

    def _listing(self, tree: str, path: str) -> Listing | None:
        """What the walk listed of ``tree`` at ``path``, for naming a problem's paths."""
        if tree in self.indexed:
            return self._from_index(tree, path)
        return self.listings.get(tree)

    def _from_index(self, tree: str, path: str) -> DirNode | None:
        if self.index is None:
            return None
        try:
            node = self.index.node(path)
        except IndexMismatch:  # a node the cache lost: read the tree instead
            return None
        return node if node is not None and node.tree == tree else None

    def _read_tree(self, tree: str) -> list[dict[str, Any]] | None:
        """Re-hash a tree and parse what it names; None (and a problem) if that fails."""
        got = self._rehash(tree, keep=True, is_tree=True)
        if got.problem is not None or got.data is None:
            return None
        try:
            forms = json.loads(got.data)["entries"]
            for form in forms:
                if not isinstance(form["name"], str) or not isinstance(form["type"], str):
                    raise TypeError("an entry's name or type is not a string")
                content = form.get("tree" if form["type"] == DIR else "digest")
                if form["type"] in (DIR, FILE) and not isinstance(content, str):
                    raise TypeError(f"entry {form['name']!r} names no object")
                if EXTENTS in form and not _extent_forms(form[EXTENTS]):
                    raise TypeError(f"entry {form['name']!r} has malformed extents")
        except (ValueError, KeyError, TypeError) as error:
            self.problems[tree] = Problem(tree, INVALID, detail=f"not a tree: {error}")
            return None
        return forms  # type: ignore[no-any-return]

    def _check(self, digests: list[str]) -> None:
        """Each object: trusted if the record vouches for it now (one stamp, and its identity
        compared with the record's), else re-hashed. Fresh objects are never looked up."""
        fresh = self.fresh
        candidates = [d for d in digests if d not in fresh] if fresh else digests
        rehash = [d for d in digests if d in fresh] if fresh else []
        if self.record is not None and candidates:
            known = self.record.known(candidates)
            packs = self.record.packs()  # with any, every candidate is stamped: packed ones
            vouched = candidates if packs else [d for d in candidates if known.get(d) is not None]
            if len(vouched) < len(candidates):
                rehash += [d for d in candidates if known.get(d) is None]
            trusted = 0
            stamps = self.store.stamps(vouched)  # one call: a remote store overlaps them
            for digest, stamp in zip(vouched, stamps, strict=True):  # ~12 us an object, local
                if isinstance(stamp, ObjectMissing):
                    self.done.add(digest)
                    self.problems[digest] = Problem(digest, MISSING)
                    continue
                if isinstance(stamp, Exception):
                    rehash.append(digest)  # which names the problem
                    continue
                if stamp == known.get(digest) or (
                    packs
                    and packs.get((stamp.volume, stamp.copy))
                    == (stamp.changed_ns, stamp.modified_ns)
                ):  # its own row, or its pack's (changed_ns, modified_ns) verified whole
                    trusted += 1
                else:
                    rehash.append(digest)  # changed since verified: re-hashed, maybe a problem
            self.trusted += trusted
        else:
            rehash += candidates
        self._rehash_all(rehash)

    def _rehash_all(self, digests: list[str]) -> None:
        """Re-hash each (the store asked for all at once). An object that hashed to its name
        is noted inline (its identity kept only if it could vouch: ``Verified.could_settle``;
        its pack's alone if the pack was verified whole); anything else goes through
        ``_rehashed`` and ``_note``, which name its problem. The hot loop of a first
        checkpoint's read-back: ~1,000 objects of the pack just written."""
        done, identities, trees = self.done, self.identities, self.trees
        count = size = 0
        for digest, got in zip(digests, self.store.rereads(digests), strict=True):
            if type(got) is not Reread or got.actual != digest:
                self._note(digest, _rehashed(digest, got), is_tree=digest in trees)
                continue
            done.add(digest)
            if digest in trees:
                self.trees_rehashed += 1
            else:
                count += 1
            size += got.size
            stamp = got.stamp
            if stamp is None or not Verified.could_settle(stamp, got.started_ns):
                continue
            if got.whole:  # its pack verified whole: one row for all of its members
                self.whole_packs[(stamp.volume, stamp.copy)] = (stamp, got.started_ns)
            else:
                identities.append((digest, Verified.of_stamp(stamp, got.started_ns)))
        self.bytes_read += size
        self.blobs_rehashed += count

    def _rehash(self, digest: str, *, keep: bool, is_tree: bool) -> Rehash:
        return self._note(digest, rehash(self.store, digest, keep=keep), is_tree=is_tree)

    def _note(self, digest: str, got: Rehash, *, is_tree: bool) -> Rehash:
        self.done.add(digest)
        self.bytes_read += got.size
        if is_tree:
            self.trees_rehashed += 1
        else:
            self.blobs_rehashed += 1
        if got.problem is not None:
            self.problems[digest] = got.problem
        elif got.identity is not None:
            self.identities.append((digest, got.identity))
        return got

    def result(self, manifest_id: str, scope: str) -> ReadBack:
        problems = self.problems
        if problems:
            paths = _paths_of(set(problems), self.root, self._listing)
            problems = {d: _with_paths(p, paths.get(d, [])) for d, p in problems.items()}
        reached = 1 + len((self.trees.keys() | self.blobs) - {manifest_id})
        rehashed = 1 + self.trees_rehashed + self.blobs_rehashed
        return ReadBack(
            manifest_id, scope, reached, rehashed, self.trusted, self.trees_rehashed,
            self.blobs_rehashed, self.subtrees, self.bytes_read,
            tuple(problems[d] for d in sorted(problems)),
            self.record.unusable if self.record is not None else "not used: all re-hashed",
        )  # fmt: skip


def _extent_forms(raw: object) -> bool:
    """Whether a tree form's ``extents`` is a list of ``[offset, length, digest string]``."""
    return isinstance(raw, list) and all(
        isinstance(x, list) and len(x) == 3 and isinstance(x[2], str) for x in raw
    )


def _children(listing: Listing, path: str) -> Iterator[tuple[str, str | None, str | None]]:
    """``(path, blob digest, subtree id)`` of each entry of a tree listed at ``path`` (a
    sparse file once for each of its extents)."""
    if isinstance(listing, DirNode):
        for name, entry in listing.entries.items():
            if entry.type == FILE:
                for digest in entry.blobs():
                    yield join(path, name), digest, None
            elif entry.type == DIR:
                yield join(path, name), None, entry.tree
        return
    for form in listing:
        kind = form["type"]
        if kind == FILE:
            for extent in form.get(EXTENTS, ((0, 0, form["digest"]),)):
                yield join(path, form["name"]), extent[2], None
        elif kind == DIR:
            yield join(path, form["name"]), None, form["tree"]


def _paths_of(
    wanted: set[str], root: str | None, listing_of: Callable[[str, str], Listing | None]
) -> dict[str, list[str]]:
    """Every path (each occurrence of a shared tree expanded) that uses an object in
    ``wanted``, as far as the walk listed the trees."""
    found: dict[str, list[str]] = {}
    pending = [] if root is None else [(root, ROOT)]
    while pending:
        tree, path = pending.pop()
        if tree in wanted:
            found.setdefault(tree, []).append(path)
        listing = listing_of(tree, path)
        if listing is None:
            continue
        for child, digest, subtree in _children(listing, path):
            if digest is not None:
                if digest in wanted:
                    found.setdefault(digest, []).append(child)
            elif subtree is not None:
                pending.append((subtree, child))
    return found


def _with_paths(problem: Problem, paths: list[str]) -> Problem:
    return Problem(problem.object, problem.problem, tuple(sorted(paths)), problem.detail)
