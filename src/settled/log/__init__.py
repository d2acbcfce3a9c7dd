"""settled.log: the per-session byte log. Logs are bytes with cursors, not lines.

Owns the layout of a session's log directory (``stdout.log`` and ``stderr.log``) and re-exports
the writer (hot path, inside the supervisor), the cursor reader and the model view.

Must never: split on lines, decode stored bytes (decoding is only ever a view), or hold a whole
log in memory.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

    from settled.errors import CursorOutOfRange
    from settled.log.reader import follow, read_range, stored_length
    from settled.log.view import Window, model_view, read_window, render_view, window_view
    from settled.log.writer import (
        DIGEST_ALGORITHM,
        StreamSummary,
        StreamWriter,
        drain_once,
        enlarge_pipe,
    )

# Loaded on first use: a reader imports ``settled.log.reader``, which runs this package first,
# and must not pay for the writer (the owner's hot path) it never calls; an owner imports
# ``settled.log.flush`` before its command starts, and must not pay for the error vocabulary.
_LAZY = {
    "CursorOutOfRange": "settled.errors",
    **dict.fromkeys(("follow", "read_range", "stored_length"), "settled.log.reader"),
    **dict.fromkeys(
        ("Window", "model_view", "read_window", "render_view", "window_view"), "settled.log.view"
    ),
    **dict.fromkeys(
        ("DIGEST_ALGORITHM", "StreamSummary", "StreamWriter", "drain_once", "enlarge_pipe"),
        "settled.log.writer",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


STREAMS: Final = ("stdout", "stderr")


def stream_path(log_dir: str, stream: str) -> str:
    """``<log_dir>/stdout.log`` or ``<log_dir>/stderr.log``."""
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; expected one of {', '.join(STREAMS)}")
    return os.path.join(log_dir, f"{stream}.log")


__all__ = [
    "DIGEST_ALGORITHM",
    "STREAMS",
    "CursorOutOfRange",
    "StreamSummary",
    "StreamWriter",
    "Window",
    "drain_once",
    "enlarge_pipe",
    "follow",
    "model_view",
    "read_range",
    "read_window",
    "render_view",
    "stored_length",
    "stream_path",
    "window_view",
]
