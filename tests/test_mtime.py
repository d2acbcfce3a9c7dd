"""Trees record modification times and a restore gives them back (issue 14, item 4).

Why: a restore that left every file with the time it was written made ``make`` rebuild
everything. The time is a fact of the tree, never of a blob, so content dedup still holds; a
tree written before times were recorded (``settled.tree/v2``) still restores, with no utime.
Real files, a real object store, real ``make``; no mocks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Final

import pytest

from settled.canonical import canonical_bytes
from settled.objects.hashing import DEFAULT_ALGORITHM
from settled.objects.local import LocalObjectStore
from settled.workspace.manifest import (
    ManifestInvalid,
    parse_tree,
    read_manifest,
    write_manifest,
)
from settled.workspace.restore import restore
from settled.workspace.scan import scan

T0: Final = 1_500_000_000_123_456_789  # nanoseconds that a second-granular copy would lose
DAY: Final = 86_400 * 10**9


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def checkpoint(store: LocalObjectStore, workspace: Path) -> str:
    index = scan(workspace, store=store).index
    return write_manifest(store, index.algorithm, index.root)


def set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns), follow_symlinks=False)


def timed_workspace(root: Path) -> dict[str, int]:
    """A file, nested dirs, a symlink and a FIFO, each with its own time (set children first,
    since making a child changes its directory's time); returns path -> mtime_ns."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "deep.c").write_bytes(b"int x;\n")
    (root / "top.txt").write_bytes(b"top\n")
    (root / "link").symlink_to("top.txt")
    os.mkfifo(root / "pipe", 0o600)
    times = {"a/b/deep.c": T0, "a/b": T0 + 1, "a": T0 + 2 * DAY + 7, "top.txt": T0 - 3 * DAY}
    times |= {"link": T0 + 5, "pipe": T0 + 11}
    times["."] = T0 + 3 * DAY
    for rel, ns in times.items():
        set_mtime(root / rel, ns)
    return times


def test_restore_sets_every_recorded_mtime_to_the_nanosecond(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    times = timed_workspace(tmp_path / "ws")
    manifest_id = checkpoint(store, tmp_path / "ws")
    recorded = {e.path: e.mtime for e in read_manifest(store, manifest_id).entries}
    assert {path: recorded[path] for path in times} == times  # the tree holds lstat's ns
    result = restore(store, manifest_id, tmp_path / "out")
    restored = {rel: os.lstat(tmp_path / "out" / rel).st_mtime_ns for rel in times}
    assert restored == times  # directories too: set after their children, deepest first
    assert os.stat(tmp_path / "out" / "link").st_mtime_ns == times["top.txt"]  # not followed
    assert result.times_unrecorded == 0
    assert json.loads(store.read(manifest_id))["root"]["mtime"] == times["."]  # manifest v4


def test_blob_ids_stay_content_only_when_only_the_mtime_differs(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    for name, ns in (("one", T0), ("two", T0 + DAY)):
        (ws / name).write_bytes(b"same bytes\n")
        set_mtime(ws / name, ns)
    first = checkpoint(store, ws)
    entries = {e.path: e for e in read_manifest(store, first).entries}
    assert entries["one"].digest == entries["two"].digest  # one blob for equal bytes
    assert (entries["one"].mtime, entries["two"].mtime) == (T0, T0 + DAY)
    blobs = set(store.list_digests())

    set_mtime(ws / "one", T0 + 2 * DAY)  # touch: same bytes, new time
    second = checkpoint(store, ws)
    assert second != first  # chosen: the time is in the tree, so a touch is a new checkpoint
    again = {e.path: e for e in read_manifest(store, second).entries}
    assert again["one"].digest == entries["one"].digest and again["one"].mtime == T0 + 2 * DAY
    new = set(store.list_digests()) - blobs
    assert entries["one"].digest not in new  # no blob written: a new root tree and manifest
    assert len(new) == 2


def _put(store: LocalObjectStore, raw: dict[str, object]) -> str:
    return store.put_bytes(canonical_bytes(raw))


def test_a_v2_tree_without_times_still_reads_and_restores(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    blob = store.put_bytes(b"old\n")
    uid, gid = os.geteuid(), os.getegid()
    owner = {"uid": uid, "gid": gid}
    sub = _put(store, {"v": "settled.tree/v2", "algorithm": DEFAULT_ALGORITHM, "entries": [
        {"name": "f", "type": "file", "mode": 0o644, "size": 4, "digest": blob, **owner},
    ]})  # fmt: skip
    root = _put(store, {"v": "settled.tree/v2", "algorithm": DEFAULT_ALGORITHM, "entries": [
        {"name": "d", "type": "dir", "mode": 0o755, "size": 0, "tree": sub, **owner},
    ]})  # fmt: skip
    head = _put(store, {"v": "settled.manifest/v3", "algorithm": DEFAULT_ALGORITHM,
                        "root": {"mode": 0o755, "tree": root, **owner}, "parent": None,
                        "watermark": None, "generation": 0})  # fmt: skip
    old = read_manifest(store, head)
    assert all(e.mtime is None for e in old.entries)
    assert old.id == head  # a timeless v3 head gives back its own bytes, not a v4 form
    result = restore(store, head, tmp_path / "out")
    assert (tmp_path / "out" / "d" / "f").read_bytes() == b"old\n"
    assert result.times_unrecorded == 3  # ".", d and d/f: left with the time restore wrote


def test_a_tree_refuses_a_time_that_is_not_an_integer_in_range_or_in_a_v2_tree(
    store: LocalObjectStore,
) -> None:
    blob = store.put_bytes(b"x")
    form = {"name": "f", "type": "file", "mode": 0o644, "size": 1, "digest": blob, "uid": 0,
            "gid": 0}  # fmt: skip
    for version, mtime in (("settled.tree/v3", 1.5), ("settled.tree/v3", True),
                           ("settled.tree/v3", 2**63), ("settled.tree/v3", "0"),
                           ("settled.tree/v2", 5)):  # fmt: skip
        data = canonical_bytes(
            {"v": version, "algorithm": DEFAULT_ALGORITHM, "entries": [{**form, "mtime": mtime}]}
        )
        tree = store.put_bytes(data)
        with pytest.raises(ManifestInvalid, match="'f'"):
            parse_tree(data, tree, ".")
    ok = canonical_bytes({"v": "settled.tree/v3", "algorithm": DEFAULT_ALGORITHM,
                          "entries": [{**form, "mtime": -(10**9)}]})  # fmt: skip
    assert parse_tree(ok, store.put_bytes(ok), ".")[0].mtime == -(10**9)  # before 1970 is a time


def test_tree_bytes_carry_mtime_but_no_stat_cache(store: LocalObjectStore, tmp_path: Path) -> None:
    timed_workspace(tmp_path / "ws")
    manifest = read_manifest(store, checkpoint(store, tmp_path / "ws"))
    for tree in {e.tree for e in manifest.entries if e.tree is not None}:
        raw = json.loads(store.read(tree))
        assert raw["v"] == "settled.tree/v4"
        for form in raw["entries"]:
            assert "mtime" in form and not {"ino", "dev", "mtime_ns", "ctime_ns"} & set(form)


MAKEFILE: Final = "app.o: main.c\n\tcp main.c app.o\n"  # app.o sorts (and restores) first


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_has_nothing_to_rebuild_after_a_restore(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "Makefile").write_text(MAKEFILE)
    (ws / "main.c").write_bytes(b"int main(void) { return 0; }\n")
    (ws / "app.o").write_bytes(b"built\n")
    set_mtime(ws / "main.c", T0)  # the source is older than its target
    set_mtime(ws / "app.o", T0 + 10**9)
    make = ["make", "-q", "app.o"]  # -q: exit 0 when the target is up to date, build nothing
    assert subprocess.run(make, cwd=ws, timeout=30, capture_output=True).returncode == 0
    restore(store, checkpoint(store, ws), tmp_path / "out")
    out = tmp_path / "out"
    assert os.stat(out / "main.c").st_mtime_ns < os.stat(out / "app.o").st_mtime_ns
    assert subprocess.run(make, cwd=out, timeout=30, capture_output=True).returncode == 0
    assert (out / "app.o").read_bytes() == b"built\n"
