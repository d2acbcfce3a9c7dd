"""Workspace entries, tree objects and manifests: the canonical record of a tree.

Owns ``Entry`` (one path: type, mode, owner (uid, gid), size, digest | target | tree | rdev, a
sparse file's extents, its modification time, plus the stat cache that only an index keeps),
tree objects (one directory's entries by name, each subdirectory named by its own tree id, as in
git), the manifest object (the root's mode, owner and tree, parent, watermark and generation;
its id is ``<algo>:<hash of its canonical bytes>``), and writing and reading back manifests in
an ``ObjectStore`` (checking everything a manifest reaches is ``readback``'s, for a checkpoint,
and ``verify``'s, for ``settled verify``).

Why the owner: a mode alone cannot be restored safely. A set-uid bit means "runs as this
file's owner"; restored without the owner it means "runs as whoever restores", so restore
needs the recorded owner to decide which set-id bits a restore may keep (``restore``). Trees
written before owners were recorded (``settled.tree/v1``, ``settled.manifest/v2``) and flat v1
manifests are still read; their entries record no owner (``uid`` and ``gid`` are None).

Why trees: a checkpoint after a small change writes the trees of the changed directories and
their ancestors and reuses every other subtree by id, so its cost follows the change, not the
workspace (a flat 100,000-entry manifest cost ~4 s to build, write and read back whatever
changed). ``Manifest`` is the flat view (every entry by path, sorted) that restore and tests
read; ``read_manifest`` also still reads the flat v1 manifests that earlier versions wrote.

Sparse files. A file with holes (``sparse``) is recorded with ``extents``: ``[[offset, length,
blob digest], ...]``, sorted, apart (a hole between each two), inside ``size``, covering less than
it; every byte outside them is a hole, which reads as zero. Its ``digest`` still names its whole
logical content (holes as zeros), so equal files hash equal, sparse or not, but it is not an
object: the store holds each extent's bytes under the extent's digest, and nothing for a hole.
An entry without ``extents`` is a dense file, exactly as before (its digest is its blob's).
``extents: []`` is a file that is one hole. Only a tree entry with its owner may carry
extents; an older reader refuses such a tree, naming the field, rather than misreading it.

Times. A tree entry records its modification time (``mtime``, integer nanoseconds, as lstat
saw it; ``settled.tree/v3``), so a restore gives every file, directory, symlink and FIFO back its
time and ``make`` does not rebuild everything after one. The time is a recorded fact of the
tree, not of the content: a blob's id stays the hash of its bytes alone, so two files with equal
bytes and different times share one blob. Because it is in the tree, a changed time alone
(``touch``, same bytes) changes the tree's id, and so the checkpoint's: a restore of the earlier
checkpoint must give the earlier time. Trees written before times were recorded (v2, v1) and
flat v1 manifests are still read; their entries record no time (``mtime`` None) and a restore
leaves the time it wrote. The root directory's time is in the manifest's root
(``settled.manifest/v4``; a v3 manifest records none).

Names. An entry's name is any bytes but ``/`` and NUL, and a symlink's target any but NUL (both
kept as the text ``os.fsdecode`` makes of them): a byte that is not UTF-8 is
a lone surrogate, which the canonical bytes write ``\\udcXX`` (``canonical.utf8_json``), every
other character as before, so a tree of UTF-8 names keeps its bytes and id. Entries are sorted
by that text. A name or target that is not such a text (``is_decoded_name``) is refused, so
one name has one entry and one encoding; a symlink's size is its target's byte length.

Extended attributes. Every entry of a v4 tree records its extended attributes (``xattrs``:
``{name: base64 value}``, absent when it has none; user, trusted and security ones, file
capabilities and POSIX ACLs: ``xattrs.py``), so a command that changes only an attribute
changes the tree's id. The root directory's are not recorded (``xattrs.NOT_RECORDED``).
Entries of older trees record none known (``xattrs`` None).

Hard links. A file with other links (``st_nlink > 1``) records ``link``, its group's key
(``link_key``: a hash of its device and inode, so an unchanged inode keeps it and no inode
number is recorded; ``settled.tree/v4``). Members outside the tree or ignored are simply absent;
restore makes the members it has one inode again. Trees written before groups were recorded
(v3 and older) are still read: their links restore as separate files.

No ``created_at``: the id covers every byte of the manifest, and a manifest is a pure function
of the tree and its lineage, so a checkpoint retried after a crash writes the very same object
and reads back the very same id. Time belongs to the checkpoint receipt (``issued_at``).

Must never: write a manifest whose root tree the store lacks; return a manifest or tree whose
bytes do not hash to the id asked for, or that is not canonical, sorted, and free of names that
escape the tree; put the stat cache (ino, dev, ctime) into a tree or manifest; record a time in
a blob's id; talk to the settled database.
"""

