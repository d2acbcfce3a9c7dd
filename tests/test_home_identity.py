"""A store that vanished is noticed (issue 12, item 7): a home has an identity, in home.id and in
its store; a missing store beside the logs and objects it accounted for, or a store of another
home, is a typed error naming what is missing and what remains, never a silent fresh start."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from settled.errors import HomeUnusable, StoreMissing
from settled.home import read_home_id
from settled.runtime import Runtime

SETTLED = [sys.executable, "-m", "settled.cli"]


def _used_home(tmp_path: Path, name: str = "home") -> str:
    """A home with a closed task: a session log, objects, a checkpoint."""
    home = str(tmp_path / name)
    workspace = tmp_path / f"{name}-ws"
    workspace.mkdir()
    (workspace / "file").write_text("kept\n")
    with Runtime(home) as rt:
        task = rt.new_task(str(workspace))
        rt.wait(rt.exec(task.task, shell="echo out").session)
        assert rt.close_task(task.task).complete
    return home


def _store_id(home: str) -> str:
    with sqlite3.connect(os.path.join(home, "settled.db")) as db:
        return str(db.execute("SELECT value FROM meta WHERE key='home_id'").fetchone()[0])


def _remove_store(home: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        path = os.path.join(home, "settled.db" + suffix)
        if os.path.exists(path):
            os.unlink(path)


def test_a_new_home_gets_one_identity_in_the_file_and_the_store(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    with Runtime(home):
        pass
    first = read_home_id(home)
    assert first is not None and first.startswith("h_")
    assert _store_id(home) == first
    assert oct(os.stat(os.path.join(home, "home.id")).st_mode & 0o777) == "0o600"
    with Runtime(home):
        pass
    assert read_home_id(home) == first  # written once


def test_a_deleted_store_is_an_error_naming_it_and_what_remains(tmp_path: Path) -> None:
    home = _used_home(tmp_path)
    _remove_store(home)
    with pytest.raises(StoreMissing) as caught:
        Runtime(home)
    message = str(caught.value)
    assert os.path.join(home, "settled.db") in message and "is missing" in message
    assert "1 session log directories" in message and "objects" in message
    assert caught.value.remains["objects"] > 0 and caught.value.remains["home.id"] == 1
    assert isinstance(caught.value, HomeUnusable)
    assert not os.path.exists(os.path.join(home, "settled.db"))  # nothing was made


def test_a_deleted_store_stays_missing_even_with_home_id_gone_too(tmp_path: Path) -> None:
    home = _used_home(tmp_path)
    _remove_store(home)
    os.unlink(os.path.join(home, "home.id"))
    with pytest.raises(StoreMissing):
        Runtime(home)  # the logs and objects alone are enough to refuse


def test_the_cli_exits_2_naming_the_missing_store(tmp_path: Path) -> None:
    home = _used_home(tmp_path)
    _remove_store(home)
    env = {**os.environ, "SETTLED_HOME": home}
    done = subprocess.run(
        [*SETTLED, "recover", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"] == "StoreMissing"
    assert "settled.db is missing" in done.stderr and "Traceback" not in done.stderr


def test_another_homes_store_swapped_in_is_an_error_naming_both(tmp_path: Path) -> None:
    home, other = _used_home(tmp_path, "home"), _used_home(tmp_path, "other")
    mine, theirs = read_home_id(home), read_home_id(other)
    assert mine != theirs
    _remove_store(home)
    shutil.copy(os.path.join(other, "settled.db"), os.path.join(home, "settled.db"))
    with pytest.raises(HomeUnusable) as caught:
        Runtime(home)
    assert f"belongs to home {theirs}" in str(caught.value)
    assert f"this home is {mine}" in str(caught.value)


def test_a_lost_home_id_is_written_again_from_the_store(tmp_path: Path) -> None:
    home = _used_home(tmp_path)
    before = read_home_id(home)
    os.unlink(os.path.join(home, "home.id"))
    with Runtime(home) as rt:
        assert rt.store.list_sessions  # the store opens as it was
    assert read_home_id(home) == before


def test_a_home_an_older_settled_made_takes_an_identity(tmp_path: Path) -> None:
    home = _used_home(tmp_path)
    os.unlink(os.path.join(home, "home.id"))
    with sqlite3.connect(os.path.join(home, "settled.db")) as db:
        db.execute("DELETE FROM meta WHERE key='home_id'")
    with Runtime(home):
        pass
    adopted = read_home_id(home)
    assert adopted is not None and _store_id(home) == adopted


def test_first_openers_racing_on_a_new_home_agree_on_one_identity(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def open_once() -> None:
        try:
            barrier.wait(timeout=30)
            with Runtime(home):
                pass
        except BaseException as exc:  # the test inspects it
            errors.append(exc)

    threads = [threading.Thread(target=open_once) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert read_home_id(home) == _store_id(home)
