"""Any name the kernel allows is checkpointed, verified, shown and restored byte for byte.

Git records any byte but ``/`` and NUL in a name, and so does settled: a file named with bytes
that are not UTF-8 (one ``touch $'\\xff'`` by a hostile command) must not keep a task from
completing. Names are kept as the text ``os.fsdecode`` makes of them (a byte that is not UTF-8
is a lone surrogate U+DC80..U+DCFF), every JSON form writes such a surrogate ``\\udcXX``, and
restore gives the very bytes back. Each workspace test runs on ext4 (``tmp_path``) and on a
tmpfs mounted under it, with real files, a real close, the real CLI and real restores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import mounted_tmpfs

from settled.canonical import canonical_bytes, digest_of
from settled.objects.hashing import digest_bytes
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.server.jsonbody import AsciiJSONResponse
from settled.workspace import walk
from settled.workspace.manifest import (
    Entry,
    ManifestInvalid,
    UnsafePath,
    check_name,
    manifest_dict,
    parse_tree,
    read_manifest,
    tree_bytes,
)
from settled.workspace.scan import scan

SETTLED = [sys.executable, "-m", "settled.cli"]
BLOB = "blake3:" + "ab" * 32
LONG = b"\xe9" * 255  # latin-1 bytes, the longest name ext4 and tmpfs allow
DANGLING = b"\xff/x"
MADE_INSIDE = b"made\xff"  # created by the command itself, not by the test

# every name below the workspace root, as bytes, and what each holds
CONTENT = {
    b"\xff\xfe": b"not utf-8",
    b"caf\xe9/inner": b"in a latin-1 directory",
    b"new\nline\x1b[31mesc": b"a newline and an ESC",
    LONG: b"255 bytes of name",
    MADE_INSIDE: b"x",
}


@pytest.fixture(params=["ext4", "tmpfs"])
def filesystem(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A directory on ``tmp_path``'s filesystem, or on a tmpfs mounted there (as root)."""
    where = tmp_path / request.param
    where.mkdir()
    if request.param == "ext4":
        yield where
        return
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with mounted_tmpfs(where):
        yield where


@pytest.fixture
def named_task(rt: Runtime, filesystem: Path) -> TaskRecord:
    """A task whose workspace holds every hard name, the dangling link, and one name that its
    own command makes (``printf '\\377'``)."""
    workspace = filesystem / "workspace"
    workspace.mkdir()
    root = os.fsencode(workspace)
    for name, data in CONTENT.items():
        if name == MADE_INSIDE:
            continue
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)
    os.symlink(DANGLING, os.path.join(root, b"link"))
    task = rt.new_task(str(workspace))
    admission = rt.exec(task.task, shell="printf x > \"$(printf 'made\\377')\"", key="make")
    view = rt.wait(admission.session, timeout=60)
    assert view["receipt"]["exit"]["code"] == 0, rt.read(admission.session, "stderr")
    return task


