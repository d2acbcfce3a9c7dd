"""Ignore rules: bound once, pruned from the scan, a bad pattern refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from settled.errors import BadInput
from settled.workspace import ignore
from settled.workspace.scan import scan


def _tree(root: Path) -> None:
    (root / "src").mkdir()
    (root / "src" / "a.py").write_text("a")
    (root / "build").mkdir()
    (root / "build" / "deep").mkdir()
    (root / "build" / "deep" / "out.o").write_text("o")
    (root / "x.log").write_text("l")
    (root / "keep.log").write_text("k")


def test_ignored_dir_not_scanned_and_negation_works(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / ".settledignore").write_text("build/\n*.log\n!keep.log\n# comment\n\n")
    rules = ignore.bind(tmp_path)
    result = scan(tmp_path, ignore=rules)
    paths = set(result.index.by_path)
    assert "build" not in paths and "build/deep/out.o" not in paths
    assert "x.log" not in paths
    assert {"keep.log", "src/a.py", ".settledignore"} <= paths
    # pruned, not walked: only the root and src were listed
    assert result.stats.dirs_listed == 2


def test_settledignore_is_never_ignored(tmp_path: Path) -> None:
    (tmp_path / ".settledignore").write_text(".*\n")
    (tmp_path / ".hidden").write_text("h")
    paths = set(scan(tmp_path, ignore=ignore.bind(tmp_path)).index.by_path)
    assert ".settledignore" in paths and ".hidden" not in paths


def test_editing_settledignore_mid_task_changes_nothing(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / ".settledignore").write_text("build/\n")
    bound = ignore.from_record(ignore.bind(tmp_path).record())  # as recorded at creation
    (tmp_path / ".settledignore").write_text("build/\nsrc/\n*.log\n")  # the command widens it
    paths = set(scan(tmp_path, ignore=bound).index.by_path)
    assert "src/a.py" in paths and "x.log" in paths and "build" not in paths


def test_extra_patterns_follow_the_file(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / ".settledignore").write_text("*.log\n")
    rules = ignore.bind(tmp_path, ["!keep.log", "build"])
    assert rules.patterns == ("*.log", "!keep.log", "build")
    assert rules.digest.startswith("sha256:")
    paths = set(scan(tmp_path, ignore=rules).index.by_path)
    assert "keep.log" in paths and "x.log" not in paths and "build" not in paths


def test_bad_pattern_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"'\\\\'"):
        ignore.bind(tmp_path, ["ok/", "\\"])
    with pytest.raises(BadInput, match="newline"):
        ignore.compile_rules(["a\nb"])


def test_recorded_rules_checked_against_digest() -> None:
    fact = ignore.compile_rules(["build/"]).record()
    fact["patterns"] = ["build/", "src/"]
    with pytest.raises(BadInput, match="digest"):
        ignore.from_record(fact)
    assert ignore.from_record(None) is ignore.NO_RULES


def test_symlinked_settledignore_refused(tmp_path: Path) -> None:
    (tmp_path / "real").write_text("src/\n")
    (tmp_path / ".settledignore").symlink_to(tmp_path / "real")
    with pytest.raises(BadInput, match="cannot be read"):
        ignore.bind(tmp_path)


def test_incremental_scan_skips_dirty_dirs_under_ignored(tmp_path: Path) -> None:
    _tree(tmp_path)
    rules = ignore.compile_rules(["build/"])
    first = scan(tmp_path, ignore=rules)
    (tmp_path / "build" / "deep" / "new.o").write_text("n")
    (tmp_path / "src" / "b.py").write_text("b")
    again = scan(tmp_path, first.index, only=["build/deep", "src"], ignore=rules)
    paths = set(again.index.by_path)
    assert "src/b.py" in paths and not any(p.startswith("build") for p in paths)
