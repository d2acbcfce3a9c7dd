"""Writes through a shared mapping: the stat cache is not evidence while a session could make one.

Issue 36, item 1. A write to a page whose mapping is already writable and dirty changes neither
mtime nor ctime on ext4, and on tmpfs a write to a page already mapped stamps nothing at all
(../shared FACTS); inotify sees neither. Each test makes that happen for real, inside a
session, asserts the kernel really left the times alone, and then that the close's checkpoint
holds the bytes the file ends with. ``cachetrust.vouches`` is the rule; its cases are below.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import mounted_tmpfs

from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.workspace import cachetrust
from settled.workspace.manifest import read_manifest

SYSTEM_PYTHON = "/usr/bin/python3"  # /usr is in every view a session may get
PAGE = 4096

# maps data.bin shared, writes through it, says so, waits for the word, writes again through
# the same (now dirty, writable) page, and exits without msync: the second write stamps nothing
WRITE_TWICE = f"""exec {SYSTEM_PYTHON} -c '
import mmap, os, time
fd = os.open("data.bin", os.O_RDWR)
m = mmap.mmap(fd, {PAGE}, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
m[0:5] = b"first"
open("ready", "w").close()
while not os.path.exists("go"):
    time.sleep(0.01)
m[0:6] = b"second"
'"""

# maps data.bin shared, reads its page (mapped by the read fault), then writes through it
READ_THEN_WRITE = f"""exec {SYSTEM_PYTHON} -c '
import mmap, os
fd = os.open("data.bin", os.O_RDWR)
m = mmap.mmap(fd, {PAGE}, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
assert m[0:1] == b"a"
m[0:6] = b"mapped"
'"""


def _times(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_ctime_ns


def _recorded_digest(rt: Runtime, receipt: dict[str, Any], path: str) -> str:
    manifest = read_manifest(rt.workspace.objects, receipt["manifest"])
    (entry,) = [e for e in manifest.entries if e.path == path]
    assert entry.digest is not None
    return entry.digest


def _digest(path: Path) -> str:
    return digest_bytes(DEFAULT_ALGORITHM, path.read_bytes())


def _close(rt: Runtime, task: TaskRecord) -> dict[str, Any]:
    result = rt.close_task(task.task, deadline=30)
    assert result.complete, result.blocked_on
    assert result.receipt is not None
    checkpoint: dict[str, Any] = result.receipt["checkpoint"]
    return checkpoint


def _wait_for(path: Path, seconds: float) -> None:
    give_up = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < give_up, f"{path.name} never appeared"
        time.sleep(0.01)


@pytest.fixture
def tmpfs_workspace(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tmpfs") as where:
        workspace = where / "workspace"
        workspace.mkdir()
        yield workspace


def _a_page_of_a(workspace: Path) -> Path:
    data = workspace / "data.bin"
    data.write_bytes(b"a" * PAGE)
    (workspace / "other.txt").write_bytes(b"untouched\n")
    return data


def test_a_write_through_a_dirty_page_after_a_checkpoint_is_in_the_close(
    rt: Runtime, tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    data = _a_page_of_a(workspace)
    task = rt.new_task(str(workspace))
    writer = rt.exec(task.task, shell=WRITE_TWICE, key="writer", service=True)
    _wait_for(workspace / "ready", 30)
    during = rt.checkpoint(task.task, incremental=False)
    assert during["entries"] >= 3
    seen = _times(data)
    (workspace / "go").touch()
    view = rt.wait(writer.session, timeout=30)
    assert view["receipt"]["exit"]["code"] == 0
    assert data.read_bytes()[:6] == b"second"
    assert _times(data) == seen, "the kernel stamped the write: this test proves nothing here"
    checkpoint = _close(rt, task)
    assert _recorded_digest(rt, checkpoint, "data.bin") == _digest(data)


def test_on_tmpfs_a_write_through_a_page_read_first_is_in_the_close(
    rt: Runtime, tmpfs_workspace: Path
) -> None:
    data = _a_page_of_a(tmpfs_workspace)
    task = rt.new_task(str(tmpfs_workspace))
    quiet = rt.checkpoint(task.task, incremental=False)  # no session alive: a quiet listing
    assert _recorded_digest(rt, quiet, "data.bin") == _digest(data)
    seen = _times(data)
    writer = rt.exec(task.task, shell=READ_THEN_WRITE, key="writer")
    assert rt.wait(writer.session, timeout=30)["receipt"]["exit"]["code"] == 0
    assert data.read_bytes()[:6] == b"mapped"
    assert _times(data) == seen, "the kernel stamped the write: this test proves nothing here"
    checkpoint = _close(rt, task)
    assert _recorded_digest(rt, checkpoint, "data.bin") == _digest(data)


def test_on_ext4_a_quiet_checkpoint_still_vouches_and_a_later_mapping_is_stamped(
    rt: Runtime, tmp_path: Path
) -> None:
    """The cost side: a listing no session overlapped stays evidence on a filesystem that
    stamps a new mapping's first write, so the close re-reads only what changed."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    data = _a_page_of_a(workspace)
    for n in range(20):
        (workspace / f"f{n}.txt").write_text(f"{n}\n")
    task = rt.new_task(str(workspace))
    time.sleep(0.05)  # past the racy cutoff: the quiet listing can vouch for every file
    rt.checkpoint(task.task, incremental=False)
    time.sleep(cachetrust.WINDOW_SLACK_NS / 1e9 + 0.1)  # the session begins clearly after it
    seen = _times(data)
    writer = rt.exec(task.task, shell=READ_THEN_WRITE, key="writer")
    assert rt.wait(writer.session, timeout=30)["receipt"]["exit"]["code"] == 0
    assert _times(data) != seen  # ext4 stamps the first write of a fresh mapping
    result = rt.close_task(task.task, deadline=30)
    assert result.complete and result.receipt is not None
    scan = result.receipt["final_scan"]["stats"]
    assert scan["dirs_unvouched"] == 0
    assert scan["files_hashed"] == 1 and scan["entries_reused"] >= 21
    assert _recorded_digest(rt, result.receipt["checkpoint"], "data.bin") == _digest(data)


# -- the rule ------------------------------------------------------------------------------

S = 1_000_000_000
EXT4, TMPFS = cachetrust.EXT4_MAGIC, cachetrust.TMPFS_MAGIC
WINDOW = (100 * S, 101 * S)  # a scan that ran from t=100 s to t=101 s
NOW = 200 * S


@pytest.mark.parametrize(
    ("sessions", "magic", "expected"),
    [
        ([], EXT4, True),
        ([], TMPFS, True),
        ([(10.0, 20.0)], EXT4, True),  # over long before the scan
        ([(10.0, 20.0)], TMPFS, True),
        ([(10.0, 100.5)], EXT4, False),  # alive while it listed
        ([(10.0, None)], EXT4, False),  # alive still
        ([(150.0, 160.0)], EXT4, True),  # began after: its first write fault stamps
        ([(150.0, 160.0)], TMPFS, False),  # began after: a mapped page stamps nothing
        ([(150.0, 160.0)], 0x794C7630, False),  # overlayfs: not known to stamp
        ([(101.5, 160.0)], EXT4, False),  # within the slack of the scan's end
        ([(10.0, 99.5)], TMPFS, False),  # within the slack of the scan's start
    ],
)
def test_the_rule_of_when_a_listing_vouches(
    sessions: list[tuple[float, float | None]], magic: int, expected: bool
) -> None:
    assert cachetrust.vouches(WINDOW, sessions, NOW, magic) is expected


def test_a_window_not_on_record_vouches_for_nothing() -> None:
    assert cachetrust.vouches(None, [], NOW, EXT4) is False


def test_the_filesystem_magic_of_a_directory_is_read(tmpfs_workspace: Path) -> None:
    fd = os.open(tmpfs_workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert cachetrust.filesystem_magic(fd) == TMPFS
    finally:
        os.close(fd)


# -- every other channel a session has to a file's bytes: each stamps, each is in the close --

CHANNELS = {
    "pwrite": "os.pwrite(fd, b'pwritten', 0)",
    "fallocate_punch_hole": (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "assert libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(4096)) == 0"
    ),  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE: the page reads as zeros, size unchanged
    "copy_file_range": (
        "src = os.open('other.txt', os.O_RDONLY); os.copy_file_range(src, fd, 9, 0, 0)"
    ),
    "truncate_and_extend": f"os.ftruncate(fd, 1); os.ftruncate(fd, {PAGE})",
    "mmap_fresh_mapping": (
        f"m = mmap.mmap(fd, {PAGE}, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE); "
        "m[0:4] = b'mmap'"
    ),
}


@pytest.mark.parametrize("filesystem", ["ext4", "tmpfs"])
@pytest.mark.parametrize("channel", sorted(CHANNELS))
def test_every_channel_a_session_has_to_a_files_bytes_is_in_the_close(
    rt: Runtime, tmp_path: Path, request: pytest.FixtureRequest, filesystem: str, channel: str
) -> None:
    if filesystem == "tmpfs":
        workspace: Path = request.getfixturevalue("tmpfs_workspace")
    else:
        workspace = tmp_path / "workspace"
        workspace.mkdir()
    data = _a_page_of_a(workspace)
    task = rt.new_task(str(workspace))
    time.sleep(0.05)  # past the racy cutoff
    rt.checkpoint(task.task, incremental=False)  # a quiet listing
    before = data.read_bytes()
    program = f"import mmap, os; fd = os.open('data.bin', os.O_RDWR); {CHANNELS[channel]}"
    session = rt.exec(task.task, argv=[SYSTEM_PYTHON, "-c", program], key=channel)
    assert rt.wait(session.session, timeout=30)["receipt"]["exit"]["code"] == 0
    assert data.read_bytes() != before
    checkpoint = _close(rt, task)
    assert _recorded_digest(rt, checkpoint, "data.bin") == _digest(data)
