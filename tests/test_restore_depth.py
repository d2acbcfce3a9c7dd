"""A checkpoint restores at any depth: past PATH_MAX, on ext4 and on tmpfs (issue 36).

Why: 20 nested directories of 250-byte names make a path of ~5,000 bytes; the scan walks it by
directory fds and the close verifies it, but a restore that named each entry by its path from
the temp root failed with ENAMETOOLONG and restored nothing: a certified checkpoint that could
not be restored. Real files, a real close through the Runtime, real mounts; no mocks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Final

import pytest
from conftest import mounted_tmpfs as tmpfs

from settled.runtime import Runtime

DEPTH: Final = 20
LONG: Final = 250  # bytes a name: under NAME_MAX (255), 20 of them far past PATH_MAX (4096)
BOTTOM: Final = b"the bottom of a very deep tree\n"
_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def names() -> list[str]:
    return [f"{level:02d}" + "d" * (LONG - 2) for level in range(DEPTH)]


def make_deep(root: Path) -> None:
    """``root``/d00.../d19.../bottom, made one name at a time through directory fds."""
    fd = os.open(root, _DIR)
    try:
        for name in names():
            os.mkdir(name, 0o755, dir_fd=fd)
            sub = os.open(name, _DIR, dir_fd=fd)
            os.close(fd)
            fd = sub
        out = os.open("bottom", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640, dir_fd=fd)
        try:
            os.write(out, BOTTOM)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def read_bottom(root: Path) -> tuple[bytes, int]:
    """The bottom file's bytes and mode, reached one name at a time."""
    fd = os.open(root, _DIR)
    try:
        for name in names():
            sub = os.open(name, _DIR, dir_fd=fd)
            os.close(fd)
            fd = sub
        st = os.stat("bottom", dir_fd=fd, follow_symlinks=False)
        bottom = os.open("bottom", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        try:
            return os.read(bottom, 1 << 16), st.st_mode & 0o7777
        finally:
            os.close(bottom)
    finally:
        os.close(fd)


def remove_by_fds(path: Path) -> None:
    """``path`` and everything under it removed through directory fds (``shutil.rmtree`` with
    ``dir_fd`` walks by fds on Linux: no path past one name is ever passed to the kernel)."""
    parent = os.open(path.parent, _DIR)
    try:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path.name, dir_fd=parent)
    finally:
        os.close(parent)


def close_and_restore(rt: Runtime, workspace: Path, dest: Path) -> dict[str, object]:
    task = rt.new_task(str(workspace))
    close = rt.close_task(task.task)
    assert close.complete and close.receipt is not None, close.blocked_on
    checkpoint = close.receipt["checkpoint"]
    assert checkpoint["read_back"]["verified"] is True
    result = rt.restore(task.task, str(dest))
    return {"manifest": checkpoint["manifest"], "files": result.files, "dirs": result.dirs}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
@pytest.mark.parametrize("filesystem", ["ext4", "tmpfs"])
def test_a_checkpoint_past_path_max_closes_verifies_and_restores(
    rt: Runtime, tmp_path: Path, filesystem: str
) -> None:
    with contextlib.ExitStack() as stack:
        base = tmp_path if filesystem == "ext4" else stack.enter_context(tmpfs(tmp_path / "t"))
        workspace, dest = base / "ws", base / "restored"
        workspace.mkdir()
        stack.callback(remove_by_fds, workspace)
        stack.callback(remove_by_fds, dest)
        make_deep(workspace)
        assert len(os.path.join(*names(), "bottom")) > 5000
        got = close_and_restore(rt, workspace, dest)
        assert (got["files"], got["dirs"]) == (1, DEPTH)
        assert read_bottom(dest) == (BOTTOM, 0o640)
        assert rt.verify(str(got["manifest"]), read_data=True)["verified"] is True
    assert sorted(os.listdir(tmp_path)) == ["home"]


def test_a_failed_restore_at_depth_leaves_nothing(rt: Runtime, tmp_path: Path) -> None:
    """The cleanup of a failed restore works through fds too: the damaged bottom blob fails
    the restore deep down, and no temp directory is left beside the destination."""
    from conftest import tamper_object

    from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
    from settled.workspace.restore import BlobCorrupt

    workspace, dest = tmp_path / "ws", tmp_path / "out" / "restored"
    workspace.mkdir()
    dest.parent.mkdir()
    try:
        make_deep(workspace)
        task = rt.new_task(str(workspace))
        rt.close_task(task.task)
        digest = digest_bytes(DEFAULT_ALGORITHM, BOTTOM)
        tamper_object(rt.workspace.objects, digest, lambda data: data[::-1])
        with pytest.raises(BlobCorrupt):
            rt.restore(task.task, str(dest))
        assert os.listdir(dest.parent) == []
    finally:
        remove_by_fds(workspace)
