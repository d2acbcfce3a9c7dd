"""atomic.py, the one way settled replaces a file: all of the new bytes or the old file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from settled.atomic import replacing, write_atomic


def test_a_replacement_is_all_the_new_bytes_with_the_mode_asked_for(tmp_path: Path) -> None:
    target = tmp_path / "state"
    target.write_bytes(b"old")
    write_atomic(str(target), b"new bytes", 0o400)
    assert target.read_bytes() == b"new bytes"
    assert target.stat().st_mode & 0o777 == 0o400
    assert os.listdir(tmp_path) == ["state"]  # no temporary file left beside it


def test_a_failed_replacement_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "log"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), replacing(str(target)) as handle:
        handle.write(b"half of the new")
        raise RuntimeError("the copy failed midway")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["log"]
