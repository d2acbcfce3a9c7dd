"""Types of the C extension settled.workspace._walk (see _walk.c and its twin, walk.py)."""

import os

from settled.workspace.manifest import Entry

def scan_dirs(
    dirs: list[tuple[int, dict[str, Entry] | None, int]], workers: int, /
) -> list[tuple[dict[str, Entry], list[tuple[str, os.stat_result]]] | OSError]: ...
def read_files(
    dir_fd: int, names: list[str], limit: int, workers: int, /
) -> list[tuple[os.stat_result, bytes, os.stat_result, bool] | None]: ...

class _Pending: ...  # a capsule: the reads of read_files_start, on their own thread

def read_files_start(dir_fd: int, names: list[str], limit: int, /) -> _Pending: ...
def read_files_take(
    pending: _Pending, upto: int, /
) -> list[tuple[os.stat_result, bytes, os.stat_result, bool] | None]: ...
