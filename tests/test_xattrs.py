"""Extended attributes, POSIX ACLs and file capabilities are in the proof (issue 36).

Why: a command could change a file's capability, its ACL or any attribute without changing the
checkpoint, and a restore lost them all. Each entry's attributes are recorded in its tree
entry, so a change of one alone changes the tree's id, and restore sets them back: user ones
and ACLs always, trusted and security ones (a capability is privilege) only when restoring
every owner as root, naming each one it dropped. Round trips on ext4 and tmpfs, real setcap and
setxattr, real files; no mocks.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path
from typing import Final

import pytest
from conftest import mounted_tmpfs as tmpfs

from settled.objects.local import LocalObjectStore
from settled.runtime import Runtime
from settled.workspace.manifest import ManifestInvalid, read_manifest, write_manifest
from settled.workspace.readback import read_back
from settled.workspace.restore import restore
from settled.workspace.scan import scan
from settled.workspace.verify import verify_manifest
from settled.workspace.xattrs import ACL_ACCESS, ACL_DEFAULT, CAPABILITY, NOT_RECORDED

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="trusted.* and capabilities need root")
T0: Final = 1_600_000_000_123_456_789
NOBODY: Final = 65534

# POSIX ACL xattr values (the kernel's binary form: a version, then (tag, perm, id) entries)
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_UNDEFINED_ID: Final = 0xFFFFFFFF


def acl(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def acl_with_user(uid: int, perm: int) -> bytes:
    """user::rw-, user:<uid>:<perm>, group::r--, mask::rw-, other::--- (mode 0o640 with it)."""
    return acl(
        (_ACL_USER_OBJ, 6, _UNDEFINED_ID), (_ACL_USER, perm, uid),
        (_ACL_GROUP_OBJ, 4, _UNDEFINED_ID), (_ACL_MASK, 6, _UNDEFINED_ID),
        (_ACL_OTHER, 0, _UNDEFINED_ID),
    )  # fmt: skip


# A v2 file capability: cap_net_bind_service (bit 10) permitted and effective.
CAP_V2: Final = struct.pack("<IIIII", 0x02000000 | 0x1, 1 << 10, 0, 0, 0)


_TOOLS: Final = {  # each sets exactly the value the test would otherwise set with setxattr
    CAPABILITY: ("setcap", "cap_net_bind_service=ep"),
    ACL_ACCESS: ("setfacl", "-m", f"u:{NOBODY}:r--,m::rw-"),
    ACL_DEFAULT: ("setfacl", "-d", "-m", f"u::rw-,u:{NOBODY}:rw-,g::r--,m::rw-,o::---"),
}


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def supported(root: Path, name: str, value: bytes = b"1") -> bool:
    """Whether the filesystem at ``root`` takes ``name`` on a regular file."""
    probe = root / ".probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, name, value)
        return True
    except OSError as error:
        if error.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EINVAL):
            return False
        raise
    finally:
        probe.unlink()


def attrs(path: Path) -> dict[str, bytes]:
    return {
        name: os.getxattr(path, name, follow_symlinks=False)
        for name in os.listxattr(path, follow_symlinks=False)
    }


def checkpoint(store: LocalObjectStore, workspace: Path) -> str:
    index = scan(workspace, store=store).index
    manifest_id = write_manifest(store, index.algorithm, index.root)
    assert read_back(store, manifest_id, record=None, index=index).ok
    return manifest_id


def make_attributed(root: Path, *, trusted: bool, capability: bool) -> dict[str, dict[str, bytes]]:
    """A file, a directory with a default ACL and a child, a symlink, a hard link: each with
    its attributes; returns path -> the attributes set."""
    (root / "d" / "sub").mkdir(parents=True)
    (root / "d" / "sub" / "inner").write_bytes(b"inner\n")
    (root / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    os.chmod(root / "tool", 0o755)
    (root / "data").write_bytes(b"data\n")
    os.chmod(root / "data", 0o640)
    os.link(root / "data", root / "d" / "data-link")
    (root / "link").symlink_to("data")
    wanted: dict[str, dict[str, bytes]] = {
        "data": {"user.origin": b"\x00\xffbinary", "user.note": b"kept"},
        "d": {"user.dir": b"yes"},
        "d/sub/inner": {},
        "tool": {},
    }
    wanted["data"][ACL_ACCESS] = acl_with_user(NOBODY, 4)
    wanted["d"][ACL_DEFAULT] = acl_with_user(NOBODY, 6)
    if trusted:
        wanted["data"]["trusted.mark"] = b"only root sees this"
        wanted["link"] = {"trusted.on-a-symlink": b"link"}
    if capability:
        wanted["tool"][CAPABILITY] = CAP_V2
    for path, values in wanted.items():
        for name, value in values.items():
            tool = _TOOLS.get(name)
            if tool is not None and shutil.which(tool[0]):  # the admin's own tool, if here
                subprocess.run([*tool, str(root / path)], check=True)
                values[name] = os.getxattr(root / path, name)
                continue
            os.setxattr(root / path, name, value, follow_symlinks=False)
    wanted["d/data-link"] = wanted["data"]
    for path in ("d/sub/inner", "d/sub", "d/data-link", "tool", "data", "d"):
        os.utime(root / path, ns=(T0, T0), follow_symlinks=False)
    return wanted


def round_trip(store: LocalObjectStore, base: Path, *, trusted: bool, capability: bool) -> None:
    workspace, dest = base / "ws", base / "restored"
    workspace.mkdir()
    wanted = make_attributed(workspace, trusted=trusted, capability=capability)
    manifest_id = checkpoint(store, workspace)
    assert verify_manifest(store, manifest_id, read_data=True).ok
    result = restore(store, manifest_id, dest, same_owner=True)
    assert result.xattrs_dropped == () and result.hard_links == 1
    for path, values in wanted.items():
        assert attrs(dest / path) == values, path
        before, after = os.lstat(workspace / path), os.lstat(dest / path)
        assert (after.st_mode, after.st_uid, after.st_gid) == (
            before.st_mode, before.st_uid, before.st_gid,
        ), path  # fmt: skip
        assert after.st_mtime_ns == before.st_mtime_ns, path
        if (dest / path).is_file() and not (dest / path).is_symlink():
            assert (dest / path).read_bytes() == (workspace / path).read_bytes()
    assert os.stat(dest / "data").st_ino == os.stat(dest / "d" / "data-link").st_ino
    # the default ACL was set after the children existed: none of them inherited it
    assert ACL_ACCESS not in attrs(dest / "d" / "sub" / "inner")
    assert ACL_DEFAULT not in attrs(dest / "d" / "sub")
    if capability and shutil.which("getcap"):
        shown = subprocess.run(["getcap", str(dest / "tool")], capture_output=True, text=True)
        assert "cap_net_bind_service" in shown.stdout


@needs_root
def test_attributes_acls_and_capabilities_round_trip_on_ext4(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    round_trip(store, tmp_path, trusted=True, capability=True)


@needs_root
def test_attributes_acls_and_capabilities_round_trip_on_tmpfs(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "t") as base:
        for name in ("user.probe", "trusted.probe", ACL_ACCESS):
            value = acl_with_user(NOBODY, 4) if name == ACL_ACCESS else b"1"
            if not supported(base, name, value):
                pytest.skip(f"this kernel's tmpfs refuses {name} (user.* needs Linux 6.6+)")
        capability = supported(base, CAPABILITY, CAP_V2)
        round_trip(store, base, trusted=True, capability=capability)
        shutil.rmtree(base / "ws")
        shutil.rmtree(base / "restored")


@needs_root
def test_restore_without_same_owner_drops_trusted_and_capabilities_and_names_them(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace, dest = tmp_path / "ws", tmp_path / "restored"
    workspace.mkdir()
    wanted = make_attributed(workspace, trusted=True, capability=True)
    result = restore(store, checkpoint(store, workspace), dest)
    assert set(result.xattrs_dropped) == {
        ("data", "trusted.mark"), ("d/data-link", "trusted.mark"), ("tool", CAPABILITY),
        ("link", "trusted.on-a-symlink"),
    }  # fmt: skip
    assert CAPABILITY not in attrs(dest / "tool")
    kept = {name: value for name, value in wanted["data"].items() if name != "trusted.mark"}
    assert attrs(dest / "data") == kept and ACL_ACCESS in kept
    assert os.stat(dest / "data").st_uid == os.geteuid()  # every entry the restorer's


@pytest.mark.parametrize("walker", ["native", "python"])
def test_a_change_of_only_an_attribute_changes_the_checkpoint(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, walker: str
) -> None:
    """Small files are read by the walker, which says whether each has any attribute (its
    flistxattr of the open file); a large one is read the slow way: both are recorded."""
    monkeypatch.setenv("SETTLED_WALKER", walker)
    workspace = tmp_path / "ws"
    (workspace / "d").mkdir(parents=True)
    (workspace / "d" / "f").write_bytes(b"same bytes\n")
    (workspace / "large").write_bytes(b"\x01" * (1 << 20))
    os.setxattr(workspace / "large", "user.large", b"yes")
    os.setxattr(workspace / "d", "user.kept", b"\x00")
    time.sleep(0.05)  # older than the scan by the clock slack: the stat cache may vouch
    first = scan(workspace, store=store)
    unchanged = scan(workspace, first.index, store=store)
    assert unchanged.index.root.tree == first.index.root.tree
    assert unchanged.stats.files_hashed == 0
    mtime = os.stat(workspace / "d" / "f").st_mtime_ns
    os.setxattr(workspace / "d" / "f", "user.flag", b"on")  # no byte and no mtime changes
    assert os.stat(workspace / "d" / "f").st_mtime_ns == mtime
    assert unchanged.index.by_path["large"].xattrs == (("user.large", b"yes"),)
    assert unchanged.index.by_path["d"].xattrs == (("user.kept", b"\x00"),)
    flagged = scan(workspace, unchanged.index, store=store)
    assert flagged.index.root.tree != first.index.root.tree
    assert flagged.index.by_path["d/f"].xattrs == (("user.flag", b"on"),)
    os.setxattr(workspace / "d", "user.flag", b"dir")  # a directory's alone, too
    os.removexattr(workspace / "d", "user.kept")
    dir_flagged = scan(workspace, flagged.index, store=store)
    assert dir_flagged.index.root.tree != flagged.index.root.tree
    os.removexattr(workspace / "d", "user.flag")
    os.removexattr(workspace / "d" / "f", "user.flag")
    time.sleep(0.05)
    back = scan(workspace, dir_flagged.index, store=store)
    assert back.index.by_path["d/f"].xattrs == () and back.index.by_path["d"].xattrs == ()


def test_a_malformed_xattrs_field_is_refused_by_verify_and_restore(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    from settled.canonical import canonical_bytes
    from settled.objects.hashing import DEFAULT_ALGORITHM

    blob = store.put_bytes(b"x")
    file = {"name": "f", "type": "file", "mode": 0o644, "size": 1, "uid": 0, "gid": 0,
            "mtime": 0, "digest": blob}  # fmt: skip
    for bad in ({}, {"user.a": "not base64!"}, {"user.a": "YQ"}, {"nonamespace": "YQ=="},
                {"user." + "x" * 300: "YQ=="}, ["user.a", "YQ=="]):  # fmt: skip
        tree = store.put_bytes(canonical_bytes(
            {"v": "settled.tree/v4", "algorithm": DEFAULT_ALGORITHM,
             "entries": [{**file, "xattrs": bad}]}))  # fmt: skip
        head = store.put_bytes(canonical_bytes(
            {"v": "settled.manifest/v4", "algorithm": DEFAULT_ALGORITHM,
             "root": {"mode": 0o755, "tree": tree, "uid": 0, "gid": 0, "mtime": 0},
             "parent": None, "watermark": None, "generation": 0}))  # fmt: skip
        with pytest.raises(ManifestInvalid, match="xattr"):
            read_manifest(store, head)
        assert not verify_manifest(store, head).ok
        with pytest.raises(ManifestInvalid):
            restore(store, head, tmp_path / "dest")
        assert not (tmp_path / "dest").exists()


def test_every_checkpoint_receipt_names_what_the_proof_does_not_cover(
    rt: Runtime, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "f").write_bytes(b"x")
    task = rt.new_task(str(workspace))
    receipt = rt.checkpoint(task.task)
    assert receipt["covers"]["not_recorded"] == list(NOT_RECORDED)
    assert any("file flags" in item for item in NOT_RECORDED)
    closed = rt.close_task(task.task)
    assert closed.receipt is not None
    assert closed.receipt["checkpoint"]["covers"]["not_recorded"] == list(NOT_RECORDED)


def test_an_attribute_named_by_bytes_that_are_not_utf8_is_recorded_and_restored(
    rt: Runtime, tmp_path: Path
) -> None:
    """A command names an attribute `user.\\xff` (the kernel allows any byte but NUL): the
    close completes (a refusal would let one setfattr keep the task from ever completing) and
    the restore sets the very bytes back."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "f").write_bytes(b"x")
    task = rt.new_task(str(workspace))
    program = "import os; os.setxattr('f', b'user.caf\\xe9\\xff', b'value')"
    session = rt.exec(task.task, argv=["/usr/bin/python3", "-c", program], key="name")
    assert rt.wait(session.session, timeout=30)["receipt"]["exit"]["code"] == 0
    closed = rt.close_task(task.task)
    assert closed.complete and closed.receipt is not None
    manifest = closed.receipt["checkpoint"]["manifest"]
    (entry,) = [e for e in read_manifest(rt.workspace.objects, manifest).entries if e.path == "f"]
    assert entry.xattrs == ((os.fsdecode(b"user.caf\xe9\xff"), b"value"),)
    restore(rt.workspace.objects, manifest, tmp_path / "out")
    assert os.listxattr(os.fsencode(tmp_path / "out" / "f")) == [os.fsdecode(b"user.caf\xe9\xff")]
    assert os.getxattr(tmp_path / "out" / "f", b"user.caf\xe9\xff") == b"value"
