"""When the stat cache is evidence that a file did not change: the rule, written once.

Owns ``vouches`` (pure: a scan's window, the task's sessions and whether the filesystem stamps
a time on a write through a mapping, in; whether the rows that scan listed may still vouch for
their files, out), ``stamps_mapped_writes`` (which filesystems do) and ``filesystem_magic``
(``fstatfs``'s ``f_type`` of an open directory, the one read this module does).

Why a rule beyond the racy-git one. A stat match says a file did not change only if every write
to it stamps its mtime or ctime. A write through a shared, writable mapping does not always:

- on ext4, xfs and btrfs the kernel stamps the file when a page of the mapping is first written
  after it was clean or newly mapped (``page_mkwrite``), but a write to a page whose mapping is
  already writable and dirty stamps nothing until writeback (measured here: ../shared FACTS).
  A process that held such a mapping while a scan listed the file can write after the listing
  and leave every stat field as the scan saw it. A process that maps the file later takes a
  write fault on its first write, which stamps.
- on tmpfs (and any filesystem not known to stamp, overlayfs and FUSE included) a write to a
  page already mapped (read first, or dirty) stamps nothing at all: any process that could map
  the file after the listing could change it unseen.

So a scan's rows vouch for nothing if a session of the task (or of a task sharing its workspace)
was alive during that scan (filesystems that stamp), or at any time since the scan began (the
others). The close's final scan runs after every session's death evidence, so its own rows are
evidence for later scans; a checkpoint taken while a service runs is not. A session is alive
from its admission (``created_at``, before any of its processes exist) until it is settled
(``settled_at``, written after its death evidence); one not settled is alive now. Times are
compared with ``WINDOW_SLACK_NS`` (1 s) on each side, so a small clock step, or an admission
stamped by another host's clock, costs a re-read rather than a missed change (a session is
admitted and settled on hosts that share the store; their clocks are assumed within it).
A scan whose window is not on record (lost with the stat cache, or written before windows
were recorded) vouches for nothing.

Must never: vouch for a window it does not know; treat a filesystem it does not know as one
that stamps.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Final

WINDOW_SLACK_NS: Final = 1_000_000_000

# the rule in one sentence, as every scan fact states it
RULE: Final = (
    "a file is re-read unless its stat row was listed by a scan no session overlapped "
    "(ext4, xfs, btrfs) or no session ran since (any other filesystem, tmpfs included): "
    "a write through a shared mapping may change it without stamping a time"
)
INCREMENTAL_GAP: Final = (
    "directories the journal saw no change in were carried unread: a write through a shared "
    "mapping is never in the journal, so this checkpoint may miss one; the close's full scan "
    "does not"
)

# f_type of the filesystems whose write fault on a clean or newly mapped page stamps the file
# (page_mkwrite calls file_update_time): a later mapping's first write is always seen
EXT4_MAGIC: Final = 0xEF53  # ext2, ext3 and ext4 share it
XFS_MAGIC: Final = 0x58465342
BTRFS_MAGIC: Final = 0x9123683E
TMPFS_MAGIC: Final = 0x01021994
_STAMPING: Final = frozenset({EXT4_MAGIC, XFS_MAGIC, BTRFS_MAGIC})

Window = tuple[int, int]  # a scan's (started_ns, ended_ns), wall clock
Alive = tuple[float, float | None]  # a session's (created_at, settled_at), seconds; None: alive


def stamps_mapped_writes(magic: int) -> bool:
    """Whether a write through a mapping made after a scan is stamped on this filesystem."""
    return magic in _STAMPING


def vouches(window: Window | None, sessions: Iterable[Alive], now_ns: int, magic: int) -> bool:
    """Whether rows listed by the scan of ``window`` may vouch for their files now, on a
    filesystem of ``magic``, given every session that could write the workspace."""
    if window is None:
        return False
    started, ended = window
    for created_at, settled_at in sessions:
        born = int(created_at * 1e9) - WINDOW_SLACK_NS
        gone = now_ns if settled_at is None else int(settled_at * 1e9) + WINDOW_SLACK_NS
        if gone < started:
            continue  # over before the scan began: every mapping it held was gone
        if not stamps_mapped_writes(magic):
            return False  # alive since the scan began: it could write a mapped page unseen
        if born <= ended:
            return False  # alive during the scan: a writable dirty page may outlive the listing
    return True


_FSTATFS: list[Any] = []  # libc's fstatfs and its struct, bound at the first scan that asks


def filesystem_magic(fd: int) -> int:
    """``f_type`` of the filesystem holding the open ``fd`` (ctypes loaded here, at the first
    call: a process that never scans, the CLI's verbs, never pays for it)."""
    import ctypes

    if not _FSTATFS:

        class Statfs(ctypes.Structure):
            _fields_ = (("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112))

        call = ctypes.CDLL(None, use_errno=True).fstatfs
        call.argtypes = [ctypes.c_int, ctypes.POINTER(Statfs)]
        call.restype = ctypes.c_int
        _FSTATFS.extend((call, Statfs))
    call, statfs = _FSTATFS
    found = statfs()
    if call(fd, ctypes.byref(found)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return int(found.f_type) & 0xFFFFFFFF
