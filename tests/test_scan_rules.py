"""The scanner's rules (``workspace.scanrules``), handed facts: stats made here, rows made from
them, and the named answer each rule gives. Nothing is read from a disk: what a scan does with
each answer is tested on real trees in test_scan.py, test_hard_links.py and test_sparse.py."""

from __future__ import annotations

import os
import stat

import pytest

from settled.workspace.index import DirNode
from settled.workspace.manifest import Entry
from settled.workspace.scanrules import (
    CLOCK_SLACK_NS,
    RACY,
    READ,
    REUSE,
    LinkRead,
    changed_while_read,
    hard_link_verdict,
    listed_dir_row_holds,
    range_changed_while_read,
    same_dir,
    same_inode,
    stat_verdict,
    symlink_unchanged,
)
from settled.workspace.walk import COARSE_FS_SLACK_NS

T = 1_700_000_000_123_456_789  # a timestamp with nanoseconds (not a whole second)
WHOLE = 1_700_000_000_000_000_000  # a whole second: a filesystem of coarse stamps
DIGEST = "blake3:" + "ab" * 32
FILE_MODE = stat.S_IFREG | 0o644


def lstat(
    *,
    mode: int = FILE_MODE,
    ino: int = 7,
    dev: int = 1,
    nlink: int = 1,
    uid: int = 1000,
    gid: int = 1000,
    size: int = 3,
    mtime_ns: int = T,
    ctime_ns: int = T,
    atime_ns: int = T,
) -> os.stat_result:
    """An lstat as the kernel fills it (the ``*_ns`` fields included)."""
    seconds = [ns // 10**9 for ns in (atime_ns, mtime_ns, ctime_ns)]
    floats = [ns / 1e9 for ns in (atime_ns, mtime_ns, ctime_ns)]
    nanoseconds = (atime_ns, mtime_ns, ctime_ns)
    blocks = (4096, 8, 0)  # st_blksize, st_blocks, st_rdev
    return os.stat_result(
        (mode, ino, dev, nlink, uid, gid, size, *seconds, *floats, *nanoseconds, *blocks)
    )


def row(st: os.stat_result, **fields: object) -> Entry:
    """The row a scan recorded of ``st`` (a file's digest, a symlink's target)."""
    kind = stat.S_IFMT(st.st_mode)
    entry = Entry.from_stat(
        "f",
        st,
        digest=DIGEST if kind == stat.S_IFREG else None,
        target="t" * st.st_size if kind == stat.S_IFLNK else None,
    )
    return entry._replace(**fields) if fields else entry


AFTER = T + 10**9  # a cutoff a second after the stamps


@pytest.mark.parametrize(
    ("cached", "now", "cutoff", "verdict"),
    [
        pytest.param(row(lstat()), lstat(), AFTER, REUSE, id="every-field-equal-and-older"),
        pytest.param(row(lstat()), lstat(atime_ns=T + 5), AFTER, REUSE, id="read-since"),
        pytest.param(row(lstat()), lstat(), T, RACY, id="mtime-at-the-cutoff"),
        pytest.param(row(lstat()), lstat(), T - 1, RACY, id="stamps-after-the-cutoff"),
        pytest.param(
            row(lstat(mtime_ns=WHOLE, ctime_ns=WHOLE)),
            lstat(mtime_ns=WHOLE, ctime_ns=WHOLE),
            WHOLE + COARSE_FS_SLACK_NS,
            RACY,
            id="whole-second-stamps-within-the-coarse-slack",
        ),
        pytest.param(
            row(lstat(mtime_ns=WHOLE, ctime_ns=WHOLE)),
            lstat(mtime_ns=WHOLE, ctime_ns=WHOLE),
            WHOLE + COARSE_FS_SLACK_NS + 1,
            REUSE,
            id="whole-second-stamps-past-the-coarse-slack",
        ),
        pytest.param(row(lstat()), lstat(size=4), AFTER, READ, id="size"),
        pytest.param(row(lstat()), lstat(mtime_ns=T + 1), AFTER, READ, id="mtime"),
        pytest.param(row(lstat()), lstat(ctime_ns=T + 1), AFTER, READ, id="ctime"),
        pytest.param(row(lstat()), lstat(ino=8), AFTER, READ, id="inode"),
        pytest.param(row(lstat()), lstat(dev=2), AFTER, READ, id="device"),
        pytest.param(row(lstat()), lstat(mode=stat.S_IFREG | 0o755), AFTER, READ, id="mode"),
        pytest.param(row(lstat()), lstat(uid=0), AFTER, READ, id="owner"),
        pytest.param(row(lstat()), lstat(gid=0), AFTER, READ, id="group"),
        pytest.param(row(lstat()), lstat(mode=stat.S_IFLNK | 0o777), AFTER, READ, id="now-a-link"),
        pytest.param(row(lstat(), digest=None), lstat(), AFTER, READ, id="a-row-without-digest"),
        pytest.param(row(lstat(), digest=None), lstat(), T, READ, id="nothing-to-reuse-racy"),
        pytest.param(
            row(lstat(mode=stat.S_IFLNK | 0o777)),
            lstat(mode=stat.S_IFLNK | 0o777),
            AFTER,
            REUSE,
            id="a-symlink-unchanged",
        ),
    ],
)
def test_the_stat_cache_verdict(
    cached: Entry, now: os.stat_result, cutoff: int, verdict: str
) -> None:
    assert stat_verdict(cached, now, cutoff) == verdict


READ_AT = T + CLOCK_SLACK_NS + 1  # the first link's read began just past the slack
KNOWN = LinkRead(3, T, T, READ_AT, DIGEST, None)


@pytest.mark.parametrize(
    ("now", "known", "verdict"),
    [
        pytest.param(lstat(nlink=2), KNOWN, REUSE, id="unchanged-since-the-read"),
        pytest.param(lstat(nlink=1), KNOWN, READ, id="one-link-only"),
        pytest.param(lstat(nlink=2), None, READ, id="no-link-read-yet"),
        pytest.param(lstat(nlink=2, size=4), KNOWN, READ, id="size-changed"),
        pytest.param(lstat(nlink=2, mtime_ns=T + 1), KNOWN, READ, id="mtime-changed"),
        pytest.param(lstat(nlink=2, ctime_ns=T + 1), KNOWN, READ, id="ctime-changed"),
        pytest.param(
            lstat(nlink=2), KNOWN._replace(read_at_ns=T + CLOCK_SLACK_NS), RACY, id="ctime-in-slack"
        ),
        pytest.param(
            lstat(nlink=2, mtime_ns=T + 10**12),
            KNOWN._replace(mtime_ns=T + 10**12),
            REUSE,
            id="an-mtime-in-the-future-does-not-decide",
        ),
        pytest.param(
            lstat(nlink=2, mtime_ns=WHOLE, ctime_ns=WHOLE),
            LinkRead(3, WHOLE, WHOLE, WHOLE + CLOCK_SLACK_NS + 1, DIGEST, None),
            RACY,
            id="whole-second-ctime-within-the-coarse-slack",
        ),
        pytest.param(
            lstat(nlink=2, mtime_ns=WHOLE, ctime_ns=WHOLE),
            LinkRead(
                3, WHOLE, WHOLE, WHOLE + CLOCK_SLACK_NS + COARSE_FS_SLACK_NS + 1, DIGEST, None
            ),
            REUSE,
            id="whole-second-ctime-past-the-coarse-slack",
        ),
    ],
)
def test_a_hard_link_takes_another_links_read_only_when_the_file_is_unchanged_and_old(
    now: os.stat_result, known: LinkRead | None, verdict: str
) -> None:
    assert hard_link_verdict(now, known) == verdict


@pytest.mark.parametrize(
    ("after", "got", "torn"),
    [
        pytest.param(lstat(), 3, False, id="unchanged-whole"),
        pytest.param(lstat(atime_ns=T + 9), 3, False, id="only-read-since"),
        pytest.param(lstat(), 2, True, id="short"),
        pytest.param(lstat(), 4, True, id="grew-while-read"),
        pytest.param(lstat(size=4), 3, True, id="size-moved"),
        pytest.param(lstat(mtime_ns=T + 1), 3, True, id="mtime-moved"),
        pytest.param(lstat(ctime_ns=T + 1), 3, True, id="ctime-moved"),
        pytest.param(lstat(ino=8), 3, True, id="another-inode"),
    ],
)
def test_a_read_is_torn_when_the_file_moved_or_gave_other_than_its_size(
    after: os.stat_result, got: int, torn: bool
) -> None:
    assert changed_while_read(lstat(), after, got) is torn


@pytest.mark.parametrize(
    ("after", "got", "length", "torn"),
    [
        pytest.param(lstat(), 4096, 4096, False, id="the-whole-range"),
        pytest.param(lstat(), 100, 4096, True, id="short-the-file-shrank"),
        pytest.param(lstat(mtime_ns=T + 1), 4096, 4096, True, id="the-file-moved"),
        pytest.param(lstat(size=4), 4096, 4096, True, id="the-file-grew"),
    ],
)
def test_a_range_read_is_torn_when_short_or_the_file_moved(
    after: os.stat_result, got: int, length: int, torn: bool
) -> None:
    assert range_changed_while_read(lstat(), after, got, length) is torn


LINK = stat.S_IFLNK | 0o777


@pytest.mark.parametrize(
    ("after", "target", "same"),
    [
        pytest.param(lstat(mode=LINK, size=3), "abc", True, id="the-same-link"),
        pytest.param(lstat(mode=LINK, size=2), "\xe9", True, id="size-in-bytes-not-characters"),
        pytest.param(lstat(mode=LINK, size=3, ctime_ns=T + 1), "abc", False, id="ctime-moved"),
        pytest.param(lstat(mode=LINK, size=3, ino=8), "abc", False, id="another-link"),
        pytest.param(lstat(mode=LINK, size=3, dev=2), "abc", False, id="another-device"),
        pytest.param(lstat(mode=LINK, size=3), "abcd", False, id="a-target-of-another-length"),
    ],
)
def test_a_symlinks_target_belongs_to_the_link_both_lstats_saw(
    after: os.stat_result, target: str, same: bool
) -> None:
    before = lstat(mode=LINK, size=after.st_size)
    assert symlink_unchanged(before, after, target) is same


DIR_MODE = stat.S_IFDIR | 0o755
KNOWN_DIR = Entry.from_stat("d", lstat(mode=DIR_MODE))._replace(node="node-ref", tree="tree")


@pytest.mark.parametrize(
    ("known", "now", "same"),
    [
        pytest.param(KNOWN_DIR, lstat(mode=DIR_MODE, ctime_ns=T + 1), True, id="same-inode-stat"),
        pytest.param(KNOWN_DIR, Entry.from_stat("d", lstat(mode=DIR_MODE)), True, id="same-row"),
        pytest.param(KNOWN_DIR, lstat(mode=DIR_MODE, ino=8), False, id="another-directory"),
        pytest.param(KNOWN_DIR, Entry.from_stat("d", lstat()), False, id="a-file-now"),
        pytest.param(KNOWN_DIR._replace(node=None), lstat(mode=DIR_MODE), False, id="no-node"),
        pytest.param(None, lstat(mode=DIR_MODE), False, id="unknown"),
        pytest.param(row(lstat()), lstat(), False, id="a-file-was-known"),
    ],
)
def test_a_directory_is_carried_only_if_it_is_the_one_the_index_knew(
    known: Entry | None, now: Entry | os.stat_result, same: bool
) -> None:
    assert same_dir(known, now) is same


FIFO = stat.S_IFIFO | 0o600
NODE = DirNode(".", "blake3", "tree", AFTER, {}, 0, "ref")


@pytest.mark.parametrize(
    ("cached", "now", "node", "same"),
    [
        pytest.param(row(lstat(mode=FIFO)), lstat(mode=FIFO), NODE, True, id="unchanged"),
        pytest.param(
            row(lstat(mode=FIFO)), lstat(mode=FIFO, ctime_ns=T + 1), NODE, False, id="ctime"
        ),
        pytest.param(row(lstat(mode=FIFO)), lstat(mode=FIFO, ino=8), NODE, False, id="inode"),
        pytest.param(row(lstat(mode=FIFO)), lstat(mode=DIR_MODE), NODE, False, id="now-a-dir"),
        pytest.param(
            row(lstat(mode=FIFO), xattrs=None), lstat(mode=FIFO), NODE, False, id="not-recorded"
        ),
        pytest.param(
            row(lstat(mode=FIFO)),
            lstat(mode=FIFO),
            DirNode(".", "blake3", "tree", T, {}, 0, "ref"),
            False,
            id="racy",
        ),
    ],
)
def test_a_special_files_attributes_are_carried_only_while_its_inode_is_unchanged(
    cached: Entry, now: os.stat_result, node: DirNode, same: bool
) -> None:
    assert same_inode(cached, now, node) is same


@pytest.mark.parametrize(
    ("listed", "now", "holds"),
    [
        pytest.param(KNOWN_DIR, lstat(mode=DIR_MODE), True, id="still-that-inode"),
        pytest.param(KNOWN_DIR, lstat(mode=DIR_MODE, ctime_ns=T + 1), False, id="ctime-moved"),
        pytest.param(KNOWN_DIR, lstat(mode=DIR_MODE, ino=8), False, id="another-directory"),
        pytest.param(KNOWN_DIR._replace(xattrs=None), lstat(mode=DIR_MODE), False, id="none-read"),
        pytest.param(row(lstat()), lstat(), False, id="a-file-row"),
        pytest.param(None, lstat(mode=DIR_MODE), False, id="not-listed"),
    ],
)
def test_a_listed_directorys_attributes_hold_while_it_is_that_inode_unchanged(
    listed: Entry | None, now: os.stat_result, holds: bool
) -> None:
    assert listed_dir_row_holds(listed, now) is holds