from __future__ import annotations

import itertools
import json
import json.encoder
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import blake3

from settled.canonical import canonical_bytes, utf8_json
from settled.errors import SettledError
from settled.objects import ObjectMissing, ObjectStore, StoredObject
from settled.objects.hashing import check_algorithm, digest_bytes, parse_digest
from settled.workspace.ignore import ignore_digest
from settled.workspace.sparse import Extent
from settled.workspace.xattrs import FIELD as XATTRS
from settled.workspace.xattrs import NONE as NO_XATTRS
from settled.workspace.xattrs import Xattrs
from settled.workspace.xattrs import check as check_xattrs
from settled.workspace.xattrs import form as xattr_form
from settled.workspace.xattrs import parse as parse_xattrs

MANIFEST_VERSION: Final = "settled.manifest/v4"  # v4: the root's mtime
TIMELESS_MANIFEST_VERSION: Final = "settled.manifest/v3"  # read only: the root's time unknown
OWNERLESS_MANIFEST_VERSION: Final = "settled.manifest/v2"  # read only: the root's owner unknown
FLAT_MANIFEST_VERSION: Final = "settled.manifest/v1"  # read only: written before trees existed
TREE_VERSION: Final = "settled.tree/v4"  # v4: hard-link groups (``link``), ``xattrs``
UNLINKED_TREE_VERSION: Final = "settled.tree/v3"  # read only: links recorded as separate files
TIMELESS_TREE_VERSION: Final = "settled.tree/v2"  # read only: written before times were recorded
OWNERLESS_TREE_VERSION: Final = "settled.tree/v1"  # read only: written before owners were recorded
MAX_ID: Final = 2**32 - 2  # uid_t and gid_t; (uid_t)-1 means "leave unchanged" to chown
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
_TREE_VERSIONS: Final = (
    TREE_VERSION, UNLINKED_TREE_VERSION, TIMELESS_TREE_VERSION, OWNERLESS_TREE_VERSION,
)  # fmt: skip
_MANIFEST_KEYS: Final = frozenset({"v", "algorithm", "root", "parent", "watermark", "generation"})
_FLAT_MANIFEST_KEYS: Final = frozenset(
    {"v", "algorithm", "entries", "parent", "watermark", "generation"}
)
_TREE_KEYS: Final = frozenset({"v", "algorithm", "entries"})
_CONTENT_FIELD: Final[dict[str, str | None]] = {
    FILE: "digest", SYMLINK: "target", DIR: "tree", "chardev": "rdev", "blockdev": "rdev",
    "fifo": None, "socket": None,
}  # fmt: skip
_OWNER_FIELDS: Final = frozenset({"uid", "gid"})
EXTENTS: Final = "extents"
MTIME: Final = "mtime"
LINK: Final = "link"
_LINK_KEY_LEN: Final = 32  # hex digits: 128 bits of the (st_dev, st_ino) hash
_NS_RANGE: Final = range(-(2**63), 2**63)  # what os.utime(ns=) and a time_t in ns can hold
_FORM_FIELDS: Final = {
    (key, owned, extra): frozenset(
        {key, "type", "mode", "size"}
        | (_OWNER_FIELDS if owned else frozenset())
        | ({extra} if extra else frozenset())
    )
    for key in ("path", "name")
    for owned in (False, True)
    for extra in (*_CONTENT_FIELD.values(), None)
}  # the fields of a flat ("path") or tree ("name") entry, owned or not, with that content field
_ROOT_FIELDS: Final = {
    OWNERLESS_MANIFEST_VERSION: frozenset({"mode", "tree"}),
    TIMELESS_MANIFEST_VERSION: frozenset({"mode", "tree"}) | _OWNER_FIELDS,
    MANIFEST_VERSION: frozenset({"mode", "tree", MTIME}) | _OWNER_FIELDS,
}  # a manifest's root, by the manifest's version


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
        super().__init__(f"manifest {manifest_id} is not a valid manifest: {reason}")
        self.manifest_id = manifest_id


class ManifestCorrupt(ManifestError):
    def __init__(self, object_id: str, actual: str) -> None:
        super().__init__(f"object {object_id} reads back as {actual}: refused")
        self.manifest_id, self.actual = object_id, actual


class MissingObject(ManifestError):
    def __init__(self, digest: str, what: str) -> None:
        super().__init__(
            f"{what} {digest} is not in the object store: publish blobs and trees before the "
            "manifest; no manifest written"
        )
        self.digest = digest