def tree_of(root: bytes) -> dict[bytes, bytes]:
    """Every path below ``root`` (bytes) with its content, or its link's target."""
    found: dict[bytes, bytes] = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(parent, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                found[rel] = b"-> " + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as handle:
                    found[rel] = handle.read()
            else:
                found[rel] = b"dir"
    return found


def expected_tree() -> dict[bytes, bytes]:
    return {**CONTENT, b"caf\xe9": b"dir", b"link": b"-> " + DANGLING}


def cli(rt: Runtime, *args: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI with a strict UTF-8 stdout, as Python gives it under a UTF-8 locale such as
    en_US.UTF-8 (here, where only C locales exist, Python would choose surrogateescape)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    return subprocess.run(
        [*SETTLED, "--home", rt.home, *args], capture_output=True, timeout=120, env=env
    )


# -- canonical forms ---------------------------------------------------------------------------


def test_plain_names_keep_their_tree_manifest_and_receipt_ids() -> None:
    """Valid UTF-8 is written as before (its own bytes, no escape), so every existing id
    stays: the tree and manifest ids were computed by the code before names that are not UTF-8
    were recorded, at the tree version of the day (settled.tree/v4, which added link groups and
    extended attributes); the receipt's, before both."""
    names = ["README.md", "caf\u00e9", "\u65e5\u672c", "\U0001f600", "tab\there", "z"]
    entries = [
        Entry(
            name, "file", 0o644, 5, digest=BLOB, uid=1000, gid=1000, mtime=1_700_000_000_123_456_789
        )
        for name in names
    ]
    target = "caf\u00e9/x"
    link = Entry(
        "link", "symlink", 0o777, len(target.encode()), target=target, uid=0, gid=0, mtime=1
    )
    entries = sorted([*entries, link], key=lambda entry: entry.path)
    tree = digest_bytes("blake3", tree_bytes("blake3", entries))
    root = Entry(".", "dir", 0o755, 0, tree=tree, uid=0, gid=0, mtime=2)
    manifest = digest_bytes("blake3", canonical_bytes(manifest_dict("blake3", root, None, 3, 1)))
    receipt = digest_of({"kind": "close", "final": "d\u00e9j\u00e0 vu \U0001f600", "n": 1})
    assert b"caf\xc3\xa9" in tree_bytes("blake3", entries) and b"\\u" not in tree_bytes(
        "blake3", entries
    )
    assert tree == "blake3:b1af93fb7a3e0121b31bd8d08e606ef1cd6ff62e80c35a0941731e1f3c5b4906"
    assert manifest == "blake3:fcf91a45b25210183abc1d4d8705d9ece85eca390d82ffe5999f58eb316f63b2"
    assert receipt == "sha256:472e82639e1da2cf6a60fe8dcb0aa87d4203b4dbb5e336c81d4ac2375610e458"


def test_a_byte_that_is_not_utf8_is_written_as_its_surrogate_escape_and_read_back() -> None:
    name = os.fsdecode(b"caf\xe9 \xff\xfe")
    value = {"paths": [name, "caf\u00e9"], name: 1}
    data = canonical_bytes(value)
    assert (
        data
        == b'{"caf\\udce9 \\udcff\\udcfe":1,"paths":["caf\\udce9 \\udcff\\udcfe","caf\xc3\xa9"]}'
    )
    assert json.loads(data) == value and canonical_bytes(json.loads(data)) == data
    assert os.fsencode(json.loads(data)["paths"][0]) == b"caf\xe9 \xff\xfe"
    answer = AsciiJSONResponse(value)  # the HTTP service's encoding: the same escapes
    assert json.loads(answer.body) == value and b"\\udcff" in answer.body
    with pytest.raises(ValueError, match="high surrogate"):
        canonical_bytes({"x": "\ud800\udc80"})  # would read back as U+10000: refused


def test_a_tree_records_such_a_name_and_refuses_one_no_bytes_decode_to() -> None:
    def tree_with(name: str, target: str | None = None) -> tuple[bytes, str]:
        entry = Entry(name, "file", 0o644, 5, digest=BLOB, uid=0, gid=0, mtime=1)
        if target is not None:
            size = len(os.fsencode(target))
            entry = Entry(name, "symlink", 0o777, size, target=target, uid=0, gid=0, mtime=1)
        form = {"algorithm": "blake3", "entries": [entry.tree_form()], "v": "settled.tree/v3"}
        data = canonical_bytes(form)
        return data, digest_bytes("blake3", data)

    data, tree = tree_with(os.fsdecode(b"\xff\xfe"))
    assert b'"name":"\\udcff\\udcfe"' in data
    [entry] = parse_tree(data, tree, ".")
    assert os.fsencode(entry.path) == b"\xff\xfe"
    # surrogates that spell valid UTF-8 ("\xc3\xa9" is "é"), or that no byte decodes to
    for impostor in ("\udcc3\udca9", "\udc00", "a\udc7f"):
        data, tree = tree_with(impostor)
        with pytest.raises(ManifestInvalid, match=r"not the text os\.fsdecode makes"):
            parse_tree(data, tree, ".")
    data, tree = tree_with("link", os.fsdecode(DANGLING))
    [link] = parse_tree(data, tree, ".")
    assert link.target is not None and os.fsencode(link.target) == DANGLING
    data, tree = tree_with("link", "\udcc3\udca9/x")
    with pytest.raises(ManifestInvalid, match="decodes from no bytes"):
        parse_tree(data, tree, ".")
    for bad in ("a/b", "a\0b", "", ".", ".."):
        with pytest.raises(UnsafePath):
            check_name(bad)
    assert check_name(os.fsdecode(b"\x01\x1b\n\xff")) == "\x01\x1b\n\udcff"


def test_a_stored_high_surrogate_is_refused_as_not_canonical() -> None:
    data = b'{"algorithm":"blake3","entries":[],"v":"\\ud800"}'
    with pytest.raises(ManifestInvalid, match="not canonical"):
        parse_tree(data, digest_bytes("blake3", data), ".")


def test_both_walkers_decode_such_names_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C walker (``PyUnicode_DecodeFSDefault``) and its Python twin (``os.scandir``) give
    the same text for every name, so the same tree id."""
    root = os.fsencode(tmp_path / "both")
    for name, data in CONTENT.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)
    os.symlink(DANGLING, os.path.join(root, b"link"))
    found = {}
    for walker in (walk.NATIVE, walk.PYTHON):
        monkeypatch.setenv("SETTLED_WALKER", walker)
        result = scan(os.fsdecode(root))
        assert result.stats.walker == walker
        found[walker] = (result.index.root.tree, sorted(result.index.by_path))
    assert found[walk.NATIVE] == found[walk.PYTHON]
    assert {os.fsencode(path) for path in found[walk.PYTHON][1]} == {b".", *expected_tree()}


# -- a whole task: scan, close, verify, restore ------------------------------------------------


def test_close_verify_and_restore_keep_every_name_byte_for_byte(
    rt: Runtime, named_task: TaskRecord, filesystem: Path
) -> None:
    result = rt.close_task(named_task.task, deadline=30)
    assert result.complete, result.blocked_on
    assert result.receipt is not None
    assert json.loads(canonical_bytes(result.receipt)) == result.receipt
    manifest = read_manifest(rt.workspace.objects, result.receipt["checkpoint"]["manifest"])
    paths = {os.fsencode(entry.path) for entry in manifest.entries}
    assert set(expected_tree()) | {b"."} == paths
    [link] = [entry for entry in manifest.entries if entry.path == "link"]
    assert link.target is not None and os.fsencode(link.target) == DANGLING
    assert link.size == len(DANGLING)
    assert rt.verify(named_task.task, read_data=True)["verified"] is True
    dest = filesystem / "restored"
    restored = rt.restore(named_task.task, str(dest))
    assert restored.complete
    assert tree_of(os.fsencode(dest)) == expected_tree()
    assert os.readlink(os.path.join(os.fsencode(dest), b"link")) == DANGLING


def test_the_tree_object_holds_each_such_name_as_its_escape(
    rt: Runtime, named_task: TaskRecord
) -> None:
    checkpoint = rt.checkpoint(named_task.task)
    manifest = read_manifest(rt.workspace.objects, checkpoint["manifest"])
    root_tree = rt.workspace.objects.read(manifest.root.tree)
    assert b'"name":"\\udcff\\udcfe"' in root_tree
    assert b'"target":"\\udcff/x"' in root_tree
    assert b'"name":"new\\nline\\u001b[31mesc"' in root_tree
    assert ('"name":"' + "\\udce9" * 255 + '"').encode() in root_tree
    assert root_tree.isascii()  # every byte that is not UTF-8 is escaped; these names have no other


def test_the_cli_closes_verifies_and_restores_such_names_in_json(
    rt: Runtime, named_task: TaskRecord, filesystem: Path
) -> None:
    rt.checkpoint(named_task.task)  # then a command changes the latin-1 directory alone
    admission = rt.exec(named_task.task, shell="printf y > \"$(printf 'caf\\351/new')\"")
    assert rt.wait(admission.session, timeout=60)["receipt"]["exit"]["code"] == 0
    closed = cli(rt, "close", named_task.task, "--json")
    assert closed.returncode == 0, closed.stderr
    assert b'"dirty_dirs": ["caf\\udce9"]' in closed.stdout  # the journal names it
    receipt = json.loads(closed.stdout)
    assert receipt["outcome"]["complete"] is True
    assert receipt["final_scan"]["journal"]["dirty_dirs"] == [os.fsdecode(b"caf\xe9")]
    assert rt.close_task(named_task.task).receipt == receipt  # as stored, its digest checked
    verified = cli(rt, "verify", named_task.task, "--read-data", "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["verified"] is True
    dest = filesystem / "restored"
    restored = cli(rt, "restore", named_task.task, str(dest), "--json")
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["files"] == len(CONTENT) + 1
    assert tree_of(os.fsencode(dest)) == {**expected_tree(), b"caf\xe9/new": b"y"}


def test_json_output_names_a_path_by_its_escapes_and_a_human_view_does_not_crash(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    """Restore's JSON names what it cannot restore (a socket) by path, and verify names the
    paths that use a damaged blob: both with ``\\udcXX``; the human views print each such byte
    as ``\\xNN`` (``printable``), under a strict UTF-8 stdout too."""
    workspace = os.fsencode(task.workspace)
    with open(os.path.join(workspace, b"\xff\xfe"), "wb") as handle:
        handle.write(b"damaged later")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(os.path.join(workspace, b"sock\xff"))
    manifest = rt.checkpoint(task.task)["manifest"]
    restored = cli(rt, "restore", manifest, str(tmp_path / "json"), "--json")
    assert restored.returncode == 3, restored.stderr  # the socket is named, not restored
    assert b'"not_restorable": [["sock\\udcff", "socket"]]' in restored.stdout
    answer: dict[str, Any] = json.loads(restored.stdout)
    assert os.fsencode(answer["not_restorable"][0][0]) == b"sock\xff"
    [blob] = [e.digest for e in read_manifest(rt.workspace.objects, manifest).entries if e.digest]
    os.unlink(rt.workspace.objects.path_of(blob))
    as_json = cli(rt, "verify", manifest, "--json")
    assert as_json.returncode == 3, as_json.stderr
    assert json.loads(as_json.stdout)["problems"][0]["paths"] == ["\udcff\udcfe"]
    human = cli(rt, "verify", manifest)
    assert human.returncode == 3, human.stderr
    assert human.stdout.splitlines()[0] == f"{blob} missing: \\xff\\xfe".encode()


def test_an_ignore_rule_leaves_out_such_a_name(rt: Runtime, tmp_path: Path) -> None:
    workspace = tmp_path / "ignoring"
    workspace.mkdir()
    for name in (b"\xff.o", b"caf\xe9.c"):
        with open(os.path.join(os.fsencode(workspace), name), "wb") as handle:
            handle.write(b"x")
    task = rt.new_task(str(workspace), ignore=["*.o"])
    manifest = read_manifest(rt.workspace.objects, rt.checkpoint(task.task)["manifest"])
    assert [os.fsencode(entry.path) for entry in manifest.entries] == [b".", b"caf\xe9.c"]


def test_a_postgresql_home_closes_with_such_names(
    pg_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pg

    home = str(tmp_path / "pg-home")
    monkeypatch.setenv("SETTLED_STORE", pg.url_for_directory(home))
    workspace = tmp_path / "pg-workspace"
    workspace.mkdir()
    with open(os.path.join(os.fsencode(workspace), b"\xff\xfe"), "wb") as handle:
        handle.write(b"on postgresql")
    os.symlink(DANGLING, os.path.join(os.fsencode(workspace), b"link\xff"))
    runtime = Runtime(home)
    try:
        assert runtime.backends.store_scheme == "postgresql"
        task = runtime.new_task(str(workspace))
        result = runtime.close_task(task.task, deadline=30)
        assert result.complete, result.blocked_on
        assert runtime.verify(task.task)["verified"] is True
        dest = tmp_path / "pg-restored"
        assert runtime.restore(task.task, str(dest)).complete
        assert tree_of(os.fsencode(dest)) == {
            b"\xff\xfe": b"on postgresql",
            b"link\xff": b"-> " + DANGLING,
        }
        # a fact naming such a path (a text column, not jsonb, which refuses a lone \udcXX)
        other = runtime.new_task(str(workspace), shared_workspace=True)
        fact = {"paths": [os.fsdecode(b"\xff\xfe"), os.fsdecode(b"caf\xe9/x")]}
        runtime.store.record_close_step(other.task, "names", fact)
        assert runtime.store.close_steps(other.task)["names"] == fact
    finally:
        runtime.close()
