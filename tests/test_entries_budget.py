"""The entries budget (issue 36, item 7): a scan refuses the entry that would pass it, by name,
before reading past it, as the holes budget refuses a file; a close stops there and completes
once the tree is back within it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from settled.errors import BadInput
from settled.objects.local import LocalObjectStore
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.workspace.scan import scan
from settled.workspace.scanerrors import (
    DEFAULT_ENTRIES_BUDGET,
    ENTRIES_BUDGET_ENV,
    EntriesOverBudget,
    entries_budget,
)


def _tree(root: Path, dirs: int, files: int) -> None:
    for d in range(dirs):
        (root / f"d{d}").mkdir(parents=True)
        for f in range(files):
            (root / f"d{d}" / f"f{f:02d}").write_bytes(b"x")


def test_the_default_budget_is_in_the_millions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENTRIES_BUDGET_ENV, raising=False)
    assert entries_budget() == DEFAULT_ENTRIES_BUDGET >= 1_000_000


def test_a_scan_refuses_the_entry_past_the_budget_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "ws"
    _tree(ws, 3, 10)  # the root, 3 directories and 30 files: 34 entries
    store = LocalObjectStore(str(tmp_path / "objects"))
    monkeypatch.setenv(ENTRIES_BUDGET_ENV, "34")
    assert scan(ws, None, store).index.count == 34
    monkeypatch.setenv(ENTRIES_BUDGET_ENV, "20")
    # the root and d0, d1, d2 (4), d0's ten files (14), then d1's: its seventh is the 21st
    with pytest.raises(EntriesOverBudget, match=r"^'d1/f06' would be entry 21 of .* 20 entries"):
        scan(ws, None, store)


@pytest.mark.parametrize("value", ["0", "-5", "1e6", "many"])
def test_a_budget_that_is_not_a_whole_number_of_entries_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    (tmp_path / "ws").mkdir()
    monkeypatch.setenv(ENTRIES_BUDGET_ENV, value)
    with pytest.raises(BadInput, match=f"^{ENTRIES_BUDGET_ENV}='{re.escape(value)}'"):
        scan(tmp_path / "ws", None)


def test_a_close_stops_at_a_commands_flood_of_files_and_completes_once_they_are_gone(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENTRIES_BUDGET_ENV, "1000")
    flood = rt.exec(task.task, shell="mkdir flood && cd flood && touch $(seq 1 3000)")
    assert rt.wait(flood.session, timeout=60)["receipt"]["exit"]["code"] == 0
    with pytest.raises(EntriesOverBudget, match=r"'flood/\d+' would be entry 1,001"):
        rt.close_task(task.task)
    assert rt.store.get_task(task.task).state != "complete"
    shutil.rmtree(Path(task.workspace) / "flood")  # admission is sealed: gone from outside
    result = rt.close_task(task.task)
    assert result.complete and result.receipt is not None