def join(parent: str, name: str) -> str:
    return name if parent == ROOT else f"{parent}/{name}"


def parent_of(path: str) -> str:
    return path.rpartition("/")[0] or ROOT


def name_of(path: str) -> str:
    return path.rpartition("/")[2]


def check_path(path: object) -> str:
    """A relative, '/'-separated, normalized path inside the tree (or ``"."``), as
    ``os.fsdecode`` gives it (``is_decoded_name``)."""
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
    if not path.isascii() and not is_decoded_name(path):
        raise UnsafePath(path, "is not the text os.fsdecode makes of any bytes")
    return path


def check_name(name: object) -> str:
    """One component of a path: what a tree may name, and nothing that could climb out."""
    if not isinstance(name, str) or not name or "/" in name or name in (ROOT, ".."):
        raise UnsafePath(name, "is not a single path component")
    if "\0" in name:
        raise UnsafePath(name, "contains NUL")
    if not name.isascii() and not is_decoded_name(name):
        raise UnsafePath(name, "is not the text os.fsdecode makes of any bytes")
    return name


def is_decoded_name(text: str) -> bool:
    """Whether ``text`` is what ``os.fsdecode`` makes of some bytes: valid UTF-8 as text, each
    other byte as the lone surrogate U+DC80..U+DCFF. Not any other surrogate, and not
    surrogates that spell valid UTF-8 (``"\\udcc3\\udca9"`` is the bytes of ``"é"``, which
    decode to ``"é"``): one name, one text, so one tree entry and one encoding per name."""
    try:
        return os.fsdecode(os.fsencode(text)) == text
    except UnicodeError:
        return False


_new_tuple: Final = tuple.__new__


