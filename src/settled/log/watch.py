"""Wake a follower when a session's log directory changes: inotify, for readers, never the owner.

Owns: one inotify instance watching one session's log directory (a byte appended to
``stdout.log`` or ``stderr.log``, a log created, a log closed), handed to a pause as a file
descriptor to poll beside the owner's exit handle (sessions.py). A follower then wakes when a
byte is stored, not at its next poll, and costs nothing while the command is quiet.

Why inotify through ``ctypes.CDLL(None)``: the standard library has no inotify, and the CLI's
followers (`run`, `attach`, `logs --follow`) must start light: ``ctypes`` alone is ~1.5 ms and is
imported only when a follower first waits, while ``ctypes.util`` (what inotify_simple loads to
find libc) costs ~17 ms. The owner never watches its own logs: its writes pay one fsnotify hook
in the kernel per write while a follower watches, and nothing otherwise.

The watch is a hint, never the proof: what a follower serves comes from the file and the final
cursor from the receipt. When the watch cannot be made (no inotify, the per-user limit of
instances reached, the directory not created yet), ``arm`` says so and the pause falls back to
polling; an event queue that overflowed is one more readable wake-up.

Must never: read or interpret a log's bytes, block (the descriptor is non-blocking), or leak its
descriptor (``close``; it is close-on-exec).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

IN_MODIFY: Final = 0x00000002
IN_CLOSE_WRITE: Final = 0x00000008
IN_MOVED_TO: Final = 0x00000080
IN_CREATE: Final = 0x00000100
IN_NONBLOCK: Final = os.O_NONBLOCK
IN_CLOEXEC: Final = os.O_CLOEXEC
WATCHED: Final = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE

_libc: Any = None


def _inotify() -> Any:
    """libc's inotify calls, bound once per process (``ctypes`` imported here, never at the
    module's import, so a verb that never waits never pays for it)."""
    global _libc
    if _libc is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_init1.restype = ctypes.c_int
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_add_watch.restype = ctypes.c_int
        _libc = (libc, ctypes.get_errno)
    return _libc


def watch_directory(path: str, mask: int = WATCHED) -> int:
    """A non-blocking, close-on-exec inotify descriptor watching ``path`` for ``mask``;
    OSError (FileNotFoundError when the directory does not exist yet) otherwise."""
    libc, get_errno = _inotify()
    fd: int = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        code = get_errno()
        raise OSError(code, f"inotify_init1: {os.strerror(code)}")
    if libc.inotify_add_watch(fd, os.fsencode(path), mask) < 0:
        code = get_errno()
        os.close(fd)
        raise OSError(code, f"inotify_add_watch: {os.strerror(code)}", path)
    return fd


class LogWatch:
    """The wake-up of one session's followers: ``arm`` gives the descriptor to poll, ``clear``
    empties it after a wake-up, before the follower looks at the files again (so a byte stored
    after the look wakes the next pause)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.unavailable: str | None = None  # why no watch can be made here, for good
        self._fd = -1

    def arm(self) -> tuple[int | None, bool]:
        """(the descriptor to poll, or None when nothing is watched; whether the watch was set
        up by this call). A watch set up now missed whatever changed before it: the caller
        looks again before it sleeps on it."""
        if self._fd >= 0:
            return self._fd, False
        if self.unavailable is not None:
            return None, False
        try:
            self._fd = watch_directory(self.directory)
        except FileNotFoundError:
            return None, False  # the owner has not made the directory yet: try again next time
        except (OSError, AttributeError) as exc:  # EMFILE at the per-user limit; no inotify
            self.unavailable = f"{type(exc).__name__}: {exc}"
            return None, False
        return self._fd, True

    def clear(self) -> None:
        """Drop the events queued so far (what changed will be read from the files)."""
        if self._fd < 0:
            return
        try:
            while os.read(self._fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
