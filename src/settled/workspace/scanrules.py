"""The scanner's rules: may what was known of an entry stand, or must it be read (again)?

Owns the pure decisions ``scan`` takes about one entry, each a small function of the stats and
rows it is handed, with a named answer:

- ``stat_verdict``: what the stat cache says of a file or symlink: ``REUSE`` its row (every stat
  field equal, both timestamps older than the cutoff: ``walk.reusable``), read it again because
  the match is ``RACY`` (too recent to prove anything; its directory's node is then rebuilt), or
  ``READ`` it (no match, or a row with nothing to reuse);
- ``hard_link_verdict``: whether a link of a file this scan read through another link takes
  that read's digest (``REUSE``), or is read: changed since (``READ``), or changed so close to
  that read that an unseen write could have kept its ctime (``RACY``);
- ``changed_while_read`` and ``range_changed_while_read``: a torn read (the file's size,
  mtime, ctime or inode moved between the fstats around it, or it gave other than its size),
  whose digest is never recorded;
- ``symlink_unchanged``: the target read between two lstats is the link they both saw;
- ``same_dir``, ``same_inode`` and ``listed_dir_row_holds``: the directory, special file or
  listed directory row the previous index (or this scan's listing) knew, still that inode,
  unchanged: its node or attributes are carried.

Must never: take a stat, open or read anything (every fact is handed in), or know the scanner's
state; a table test hands each rule facts (tests/test_scan_rules.py).
"""

from __future__ import annotations

import os
import stat
from typing import Final, Literal, NamedTuple

from settled.workspace.index import DirNode
from settled.workspace.manifest import DIR, TYPES, Entry
from settled.workspace.sparse import Extent
from settled.workspace.walk import COARSE_FS_SLACK_NS, reusable, trusted

# The kernel stamps files from a clock that may lag ``time.time_ns()`` by a tick: a node listed
# by a scan is trusted up to the wall clock taken before its walk, minus this.
CLOCK_SLACK_NS: Final = 20_000_000

Verdict = Literal["reuse", "racy", "read"]
REUSE: Final = "reuse"  # what was known stands: not read again
RACY: Final = "racy"  # matches, but too recently changed to prove anything: read again
READ: Final = "read"  # nothing known matches: read it

_NO_CUTOFF: Final = 1 << 62  # later than any timestamp: only the stat fields are compared
_SECOND_NS: Final = 1_000_000_000


class LinkRead(NamedTuple):
    """A multiply-linked file as this scan read it: its stat when the read began, when that
    was, and what the read gave (its other links are not read again while it holds)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    read_at_ns: int
    digest: str
    extents: tuple[Extent, ...] | None


def stat_verdict(cached: Entry, st: os.stat_result, trusted_before_ns: int) -> Verdict:
    """The stat cache's answer for a file or symlink whose row was ``cached`` in a node trusted
    up to ``trusted_before_ns``, given its lstat now."""
    if reusable(cached, st, trusted_before_ns):
        return REUSE
    if (cached.digest or cached.target) is None:
        return READ
    # no match, or a match too recent to trust: which one, by the same fields with no cutoff
    return RACY if reusable(cached, st, _NO_CUTOFF) else READ


def hard_link_verdict(st: os.stat_result, known: LinkRead | None) -> Verdict:
    """A link (``st``) of a file read in this scan through another link (``known``): it takes
    that read's digest if the file is unchanged since (size, mtime, ctime) and its ctime is
    older than the read's start by the clock slack (2 s more on a filesystem of whole-second
    stamps). The ctime alone decides racy, not the mtime as the stat cache's ``walk.trusted``
    does: a command may set an mtime in the future (utimes) to have every link read, never a
    ctime."""
    if st.st_nlink < 2 or known is None:
        return READ
    if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (known.size, known.mtime_ns, known.ctime_ns):
        return READ
    coarse = known.ctime_ns % _SECOND_NS == 0
    if known.ctime_ns >= known.read_at_ns - CLOCK_SLACK_NS - (COARSE_FS_SLACK_NS if coarse else 0):
        return RACY  # read again: that read, later, is the one the next link uses
    return REUSE


def changed_while_read(before: os.stat_result, after: os.stat_result, got: int) -> bool:
    """A whole-file read that gave ``got`` bytes between the fstats ``before`` and ``after``
    is torn: other than the size it had, or the file's size, mtime, ctime or inode moved."""
    return (
        got != before.st_size
        or after.st_size != before.st_size
        or after.st_mtime_ns != before.st_mtime_ns
        or after.st_ctime_ns != before.st_ctime_ns
        or after.st_ino != before.st_ino
    )


def range_changed_while_read(
    before: os.stat_result, after: os.stat_result, got: int, length: int
) -> bool:
    """A read of one data range of ``length`` bytes that gave ``got`` is torn: it came back
    short (the file shrank), or the file moved between the fstats (``changed_while_read``)."""
    return got != length or changed_while_read(before, after, before.st_size)


def symlink_unchanged(before: os.stat_result, after: os.stat_result, target: str) -> bool:
    """The target read between two lstats belongs to the link both saw: the same inode, device
    and ctime, and the size the kernel gives a link is the target's length in bytes."""
    return (before.st_ino, before.st_dev, before.st_ctime_ns) == (
        after.st_ino,
        after.st_dev,
        after.st_ctime_ns,
    ) and after.st_size == len(os.fsencode(target))


def same_dir(known: Entry | None, now: Entry | os.stat_result) -> bool:
    """The directory the previous index knew here (with a node), not one put in its place."""
    if known is None or known.type != DIR or known.node is None:
        return False
    if isinstance(now, os.stat_result):
        return (known.ino, known.dev) == (now.st_ino, now.st_dev)
    return now.type == DIR and (known.ino, known.dev) == (now.ino, now.dev)


def same_inode(cached: Entry, st: os.stat_result, node: DirNode) -> bool:
    """A directory, FIFO, socket or device the previous node recorded, unchanged since (its
    inode and ctime, older than the node's cutoff): its attributes are as recorded, since any
    ``setxattr`` would have moved the ctime."""
    return (
        cached.xattrs is not None
        and cached.ino == st.st_ino
        and cached.dev == st.st_dev
        and cached.ctime_ns == st.st_ctime_ns
        and cached.type == TYPES.get(stat.S_IFMT(st.st_mode))
        and trusted(cached, node.trusted_before_ns)
    )


def listed_dir_row_holds(listed: Entry | None, st: os.stat_result) -> bool:
    """The row this scan's listing made of a directory (with its attributes) still describes
    the directory now open: the same inode, device and ctime (a ``setxattr`` moves the ctime)."""
    return (
        listed is not None
        and listed.type == DIR
        and listed.xattrs is not None
        and (listed.ino, listed.dev, listed.ctime_ns) == (st.st_ino, st.st_dev, st.st_ctime_ns)
    )
