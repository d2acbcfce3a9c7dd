"""Trees and stat-cache nodes written directly are the very bytes ``canonical_bytes`` makes.

``tree_bytes`` and a node's bytes skip the JSON encoder for files and directories (a close builds
one of each per directory it scans). A tree's id is the hash of those bytes, so a byte of
difference would give the same directory two ids: a checkpoint that reads back as a different
tree, a restore that cannot find its objects. Each property compares the direct text with the
encoder's on entries of every kind, with names that need escaping, owners and times absent, and
fields of the wrong exact type (``bool``), where the direct path must step aside.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from settled.canonical import canonical_bytes
from settled.workspace.index import NODE_VERSION, _row, build_node
from settled.workspace.manifest import DIR, FILE, SYMLINK, TREE_VERSION, Entry, tree_bytes

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
)

NAMES = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"), min_size=1
).filter(lambda name: name not in (".", ".."))
INTS = st.one_of(st.integers(min_value=0, max_value=2**64), st.booleans())
MAYBE_INTS = st.one_of(st.none(), INTS)
DIGESTS = st.one_of(
    st.binary(min_size=32, max_size=32).map(lambda raw: "blake3:" + raw.hex()),
    st.text(max_size=8),
)


@st.composite
def entries(draw: Any) -> Entry:
    kind = draw(st.sampled_from([FILE, FILE, DIR, DIR, SYMLINK, "fifo", "chardev"]))
    name = draw(NAMES)
    extents = None
    if kind == FILE and draw(st.booleans()):
        extents = ((0, draw(INTS), draw(DIGESTS)),)
    return Entry(
        "top/" + name,
        kind,
        draw(INTS),
        draw(INTS),
        digest=draw(DIGESTS) if kind == FILE else None,
        target=draw(NAMES) if kind == SYMLINK else None,
        rdev=draw(INTS) if kind == "chardev" else None,
        ino=draw(INTS),
        dev=draw(INTS),
        mtime_ns=draw(INTS),
        ctime_ns=draw(INTS),
        tree=draw(st.one_of(st.none(), DIGESTS)) if kind == DIR else None,
        node=draw(st.one_of(st.none(), DIGESTS)) if kind == DIR else None,
        below=draw(INTS),
        uid=draw(MAYBE_INTS),
        gid=draw(MAYBE_INTS),
        extents=extents,
        mtime=draw(MAYBE_INTS),
    )


def _encoder_tree(ordered: list[Entry]) -> bytes:
    forms = [entry.tree_form() for entry in ordered]
    return canonical_bytes({"v": TREE_VERSION, "algorithm": "blake3", "entries": forms})


@PROPERTY
@given(st.lists(entries(), max_size=6))
def test_a_tree_written_directly_is_the_encoders_bytes(listed: list[Entry]) -> None:
    try:
        expected = _encoder_tree(listed)
    except ValueError as refused:  # no owner: the direct path must refuse it the same way
        try:
            tree_bytes("blake3", listed)
        except ValueError as error:
            assert str(error) == str(refused)
            return
        raise AssertionError("an entry without an owner was written into a tree") from None
    assert tree_bytes("blake3", listed) == expected


@PROPERTY
@given(st.lists(entries(), max_size=6), INTS)
def test_a_node_written_directly_is_the_encoders_bytes(listed: list[Entry], cutoff: int) -> None:
    owned = [entry for entry in listed if entry.uid is not None and entry.gid is not None]
    ordered = sorted({entry.path: entry for entry in owned}.values(), key=lambda e: e.path)
    try:
        tree = _encoder_tree(ordered)
    except ValueError:
        return  # no tree, so no node
    made = build_node("top", "blake3", ordered, cutoff)
    assert made.tree_data == tree
    count = len(ordered) + sum(entry.below for entry in ordered if entry.type == DIR)
    form = {
        "v": NODE_VERSION,
        "algorithm": "blake3",
        "tree": made.node.tree,
        "trusted_before_ns": cutoff,
        "count": count,
        "entries": [_row(entry) for entry in ordered],
    }
    assert made.node_data == canonical_bytes(form)


def test_a_scanned_file_and_directory_take_the_direct_path(monkeypatch: Any) -> None:
    """The common rows are written without the encoder (else the speed-up never happens)."""
    from settled.workspace import index, manifest

    file = Entry("a/f", FILE, 0o644, 3, "blake3:" + "0" * 64, uid=1, gid=2, mtime=5, xattrs=())
    folder = Entry(
        "a/d", DIR, 0o755, 0, tree="blake3:" + "1" * 64, node="n", uid=1, gid=2, mtime=5, xattrs=()
    )  # as a scan records them: no link group, and no extended attribute (read, none)
    expected_tree = _encoder_tree([folder, file])
    expected_rows = [canonical_bytes(_row(entry)).decode() for entry in (folder, file)]

    def refused(value: object) -> bytes:
        raise AssertionError(f"encoded by json: {value!r}")

    monkeypatch.setattr(manifest, "canonical_bytes", refused)
    monkeypatch.setattr(index, "canonical_bytes", refused)
    assert tree_bytes("blake3", [folder, file]) == expected_tree
    assert [index._row_text(entry) for entry in (folder, file)] == expected_rows
    assert build_node("a", "blake3", [file, folder], 7).tree_data == expected_tree
