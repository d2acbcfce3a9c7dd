"""The stat cache, one node per directory, so a scan reads only what changed since the last one.

Owns ``DirNode`` (a directory's children with their stat cache, the tree id they hash to, and
the racy-git cutoff that held when they were listed), ``Index`` (the root entry plus nodes
loaded on demand, by path, through the refs each parent row holds) and their byte forms.

Why per directory, like the trees: an incremental scan loads the nodes on the paths to the dirty
directories and writes new nodes for those directories and their ancestors; every other
directory is carried by reference. A flat 100,000-entry index cost ~0.7 s to parse and ~0.3 s to
write whatever changed. A node is a cache, not a record: it lives in the ``NodeCache`` (its id
is the hash of its bytes, checked on every load), and one that cannot be read makes the
workspace service scan again without it.

Must never: put anything into a node that a scan did not observe; hand out a node whose bytes
do not hash to the ref its parent names; do I/O other than through the reader it is given.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

from settled.canonical import canonical_bytes, utf8_json
from settled.errors import SettledError
from settled.objects import ObjectMissing
from settled.objects.hashing import check_algorithm, digest_bytes, parse_digest
from settled.workspace.manifest import (
    DEVICES,
    DIR,
    FILE,
    ROOT,
    SYMLINK,
    Entry,
    IndexMismatch,
    join,
    json_string,
    name_of,
    parent_of,
    tree_bytes,
)
from settled.workspace.xattrs import NONE as NO_XATTRS
from settled.workspace.xattrs import form as xattr_form
from settled.workspace.xattrs import parse as parse_xattrs

INDEX_VERSION: Final = "settled.index/v5"  # v5: rows carry link groups and xattrs
NODE_VERSION: Final = "settled.index-node/v5"  # v5: its tree records link groups and xattrs;
# an older node is unusable (the scan runs without), so no subtree stays an older tree
_NODE_KEYS: Final = frozenset({"v", "algorithm", "tree", "trusted_before_ns", "count", "entries"})
_ROW_FIELDS: Final = 15
_BAD_NAMES: Final = frozenset({"", ".", ".."})


class Reader(Protocol):
    def read(self, digest: str) -> bytes: ...


class MemoryObjects:
    """Nodes of scans made without an object store, kept in memory for the next such scan;
    anything else is read from ``fallback``."""

    def __init__(self, fallback: Reader | None = None) -> None:
        self.objects: dict[str, bytes] = {}
        self.fallback = fallback

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        self.objects.update(items)

    def read(self, digest: str) -> bytes:
        data = self.objects.get(digest)
        if data is not None:
            return data
        if self.fallback is None:
            raise ObjectMissing(digest)
        return self.fallback.read(digest)


@dataclass(frozen=True)
class DirNode:
    """One directory as a scan saw it. ``entries`` maps name -> child entry, sorted by name;
    a stat match vouches for a child only if its mtime and ctime are strictly older than
    ``trusted_before_ns`` (the racy-git rule)."""

    path: str
    algorithm: str
    tree: str
    trusted_before_ns: int
    entries: dict[str, Entry]
    below: int  # entries below this directory, at any depth
    ref: str  # the id of the node's bytes

    def child(self, name: str) -> Entry | None:
        return self.entries.get(name)


@dataclass(frozen=True)
class BuiltNode:
    """A node made by a scan, with the bytes of its tree and of itself, for publishing."""

    node: DirNode
    tree_data: bytes
    node_data: bytes


def build_node(
    path: str, algorithm: str, children: Iterable[Entry], trusted_before_ns: int
) -> BuiltNode:
    """The node (and tree) of a directory whose children are ``children``."""
    ordered = sorted(children, key=lambda entry: entry.path)
    tree_data = tree_bytes(algorithm, ordered)
    tree = digest_bytes(algorithm, tree_data)
    count = len(ordered) + sum(entry.below for entry in ordered if entry.type == DIR)
    node_data = _node_bytes(algorithm, tree, trusted_before_ns, count, ordered)
    entries = {name_of(entry.path): entry for entry in ordered}
    ref = digest_bytes(algorithm, node_data)
    return BuiltNode(
        DirNode(path, algorithm, tree, trusted_before_ns, entries, count, ref), tree_data, node_data
    )


def _node_bytes(
    algorithm: str, tree: str, trusted_before_ns: int, count: int, ordered: list[Entry]
) -> bytes:
    """A node's bytes: exactly ``canonical_bytes`` of its form, with the rows of files and
    directories written directly (``_row_text``), as ``tree_bytes`` writes their tree."""
    if type(trusted_before_ns) is not int or type(count) is not int:
        return canonical_bytes(_node_form(algorithm, tree, trusted_before_ns, count, ordered))
    rows = ",".join([_row_text(entry) for entry in ordered])
    text = (
        f'{{"algorithm":{json_string(algorithm)},"count":{count},"entries":[{rows}],'
        f'"tree":{json_string(tree)},"trusted_before_ns":{trusted_before_ns},'
        f'"v":{json_string(NODE_VERSION)}}}'
    )
    return utf8_json(text)


def _node_form(
    algorithm: str, tree: str, trusted_before_ns: int, count: int, ordered: list[Entry]
) -> dict[str, Any]:
    return {
        "v": NODE_VERSION,
        "algorithm": algorithm,
        "tree": tree,
        "trusted_before_ns": trusted_before_ns,
        "count": count,
        "entries": [_row(entry) for entry in ordered],
    }


_FILE_ROW: Final = '[%s,"file",%d,%d,%s,%d,%d,%d,%d,%d,%d,null,%d,null,{}]'
_DIR_ROW: Final = '[%s,"dir",%d,%d,%s,%d,%d,%d,%d,%d,%d,%s,%d,null,{}]'


def _row_text(entry: Entry) -> str:
    """A row's canonical text: written directly for a dense file or a directory whose every
    field has the exact type of its form (``bool`` is an ``int`` that encodes otherwise), else
    ``canonical_bytes`` of ``_row``."""
    (
        path, kind, mode, size, digest, _, _, ino, dev, mtime_ns, ctime_ns, tree, node, below,
        uid, gid, extents, _, link, xattrs,
    ) = entry  # fmt: skip
    if (
        extents is None
        and link is None
        and xattrs == ()
        and type(uid) is type(gid) is type(mode) is type(size) is type(ino) is int
        and type(dev) is type(mtime_ns) is type(ctime_ns) is type(below) is int
    ):
        name = json_string(path.rpartition("/")[2])
        if kind == FILE and type(digest) is str and node is None:
            return _FILE_ROW % (
                name, mode, size, json_string(digest), uid, gid, ino, dev, mtime_ns, ctime_ns,
                below,
            )  # fmt: skip
        if kind == DIR and type(tree) is str and type(node) is str:
            return _DIR_ROW % (
                name, mode, size, json_string(tree), uid, gid, ino, dev, mtime_ns, ctime_ns,
                json_string(node), below,
            )  # fmt: skip
    return canonical_bytes(_row(entry)).decode("utf-8")


def _row(entry: Entry) -> list[Any]:
    """A child's row: what its tree entry says (the owner too, so an unchanged directory
    rebuilds the very same tree from its node), then its stat cache and node pointer, then its
    hard-link group (null: none) and its xattrs (``{name: base64}``; null: not
    recorded, the root's). A sparse
    file's content is ``[digest, extents]`` (a dense file's, as before, its digest): nodes
    written before sparse files were recorded still read the same."""
    content: Any = {FILE: entry.digest, SYMLINK: entry.target, DIR: entry.tree}.get(
        entry.type, entry.rdev
    )
    if entry.extents is not None:
        content = [entry.digest, [list(extent) for extent in entry.extents]]
    return [
        name_of(entry.path), entry.type, entry.mode, entry.size, content, entry.uid, entry.gid,
        entry.ino, entry.dev, entry.mtime_ns, entry.ctime_ns, entry.node, entry.below,
        entry.link, None if entry.xattrs is None else xattr_form(entry.xattrs),
    ]  # fmt: skip


def _entry(path: str, row: list[Any]) -> Entry:
    _, kind, mode, size, content, uid, gid, ino, dev, mtime_ns, ctime_ns, node, below, link, raw = (
        row
    )
    xattrs = None if raw is None else (parse_xattrs(raw, path) if raw else NO_XATTRS)
    extents = None
    if kind == FILE and isinstance(content, list):  # a sparse file: [digest, extents]
        content, raw = content
        extents = tuple((offset, length, digest) for offset, length, digest in raw)
    # the row's stat mtime is also the time its tree records (a stat match is exact)
    return Entry(
        path, kind, mode, size,
        content if kind == FILE else None,
        content if kind == SYMLINK else None,
        content if kind in DEVICES else None,
        ino, dev, mtime_ns, ctime_ns,
        content if kind == DIR else None,
        node, below, uid, gid, extents, mtime_ns, link, xattrs,
    )  # fmt: skip


def parse_node(data: bytes, ref: str, path: str, algorithm: str) -> DirNode:
    """A node read back by its ref; ``IndexMismatch`` if it is not exactly that node."""
    try:
        if digest_bytes(algorithm, data) != ref:
            raise ValueError("its bytes do not hash to its ref")
        raw = json.loads(data)
        if not isinstance(raw, dict) or set(raw) != _NODE_KEYS or raw["v"] != NODE_VERSION:
            raise ValueError(f"it is not a {NODE_VERSION}")
        if raw["algorithm"] != algorithm:
            raise ValueError(f"algorithm {raw['algorithm']!r} is not {algorithm}")
        entries: dict[str, Entry] = {}
        for row in raw["entries"]:
            if not isinstance(row, list) or len(row) != _ROW_FIELDS:
                raise ValueError(f"a row does not have {_ROW_FIELDS} fields")
            name = row[0]
            if not isinstance(name, str) or name in _BAD_NAMES or "/" in name or "\0" in name:
                raise ValueError(f"a row names {name!r}")
            entries[name] = _entry(join(path, name), row)
        return DirNode(
            path, algorithm, raw["tree"], int(raw["trusted_before_ns"]), entries,
            int(raw["count"]), ref,
        )  # fmt: skip
    except (ValueError, TypeError, KeyError, SettledError) as error:
        raise IndexMismatch(f"stat-cache node {ref} of {path!r} is unusable: {error}") from None


LOADED_ENTRIES: Final = 20_000  # entries of nodes loaded on demand that an index keeps


class Index:
    """A scan's result: the root entry (its tree, its node, how many entries lie below) and the
    directory nodes: those it was given, and others loaded on demand through ``reader``, the
    most recently used kept up to ``LOADED_ENTRIES`` entries (so a walk of a workspace of
    millions of entries holds a few directories at a time, not every one: its memory does not
    grow by an entry's ~1 KiB of objects for each entry it walks)."""

    def __init__(
        self,
        algorithm: str,
        scan_started_ns: int,
        root: Entry,
        reader: Reader,
        nodes: dict[str, DirNode] | None = None,
    ) -> None:
        self.algorithm = check_algorithm(algorithm)
        self.scan_started_ns = scan_started_ns
        self.root = root
        self.reader = reader
        self._nodes: dict[str, DirNode] = dict(nodes or {})
        self._loaded: OrderedDict[str, DirNode] = OrderedDict()  # least recently used first
        self._loaded_entries = 0

    def __repr__(self) -> str:
        return f"Index(root tree {self.root.tree}, {self.count} entries)"

    @property
    def count(self) -> int:
        return 1 + self.root.below

    def node(self, path: str) -> DirNode | None:
        """The node of directory ``path``, or None if the index has no directory there."""
        node = self._resolve(ROOT, self.root.node)
        if path == ROOT or node is None:
            return node
        walked = ROOT
        for name in path.split("/"):
            row = node.child(name)
            if row is None or row.type != DIR:
                return None
            walked = join(walked, name)
            node = self._resolve(walked, row.node)
            if node is None:
                return None
        return node

    def _resolve(self, path: str, ref: str | None) -> DirNode | None:
        if ref is None:
            return None
        known = self._nodes.get(path)
        if known is not None and known.ref == ref:
            return known
        known = self._loaded.get(path)
        if known is not None and known.ref == ref:
            self._loaded.move_to_end(path)
            return known
        try:
            data = self.reader.read(ref)
        except ObjectMissing:
            raise IndexMismatch(f"stat-cache node {ref} of {path!r} is missing") from None
        node = parse_node(data, ref, path, self.algorithm)
        self._keep_loaded(node)
        return node

    def _keep_loaded(self, node: DirNode) -> None:
        old = self._loaded.pop(node.path, None)
        if old is not None:
            self._loaded_entries -= len(old.entries)
        self._loaded[node.path] = node
        self._loaded_entries += len(node.entries)
        while self._loaded_entries > LOADED_ENTRIES and len(self._loaded) > 1:
            _, dropped = self._loaded.popitem(last=False)
            self._loaded_entries -= len(dropped.entries)

    def loaded(self) -> dict[str, DirNode]:
        """The nodes given, read or built and still kept (a later index may start from them;
        any other it reads again through the refs)."""
        return {**self._loaded, **self._nodes}

    def walk(self) -> Iterator[DirNode]:
        """Every directory node, parents before children (loads them all)."""
        pending = [ROOT]
        while pending:
            node = self.node(pending.pop())
            if node is None:
                continue
            yield node
            pending.extend(e.path for e in node.entries.values() if e.type == DIR)

    @property
    def entries(self) -> tuple[Entry, ...]:
        """Every entry, sorted by path (the flat view; loads every node)."""
        found = [self.root]
        for node in self.walk():
            found.extend(node.entries.values())
        found.sort(key=lambda entry: entry.path)
        return tuple(found)

    @property
    def by_path(self) -> dict[str, Entry]:
        return {entry.path: entry for entry in self.entries}

    def to_bytes(self) -> bytes:
        """The index's root object (the nodes are objects of their own)."""
        return canonical_bytes(
            {
                "v": INDEX_VERSION,
                "algorithm": self.algorithm,
                "scan_started_ns": self.scan_started_ns,
                "root": _row(self.root),
            }
        )

    @property
    def ref(self) -> str:
        """The id of the root object's bytes."""
        return digest_bytes(self.algorithm, self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, reader: Reader, ref: str | None = None) -> Index:
        """The index whose root object is ``data`` (checked against ``ref`` if given)."""
        try:
            if ref is not None and digest_bytes(parse_digest(ref)[0], data) != ref:
                raise ValueError(f"its root object does not hash to {ref}")
            raw = json.loads(data)
            if raw["v"] != INDEX_VERSION:
                raise ValueError(f"version {raw['v']!r} is not {INDEX_VERSION}")
            if not isinstance(raw["root"], list) or len(raw["root"]) != _ROW_FIELDS:
                raise ValueError("the root row is malformed")
            root = _entry(ROOT, raw["root"])
            if root.type != DIR or root.node is None:
                raise ValueError("the root is not an indexed directory")
            return cls(raw["algorithm"], int(raw["scan_started_ns"]), root, reader)
        except (KeyError, TypeError, ValueError, SettledError) as error:
            raise IndexMismatch(f"stored index is unusable: {error}") from None

    @classmethod
    def from_entries(
        cls,
        algorithm: str,
        entries: Iterable[Entry],
        *,
        trusted_before_ns: int,
        scan_started_ns: int = 0,
    ) -> Index:
        """An index (in memory) of a flat listing that includes the root ``"."``: every
        directory's node built bottom-up, every node trusted up to ``trusted_before_ns``."""
        by_parent: dict[str, list[Entry]] = {}
        root: Entry | None = None
        for entry in entries:
            if entry.path == ROOT:
                root = entry
            else:
                by_parent.setdefault(parent_of(entry.path), []).append(entry)
        if root is None or root.type != DIR:
            raise IndexMismatch("a listing without a root directory '.'")
        memory = MemoryObjects()
        dirs = sorted({ROOT} | {e.path for c in by_parent.values() for e in c if e.type == DIR},
                      key=lambda p: -_depth(p))  # fmt: skip
        built: dict[str, DirNode] = {}
        for path in dirs:
            children = [
                with_node(e, built[e.path]) if e.type == DIR else e for e in by_parent.get(path, [])
            ]
            made = build_node(path, algorithm, children, trusted_before_ns)
            memory.put_many([(made.node.ref, made.node_data)])
            built[path] = made.node
        return cls(algorithm, scan_started_ns, with_node(root, built[ROOT]), memory, built)


def with_node(entry: Entry, node: DirNode) -> Entry:
    """A directory's entry pointing at its (new) node and tree (``tree``, ``node`` and
    ``below`` replaced, built positionally: ``_replace`` cost ~1.5 us, once a directory)."""
    return _new_tuple(Entry, (*entry[:11], node.tree, node.ref, node.below, *entry[14:]))


_new_tuple: Final = tuple.__new__
_WITH_NODE_AT: Final = (Entry._fields.index("tree"), Entry._fields.index("below"))
assert _WITH_NODE_AT == (11, 13), "with_node builds Entry positionally: update it"


def _depth(path: str) -> int:
    return 0 if path == ROOT else path.count("/") + 1
