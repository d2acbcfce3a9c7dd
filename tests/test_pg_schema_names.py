"""A schema named in `search_path` is the one settled creates and uses (issue 39, item 9).

On real PostgreSQL (``pg_cluster``): an unquoted name with upper case is folded to lower case,
as the server folds it, so the schema created is the one the connection then searches (it was
an internal error: `MySchema` created, `myschema` searched); a double-quoted name keeps its
case; a malformed one is one line (exit 2 from the CLI) that never shows the password.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pg
import pytest

from settled.backends import BadBackend
from settled.runtime import Runtime
from settled.store.postgres import open_postgres


def _schemas(base: str) -> set[str]:
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        return {row[0] for row in conn.execute("SELECT nspname FROM pg_namespace").fetchall()}


def _url(base: str, spelled: str) -> str:
    return f"{base}?options=-csearch_path%3D{spelled}"


@pytest.mark.parametrize("quoted", [False, True], ids=["unquoted", "quoted"])
def test_an_upper_case_schema_is_created_and_used_as_postgresql_reads_it(
    pg_cluster: pg.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quoted: bool
) -> None:
    base = pg_cluster.url()
    name = f"My_Schema_{secrets.token_hex(3)}"
    monkeypatch.setenv("SETTLED_STORE", _url(base, f"%22{name}%22" if quoted else name))
    monkeypatch.setenv("SETTLED_OBJECTS", f"file://{tmp_path}/objects")
    (tmp_path / "w").mkdir()
    with Runtime(str(tmp_path / "home")) as rt:
        task = rt.new_task(str(tmp_path / "w"))
    expected = name if quoted else name.lower()
    assert expected in _schemas(base) and (name if not quoted else name.lower()) not in _schemas(
        base
    )
    with Runtime(str(tmp_path / "home")) as again:  # opened again: the same schema, the task
        assert again.task_status(task.task)["state"] == "open"


@pytest.mark.parametrize(
    "spelled", ["%22Unterminated", "%22%22", "%24user,public", "%22A%22B", "x" * 64, ""]
)
def test_a_malformed_schema_is_one_line_without_the_password(
    pg_cluster: pg.Cluster, tmp_path: Path, spelled: str
) -> None:
    url = _url(pg_cluster.url(), spelled)
    with pytest.raises(BadBackend) as caught:
        open_postgres(url)
    assert "\n" not in str(caught.value) and pg.PASSWORD not in str(caught.value)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    done = subprocess.run(
        [sys.executable, "-m", "settled", "--home", str(tmp_path / "h"), "--store", url, "ls"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "search_path" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert pg.PASSWORD not in done.stderr + done.stdout
    assert not (tmp_path / "h" / "backends.json").exists()  # refused before the home is bound