class Entry(NamedTuple):
    """One tree entry. ``ino``..``ctime_ns`` are the stat cache, and ``node`` and ``below`` the
    index's pointer to a directory's stat-cache node and how many entries lie below it: all kept
    in an index, zero in a manifest, never part of a tree's or manifest's bytes. ``tree`` is a
    directory's tree id (None in a flat v1 manifest). ``uid`` and ``gid`` are the owner the
    scan's lstat saw (part of a tree; None where an older format recorded none). ``mtime`` is the
    modification time a tree records (the lstat's ``st_mtime_ns``, kept apart from the stat
    cache's ``mtime_ns`` so a manifest's stat cache stays zero; None where none was recorded).
    (A NamedTuple: immutable, and four times cheaper to build than a frozen dataclass, which
    matters at 100,000 entries per scan.)"""

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
    tree: str | None = None  # directories
    node: str | None = None  # index only: the directory's stat-cache node
    below: int = 0  # index only: how many entries lie below the directory
    uid: int | None = None  # the owner; None: not recorded (a v1 tree or flat v1 manifest)
    gid: int | None = None
    extents: tuple[Extent, ...] | None = None  # a sparse file's data; None: a dense file
    mtime: int | None = None  # the recorded modification time, ns; None: not recorded (< v3)
    link: str | None = None  # a file with other hard links: its group's key (v4); None: none
    xattrs: Xattrs | None = None  # extended attributes (v4; () none); None: not recorded

    @property
    def sparse(self) -> bool:
        return self.extents is not None

    def blobs(self) -> tuple[str, ...]:
        """The objects holding this file's bytes: its blob, or its extents' (none for others)."""
        if self.type != FILE or self.digest is None:
            return ()
        if self.extents is None:
            return (self.digest,)
        return tuple(digest for _, _, digest in self.extents)

    @property
    def owned(self) -> bool:
        """Whether this entry records its owner."""
        return self.uid is not None and self.gid is not None

    @classmethod
    def from_stat(
        cls,
        path: str,
        st: os.stat_result,
        digest: str | None = None,
        target: str | None = None,
        extents: tuple[Extent, ...] | None = None,
    ) -> Entry:
        """The entry an lstat describes (``digest`` and, if sparse, ``extents`` for files,
        ``target`` for symlinks)."""
        mode = st.st_mode
        kind = TYPES.get(stat.S_IFMT(mode))
        if kind is None:
            raise UnsafePath(path, f"has an unknown file type {oct(mode)}")
        size = st.st_size if kind in (FILE, SYMLINK) else 0
        rdev = st.st_rdev if kind in DEVICES else None
        mtime_ns = st.st_mtime_ns
        link = link_key(st.st_dev, st.st_ino) if kind == FILE and st.st_nlink > 1 else None
        # every field, in Entry's order, without the keyword handling (~0.9 us down to ~0.3:
        # a scan makes one an entry it reads)
        return _new_tuple(cls, (
            path, kind, stat.S_IMODE(mode), size, digest, target, rdev, st.st_ino, st.st_dev,
            mtime_ns, st.st_ctime_ns, None, None, 0, st.st_uid, st.st_gid, extents, mtime_ns,
            link, NO_XATTRS,
        ))  # fmt: skip

    def without_stat(self) -> Entry:
        return Entry(
            self.path, self.type, self.mode, self.size, self.digest, self.target, self.rdev,
            tree=self.tree, uid=self.uid, gid=self.gid, extents=self.extents, mtime=self.mtime,
            link=self.link, xattrs=self.xattrs,
        )  # fmt: skip

    def _content_field(self) -> tuple[str | None, Any]:
        if self.type == FILE:
            return "digest", self.digest
        if self.type == SYMLINK:
            return "target", self.target
        if self.type == DIR:
            return "tree", self.tree
        if self.type in DEVICES:
            return "rdev", self.rdev
        return None, None

    def canonical(self) -> dict[str, Any]:
        """The flat (v1) form: path, type, mode, size and digest | target | rdev (no owner:
        the flat form is only read, and was written before owners were recorded)."""
        form: dict[str, Any] = {"path": self.path, "type": self.type, "mode": self.mode}
        form["size"] = self.size
        key, value = self._content_field()
        if key is not None and key != "tree":
            form[key] = value
        return form

    def tree_form(self) -> dict[str, Any]:
        """The form inside a (v3) tree object: name, type, mode, uid, gid, size,
        digest|target|tree|rdev, and mtime when recorded. ``ValueError`` if the entry records no
        owner."""
        if self.uid is None or self.gid is None:
            raise ValueError(f"entry {self.path!r} records no owner; a tree records every owner")
        form: dict[str, Any] = {"name": name_of(self.path), "type": self.type, "mode": self.mode}
        form["size"], form["uid"], form["gid"] = self.size, self.uid, self.gid
        key, value = self._content_field()
        if key is not None:
            form[key] = value
        if self.extents is not None:
            form[EXTENTS] = [list(extent) for extent in self.extents]
        if self.mtime is not None:
            form[MTIME] = self.mtime
        if self.link is not None:
            form[LINK] = self.link
        if self.xattrs:
            form[XATTRS] = xattr_form(self.xattrs)
        return form

    @classmethod
    def from_canonical(cls, form: Any, algorithm: str) -> Entry:
        """An entry of a flat v1 manifest."""
        if not isinstance(form, dict):
            raise ValueError(f"entry {form!r} is not an object")
        path = check_path(form.get("path"))
        return cls._from_form(form, path, "path", algorithm, allow_tree=False, owned=False)

    @classmethod
    def from_tree_form(
        cls,
        form: Any,
        parent: str,
        algorithm: str,
        *,
        owned: bool = True,
        timed: bool = True,
        linked: bool = True,
    ) -> Entry:
        """An entry of a tree object listed at ``parent`` (``owned``: a v2 tree or later, which
        records every entry's uid and gid; a v1 tree records none. ``timed``: a v3 tree or
        later, whose entries may record their mtime. ``linked``: a v4 tree, whose files may
        name their hard-link group)."""
        if not isinstance(form, dict):
            raise ValueError(f"entry {form!r} is not an object")
        path = join(parent, check_name(form.get("name")))
        timed = timed and owned
        return cls._from_form(
            form, path, "name", algorithm, allow_tree=True, owned=owned, timed=timed,
            linked=linked and timed,
        )  # fmt: skip

    @classmethod
    def _from_form(
        cls,
        form: dict[str, Any],
        path: str,
        key: str,
        algorithm: str,
        *,
        allow_tree: bool,
        owned: bool,
        timed: bool = False,
        linked: bool = False,
    ) -> Entry:
        kind = form.get("type")
        if not isinstance(kind, str) or kind not in _CONTENT_FIELD:
            raise ValueError(f"entry {path!r} has unknown type {kind!r}")
        extra = _CONTENT_FIELD[kind]
        if kind == DIR and not allow_tree:
            extra = None
        fields: dict[str, Any] = {extra: form[extra]} if extra else {}
        expected = _FORM_FIELDS[key, owned, extra]
        if kind == FILE and owned and key == "name" and EXTENTS in form:
            expected |= {EXTENTS}
            fields[EXTENTS] = _extents_of(form[EXTENTS], path)
        if timed and MTIME in form:
            expected |= {MTIME}
            fields[MTIME] = form[MTIME]
        if linked and kind == FILE and LINK in form:
            expected |= {LINK}
            fields[LINK] = form[LINK]
        if linked:  # a v4 tree records every entry's attributes: none when absent
            fields[XATTRS] = NO_XATTRS
            if XATTRS in form:
                expected |= {XATTRS}
                fields[XATTRS] = parse_xattrs(form[XATTRS], path)
        if form.keys() != expected:
            raise ValueError(f"entry {path!r} has fields {sorted(form)}")
        if owned:
            fields.update(uid=form["uid"], gid=form["gid"])
        entry = cls(path, kind, form["mode"], form["size"], **fields)
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
        if self.tree is not None and (self.type != DIR or parse_digest(self.tree)[0] != algorithm):
            raise ValueError(f"entry {path!r} names tree {self.tree} but is a {self.type}")
        if self.type == SYMLINK:
            target = self.target
            if not isinstance(target, str) or not target or "\0" in target:
                raise ValueError(f"entry {path!r} has symlink target {target!r}")
            if not target.isascii() and not is_decoded_name(target):
                raise ValueError(f"entry {path!r} symlink target {target!r} decodes from no bytes")
            if self.size != len(os.fsencode(target)):
                raise ValueError(f"entry {path!r} size {self.size} != target length")
        if self.extents is not None:
            _check_extents(self, algorithm)
        if self.type in DEVICES and not _is_int(self.rdev):
            raise ValueError(f"entry {path!r} has rdev {self.rdev!r}")
        if (self.uid is None) != (self.gid is None):
            raise ValueError(f"entry {path!r} records uid {self.uid!r} but gid {self.gid!r}")
        for what, value in (("uid", self.uid), ("gid", self.gid)):
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_ID):
                raise ValueError(f"entry {path!r} has {what} {value!r}")
        if self.mtime is not None and (not _is_int(self.mtime) or self.mtime not in _NS_RANGE):
            raise ValueError(f"entry {path!r} has mtime {self.mtime!r}")
        if path == ROOT and self.type != DIR:
            raise ValueError(f"the root entry is a {self.type}, not a dir")
        if self.link is not None and (self.type != FILE or not _is_link_key(self.link)):
            raise ValueError(f"entry {path!r} (a {self.type}) has link group {self.link!r}")
        if self.xattrs is not None:
            check_xattrs(self.xattrs, path)


