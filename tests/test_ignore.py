"""Ignore rules: bound once, pruned from the scan, a bad pattern refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from settled.errors import BadInput
from settled.runtime import Runtime
from settled.workspace import ignore
from settled.workspace.manifest import ManifestHead, read_head, read_manifest
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


def _workspace(tmp_path: Path) -> Path:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    _tree(workspace)
    (workspace / ".settledignore").write_text("build/\n")
    return workspace


def test_task_binds_rules_and_manifest_and_explain_record_them(rt: Runtime, tmp_path: Path) -> None:
    workspace = _workspace(tmp_path)
    task = rt.new_task(str(workspace), ignore=["*.log", "!keep.log"])
    assert task.ignore_rules is not None
    assert task.ignore_rules["patterns"] == ["build/", "*.log", "!keep.log"]
    assert rt.store.get_task(task.task).ignore_rules == task.ignore_rules  # in the store
    # the command widens .settledignore mid-task: the bound rules are what count
    widen = "printf 'build/\\nsrc/\\n' > .settledignore && echo new > src/b.py"
    rt.wait(rt.exec(task.task, shell=widen, key="widen").session, timeout=30)
    receipt = rt.checkpoint(task.task, incremental=False)
    assert receipt["covers"]["ignored"] == task.ignore_rules
    head = read_head(rt.workspace.objects, receipt["manifest"])
    assert isinstance(head, ManifestHead) and head.ignore == task.ignore_rules
    paths = {e.path for e in read_manifest(rt.workspace.objects, receipt["manifest"]).entries}
    assert {"src/a.py", "src/b.py", "keep.log", ".settledignore"} <= paths
    assert not any(p.startswith("build") for p in paths) and "x.log" not in paths
    result = rt.close_task(task.task)
    assert result.complete, result.blocked_on
    explained = rt.explain(task.task)
    assert explained["ignored"] == task.ignore_rules
    assert "'build/'" in explained["words"] and "does not cover" in explained["words"]


def test_restore_leaves_ignored_paths_out(rt: Runtime, tmp_path: Path) -> None:
    task = rt.new_task(str(_workspace(tmp_path)))
    manifest = rt.checkpoint(task.task)["manifest"]
    dest = tmp_path / "dest"
    dest.mkdir()
    assert rt.restore(manifest, str(dest)).complete
    assert (dest / "src" / "a.py").read_text() == "a" and not (dest / "build").exists()


def test_new_task_refuses_a_bad_pattern_and_records_nothing(rt: Runtime, tmp_path: Path) -> None:
    workspace = _workspace(tmp_path)
    with pytest.raises(BadInput, match=r"'\\\\'"):
        rt.new_task(str(workspace), key="bad", ignore=["\\"])
    assert rt.store.find_task("bad") is None
    (workspace / ".settledignore").write_text("!\n")
    with pytest.raises(BadInput, match="'!'"):
        rt.new_task(str(workspace), key="bad2")
    assert rt.store.find_task("bad2") is None


def test_a_task_without_rules_writes_manifests_as_before(rt: Runtime, tmp_path: Path) -> None:
    workspace = tmp_path / "plain"
    workspace.mkdir()
    (workspace / "f").write_text("f")
    task = rt.new_task(str(workspace))
    receipt = rt.checkpoint(task.task)
    assert "ignored" not in receipt["covers"]
    head = read_head(rt.workspace.objects, receipt["manifest"])
    assert isinstance(head, ManifestHead) and head.ignore is None