def link_key(dev: int, ino: int) -> str:
    """The key of a hard-link group: a hash of the inode's (st_dev, st_ino), so every link of
    one file gets the same key in a scan, and an unchanged inode keeps it (an unchanged tree
    keeps its id), without recording an inode number."""
    return blake3.blake3(b"settled.link:%d:%d" % (dev, ino)).hexdigest()[:_LINK_KEY_LEN]


def _is_link_key(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == _LINK_KEY_LEN
        and all(c in "0123456789abcdef" for c in value)
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _extents_of(raw: object, path: str) -> tuple[Extent, ...]:
    """A tree entry's ``extents`` as tuples (checked by ``Entry.check``)."""
    if not isinstance(raw, list) or not all(isinstance(x, list) and len(x) == 3 for x in raw):
        raise ValueError(f"entry {path!r} extents are not [[offset, length, digest], ...]")
    return tuple((x[0], x[1], x[2]) for x in raw)


def _check_extents(entry: Entry, algorithm: str) -> None:
    """A sparse file's extents: sorted, apart, positive, inside its size, leaving a hole."""
    path, end, data = entry.path, -1, 0
    if entry.type != FILE:
        raise ValueError(f"entry {path!r} is a {entry.type} with extents")
    for extent in entry.extents or ():
        offset, length, digest = extent
        if not (_is_int(offset) and _is_int(length)) or offset <= end or length <= 0:
            raise ValueError(f"entry {path!r} extent {list(extent)} overlaps, touches or is empty")
        if parse_digest(digest)[0] != algorithm:
            raise ValueError(f"entry {path!r} extent digest {digest} is not {algorithm}")
        end, data = offset + length, data + length
    if end > entry.size:
        raise ValueError(f"entry {path!r} has an extent past its size {entry.size}")
    if data >= entry.size:
        raise ValueError(f"entry {path!r} is sparse without a hole; a dense entry records it")


# -- tree objects ------------------------------------------------------------------------------


def tree_bytes(algorithm: str, entries: Iterable[Entry]) -> bytes:
    """A directory's (v3) tree object: its entries (sorted by name by the caller), each with
    its owner and (when recorded) its mtime, no stat cache. The very bytes ``canonical_bytes``
    makes of ``{"v", "algorithm", "entries": [tree_form, ...]}``, written directly (keys in
    sorted order) for files and directories: a close builds a tree per directory it scanned,
    and dicts sorted by the JSON encoder cost ~1.6 us an entry, this ~0.5."""
    body = ",".join([_tree_entry_text(entry) for entry in entries])
    text = (
        f'{{"algorithm":{json_string(algorithm)},"entries":[{body}],'
        f'"v":{json_string(TREE_VERSION)}}}'
    )
    return utf8_json(text)


_FILE_TEXT: Final = (
    '{"digest":%s,"gid":%d,"mode":%d,"mtime":%d,"name":%s,"size":%d,"type":"file","uid":%d}'
)
_DIR_TEXT: Final = (
    '{"gid":%d,"mode":%d,"mtime":%d,"name":%s,"size":%d,"tree":%s,"type":"dir","uid":%d}'
)
json_string: Final = json.encoder.encode_basestring
"""A string's JSON text as ``canonical_bytes`` writes it (the encoder's own function: the one
``json.dumps(ensure_ascii=False)`` calls), for canonical bytes written without ``json.dumps``;
its text becomes bytes through ``utf8_json``, as ``canonical_bytes``'s does (a name's lone
surrogates escaped)."""


def _tree_entry_text(entry: Entry) -> str:
    """One entry's canonical text in a tree. Written directly only when every field is of the
    exact type the form has (an ``int`` subclass such as ``bool`` encodes otherwise); anything
    else (links, devices, sparse files, no owner or time) goes through ``tree_form``."""
    (
        path, kind, mode, size, digest, _, _, _, _, _, _, tree, _, _, uid, gid, extents, mtime,
        link, xattrs,
    ) = entry  # fmt: skip
    content = digest if kind == FILE else tree
    if (
        extents is None
        and link is None
        and not xattrs
        and kind in (FILE, DIR)
        and type(content) is str
        and type(gid) is type(uid) is type(mode) is type(mtime) is type(size) is int
    ):
        name = json_string(path.rpartition("/")[2])
        if kind == FILE:
            return _FILE_TEXT % (json_string(content), gid, mode, mtime, name, size, uid)
        return _DIR_TEXT % (gid, mode, mtime, name, size, json_string(content), uid)
    return canonical_bytes(entry.tree_form()).decode("utf-8")


def parse_tree(data: bytes, tree_id: str, path: str) -> list[Entry]:
    """The entries of tree ``tree_id`` listed at ``path``: re-hashed, canonical, valid."""
    algorithm = parse_digest(tree_id)[0]
    raw = _parse_object(data, tree_id)
    try:
        if not isinstance(raw, dict) or set(raw) != _TREE_KEYS:
            raise ValueError(f"top-level fields are not {sorted(_TREE_KEYS)}")
        if raw["v"] not in _TREE_VERSIONS:
            raise ValueError(f"version {raw['v']!r}")
        if raw["algorithm"] != algorithm:
            raise ValueError(f"algorithm {raw['algorithm']!r}")
        if not isinstance(raw["entries"], list):
            raise ValueError("entries is not a list")
        owned = raw["v"] != OWNERLESS_TREE_VERSION
        timed = raw["v"] in (TREE_VERSION, UNLINKED_TREE_VERSION)
        linked = raw["v"] == TREE_VERSION
        entries = [
            Entry.from_tree_form(form, path, algorithm, owned=owned, timed=timed, linked=linked)
            for form in raw["entries"]
        ]
        names = [name_of(e.path) for e in entries]
        if any(a >= b for a, b in itertools.pairwise(names)):
            raise ValueError("entries are not sorted by name and unique")
    except (ValueError, KeyError, SettledError) as error:
        raise ManifestInvalid(tree_id, f"tree of {path!r}: {error}") from None
    return entries


def _parse_object(data: bytes, object_id: str) -> Any:
    """JSON of an object read back by its id: the bytes must hash to it and be canonical."""
    actual = digest_bytes(parse_digest(object_id)[0], data)
    if actual != object_id:
        raise ManifestCorrupt(object_id, actual)
    try:
        raw = json.loads(data)
    except ValueError as error:
        raise ManifestInvalid(object_id, f"not JSON: {error}") from None
    try:
        canonical = canonical_bytes(raw)
    except ValueError as error:  # NaN, or a high surrogate: nothing settled writes
        raise ManifestInvalid(object_id, f"bytes are not canonical JSON: {error}") from None
    if canonical != data:
        raise ManifestInvalid(object_id, "bytes are not canonical JSON")
    return raw


def _read_object(store: ObjectStore, object_id: str, what: str, version: str | None = None) -> Any:
    try:
        data = store.read(object_id, version)
    except ObjectMissing:
        raise MissingObject(object_id, what) from None
    return data


# -- manifests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A tree's canonical record, flat: every entry by path, sorted, without stat cache.

    Its bytes (and id) are the manifest object when the root entry names a tree (v3 when the
    root records its owner, else the v2 form read back), else the flat v1 form that earlier
    versions wrote."""

    algorithm: str
    entries: tuple[Entry, ...]
    parent: str | None = None  # the previous manifest id of this workspace
    watermark: int | None = None  # the mutation sequence number the tree covers
    generation: int = 0
    ignore: dict[str, Any] | None = None  # the ignore rules its checkpoint left out (v3 only)

    @property
    def root(self) -> Entry:
        if not self.entries or self.entries[0].path != ROOT:
            raise ValueError("no root entry '.'")
        return self.entries[0]

    def to_dict(self) -> dict[str, Any]:
        if self.entries and self.entries[0].path == ROOT and self.entries[0].tree is not None:
            return manifest_dict(
                self.algorithm, self.root, self.parent, self.watermark, self.generation, self.ignore
            )
        return {
            "v": FLAT_MANIFEST_VERSION,
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
        """Parse and validate a flat v1 manifest; ``ManifestInvalid`` names the first problem."""
        try:
            if not isinstance(raw, dict) or set(raw) != _FLAT_MANIFEST_KEYS:
                raise ValueError(f"top-level fields are not {sorted(_FLAT_MANIFEST_KEYS)}")
            if raw["v"] != FLAT_MANIFEST_VERSION:
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
        _check_lineage(self.parent, self.watermark, self.generation)
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


def _check_lineage(parent: object, watermark: object, generation: object) -> None:
    if parent is not None:
        parse_digest(parent)
    if watermark is not None and not _is_count(watermark):
        raise ValueError(f"watermark {watermark!r} is not a sequence number")
    if not _is_count(generation):
        raise ValueError(f"generation {generation!r} is not a generation")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def manifest_dict(
    algorithm: str,
    root: Entry,
    parent: str | None,
    watermark: int | None,
    generation: int,
    ignore: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest object: the root directory's mode, owner, mtime and tree, and the lineage
    (v4; a root that records no time or no owner was read from a v3 or v2 object, and gives
    back that form).
    ``ignore``: the task's bound ignore rules (patterns and digest), present only when there
    are any, so the proof itself says what it does not cover; without, the bytes are as before."""
    root_form: dict[str, Any] = {"mode": root.mode, "tree": root.tree}
    version = OWNERLESS_MANIFEST_VERSION
    if root.uid is not None:
        root_form.update(uid=root.uid, gid=root.gid)
        version = TIMELESS_MANIFEST_VERSION
        if root.mtime is not None:  # a head read from a v3 object gives back its v3 form
            root_form[MTIME], version = root.mtime, MANIFEST_VERSION
    return {
        "v": version,
        "algorithm": algorithm,
        "root": root_form,
        "parent": parent,
        "watermark": watermark,
        "generation": generation,
        **({"ignore": ignore} if ignore is not None else {}),
    }


def _check_ignore(raw: object) -> dict[str, Any]:
    """A manifest's ``ignore`` field: exactly patterns (strings) and the digest naming them."""
    if not isinstance(raw, dict) or set(raw) != {"patterns", "digest"}:
        raise ValueError(f"ignore {raw!r} is not {{digest, patterns}}")
    patterns = raw["patterns"]
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError("ignore patterns are not a list of strings")
    if raw["digest"] != ignore_digest(patterns):
        raise ValueError("ignore patterns do not match their digest")
    return raw


@dataclass(frozen=True)
class ManifestHead:
    """A manifest object (v2, v3 or v4) as read back: what it names, before any tree is read."""

    manifest_id: str
    algorithm: str
    root: Entry  # "." with its mode, tree, (v3) owner and (v4) mtime
    parent: str | None
    watermark: int | None
    generation: int
    ignore: dict[str, Any] | None = None  # the ignore rules the checkpoint left out, if any


def write_manifest(
    store: ObjectStore,
    algorithm: str,
    root: Entry,
    *,
    parent: str | None = None,
    watermark: int | None = None,
    generation: int = 0,
    ignore: dict[str, Any] | None = None,
) -> str:
    """Store the manifest object, last: refused unless its root tree is already in the store
    and the root records its owner."""
    return publish_manifest(
        store,
        algorithm,
        root,
        parent=parent,
        watermark=watermark,
        generation=generation,
        ignore=ignore,
    ).digest


def publish_manifest(
    store: ObjectStore,
    algorithm: str,
    root: Entry,
    *,
    parent: str | None = None,
    watermark: int | None = None,
    generation: int = 0,
    ignore: dict[str, Any] | None = None,
) -> StoredObject:
    """``write_manifest``, returning what the store kept: the version it names is the exact
    upload a read-back then reads (an S3 ``VersionId``; the local store's is the digest)."""
    try:
        root.check(algorithm)
        if root.path != ROOT or root.tree is None:
            raise ValueError(f"the root entry {root.path!r} names no tree")
        if not root.owned:
            raise ValueError("the root entry records no owner")
        _check_lineage(parent, watermark, generation)
        if ignore is not None:
            _check_ignore(ignore)
    except (ValueError, SettledError) as error:
        raise ManifestInvalid("(unwritten)", str(error)) from None
    if not store.has(root.tree):
        raise MissingObject(root.tree, "root tree")
    raw = manifest_dict(algorithm, root, parent, watermark, generation, ignore)
    with store.writer(algorithm) as writer:
        writer.write(canonical_bytes(raw))
        return writer.commit()


def read_head(
    store: ObjectStore, manifest_id: str, version: str | None = None
) -> ManifestHead | Manifest:
    """Read back exactly ``manifest_id`` (and exactly that ``version`` of it, when given): a
    v3 or v2 head (trees not yet read), or a whole v1 manifest."""
    algorithm = parse_digest(manifest_id)[0]
    raw = _parse_object(_read_object(store, manifest_id, "manifest", version), manifest_id)
    if isinstance(raw, dict) and raw.get("v") == FLAT_MANIFEST_VERSION:
        manifest = Manifest.from_dict(raw, manifest_id)
        if manifest.algorithm != algorithm:
            raise ManifestInvalid(manifest_id, f"algorithm {manifest.algorithm} differs")
        return manifest
    try:
        if not isinstance(raw, dict) or set(raw) - {"ignore"} != _MANIFEST_KEYS:
            raise ValueError(f"top-level fields are not {sorted(_MANIFEST_KEYS)} (+ ignore)")
        ignore = _check_ignore(raw["ignore"]) if "ignore" in raw else None
        if raw["v"] not in _ROOT_FIELDS:
            raise ValueError(f"version {raw['v']!r} is not {MANIFEST_VERSION}")
        if raw["algorithm"] != algorithm:
            raise ValueError(f"algorithm {raw['algorithm']!r} differs from its id")
        root_form = raw["root"]
        fields = _ROOT_FIELDS[raw["v"]]
        if not isinstance(root_form, dict) or set(root_form) != fields:
            raise ValueError(f"root {root_form!r} is not {sorted(fields)}")
        root = Entry(
            ROOT, DIR, root_form["mode"], 0, tree=root_form["tree"],
            uid=root_form.get("uid"), gid=root_form.get("gid"), mtime=root_form.get(MTIME),
        )  # fmt: skip
        root.check(algorithm)
        parse_digest(root.tree)
        _check_lineage(raw["parent"], raw["watermark"], raw["generation"])
    except (ValueError, SettledError) as error:
        raise ManifestInvalid(manifest_id, str(error)) from None
    return ManifestHead(
        manifest_id, algorithm, root, raw["parent"], raw["watermark"], raw["generation"], ignore
    )


def read_manifest(store: ObjectStore, manifest_id: str) -> Manifest:
    """Read back exactly ``manifest_id`` and every tree it names, each re-hashed and valid."""
    head = read_head(store, manifest_id)
    if isinstance(head, Manifest):
        return head
    entries = [head.root]
    pending = [head.root]
    trees: dict[str, bytes] = {}  # identical subdirectories share a tree: read it once
    while pending:
        directory = pending.pop()
        assert directory.tree is not None
        data = trees.get(directory.tree)
        if data is None:
            data = trees[directory.tree] = _read_object(
                store, directory.tree, f"tree of {directory.path!r}"
            )
        children = parse_tree(data, directory.tree, directory.path)
        entries.extend(children)
        pending.extend(child for child in children if child.type == DIR)
    entries.sort(key=lambda entry: entry.path)
    manifest = Manifest(
        head.algorithm, tuple(entries), head.parent, head.watermark, head.generation, head.ignore
    )
    try:
        manifest.check()
    except (ValueError, SettledError) as error:
        raise ManifestInvalid(manifest_id, str(error)) from None
    return manifest
