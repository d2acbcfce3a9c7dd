"""No credential is written into a home (issue 39, item 9), on real PostgreSQL (``pg_cluster``).

A home bound through the CLI to the password-protected test cluster, with a command run and its
receipt written by its owner, holds no byte of the password anywhere under it. Opening it again
works with the password from each source (the URL given, PGPASSWORD, PGPASSFILE, a file named
with --password-file), fails in one line without any, and a password file others may read is
refused. A home an older settled bound with the password in backends.json keeps working (with a
warning) until another source works, which scrubs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pg
import pytest

from settled.storepass import without_password

pytestmark = pytest.mark.timeout(300)


def _env(**extra: str) -> dict[str, str]:
    keep = {
        k: v for k, v in os.environ.items() if not k.startswith(("SETTLED_", "PG")) and k != "HOME"
    }
    return {**keep, "SETTLED_LAUNCHER": "fresh", **extra}


def _cli(home: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "settled", "--home", str(home), *argv],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def _holds(root: Path, secret: str) -> list[str]:
    """Every file under ``root`` whose bytes hold ``secret`` (or its URL-quoted form)."""
    from urllib.parse import quote

    needles = {secret.encode(), quote(secret, safe="").encode()}
    found = []
    for where, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(where, name)
            try:
                with open(path, "rb") as handle:
                    data = handle.read()
            except OSError:
                continue
            if any(n in data for n in needles):
                found.append(path)
    return found


@pytest.fixture
def url(pg_cluster: pg.Cluster, tmp_path: Path) -> str:
    """The store URL with the password in it, a schema of this test's own."""
    return pg.url_for_directory(str(tmp_path))


def _password_file(path: Path, mode: int = 0o600) -> Path:
    path.write_text(pg.PASSWORD + "\n")
    path.chmod(mode)
    return path


def test_a_bound_home_holds_no_password_and_opens_from_each_source(
    url: str, tmp_path: Path
) -> None:
    home, workspace = tmp_path / "home", tmp_path / "w"
    workspace.mkdir()
    given = _env(SETTLED_STORE=url, SETTLED_OBJECTS=f"file://{tmp_path}/objects")
    made = _cli(home, given, "task", "new", "--workspace", str(workspace), "--json")
    assert made.returncode == 0, made.stderr
    task = json.loads(made.stdout)["task"]
    ran = _cli(home, given, "run", "--task", task, "--json", "--", "sh", "-c", "echo hi")
    assert ran.returncode == 0, ran.stderr  # its owner found the password: the receipt is in
    assert json.loads(ran.stdout)["exit"]["code"] == 0
    assert pg.PASSWORD not in ran.stdout + ran.stderr + made.stdout + made.stderr

    binding = json.loads((home / "backends.json").read_text())
    assert binding["store"] == without_password(url) and "password_file" not in binding
    assert _holds(home, pg.PASSWORD) == []

    bare = _env()  # the home's binding only: no password from anywhere
    refused = _cli(home, bare, "ls")
    assert refused.returncode == 1 and "unreachable" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and pg.PASSWORD not in refused.stderr

    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"*:*:*:*:{pg.PASSWORD}\n")
    pgpass.chmod(0o600)
    secret_file = _password_file(tmp_path / "pw")
    for source in (
        _env(PGPASSWORD=pg.PASSWORD),
        _env(PGPASSFILE=str(pgpass)),
        _env(SETTLED_STORE_PASSWORD_FILE=str(secret_file)),
        _env(SETTLED_STORE=url),
    ):
        listed = _cli(home, source, "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [t["task"] for t in json.loads(listed.stdout)["tasks"]] == [task]
    flag = _cli(home, bare, "--password-file", str(secret_file), "status", task)
    assert flag.returncode == 0, flag.stderr
    assert _holds(home, pg.PASSWORD) == []


def test_a_password_file_others_may_read_is_refused_in_one_line(url: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    loose = _password_file(tmp_path / "pw", 0o644)
    env = _env(SETTLED_OBJECTS=f"file://{tmp_path}/objects")
    bare_url = without_password(url)
    refused = _cli(home, env, "--store", bare_url, "--password-file", str(loose), "ls")
    assert refused.returncode == 2, refused.stderr
    assert str(loose) in refused.stderr and "chmod 600" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and pg.PASSWORD not in refused.stderr
    assert not (home / "backends.json").exists()  # nothing recorded for a refused request

    loose.chmod(0o600)  # the same file, made private: bound, its path recorded
    bound = _cli(home, env, "--store", bare_url, "--password-file", str(loose), "ls")
    assert bound.returncode == 0, bound.stderr
    assert json.loads((home / "backends.json").read_text())["password_file"] == str(loose)
    assert _cli(home, _env(), "ls").returncode == 0  # the recorded path serves later opens
    loose.chmod(0o640)
    again = _cli(home, _env(), "ls")
    assert again.returncode == 2 and "chmod 600" in again.stderr
    assert _holds(home, pg.PASSWORD) == []


def test_a_home_an_older_settled_bound_keeps_working_then_is_scrubbed(
    url: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    objects = f"file://{tmp_path}/objects"
    (home / "backends.json").write_text(json.dumps({"store": url, "objects": objects}))
    (home / "backends.json").chmod(0o600)

    old = _cli(home, _env(), "ls")  # the stored password still opens it, with one warning
    assert old.returncode == 0, old.stderr
    assert "backends.json holds the database password" in old.stderr
    assert pg.PASSWORD not in old.stderr
    assert _holds(home, pg.PASSWORD) == [str(home / "backends.json")]

    given = _cli(home, _env(PGPASSWORD=pg.PASSWORD), "ls")  # another source works: scrubbed
    assert given.returncode == 0, given.stderr
    assert _holds(home, pg.PASSWORD) == []
    assert json.loads((home / "backends.json").read_text()) == {
        "store": without_password(url),
        "objects": objects,
    }


def test_no_command_reads_the_password_from_a_file_its_view_would_show(
    url: str, tmp_path: Path
) -> None:
    """A password file under a root the command's view shows (here /etc) and PGPASSFILE are
    covered in every command's view: a command of settled's uid could read them otherwise,
    and with the password write the evidence itself. A `password=` in the URL's query is not
    recorded either."""
    import secrets

    etc_file = Path(f"/etc/settled-test-{secrets.token_hex(4)}.pass")
    pgpass = _password_file(tmp_path / "pgpass-file")
    pgpass.write_text(f"*:*:*:*:{pg.PASSWORD}\n")
    try:
        _password_file(etc_file)
        home, workspace = tmp_path / "home", tmp_path / "w"
        workspace.mkdir()
        env = _env(SETTLED_OBJECTS=f"file://{tmp_path}/objects", PGPASSFILE=str(pgpass))
        bare_url = without_password(url)
        query_url = f"{bare_url}&password={pg.PASSWORD}"
        made = _cli(home, env, "--store", query_url, "--password-file", str(etc_file),
                    "task", "new", "--workspace", str(workspace), "--json")  # fmt: skip
        assert made.returncode == 0, made.stderr
        task = json.loads(made.stdout)["task"]
        for secret in (etc_file, pgpass):
            read = _cli(home, env, "run", "--task", task, "--json", "--", "cat", str(secret))
            receipt = json.loads(read.stdout)
            if secret == etc_file:  # in the view (/etc): covered
                assert str(secret) in receipt["isolation"]["hidden"]["files"], receipt
            else:  # outside the view altogether
                assert receipt["exit"]["code"] != 0, receipt["exit"]
            logs = _cli(home, env, "logs", receipt["session"])
            assert logs.returncode == 0, logs.stderr
            assert pg.PASSWORD not in logs.stdout + read.stdout + read.stderr, secret
        assert _holds(home, pg.PASSWORD) == []  # the query's password was not recorded
    finally:
        etc_file.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("sqlite:///home/settled.db", "sqlite:///home/settled.db"),  # as given, never respelled
        ("postgresql://u:pw@h:5432/db", "postgresql://u@h:5432/db"),
        ("postgresql://u@h/db?options=-csearch_path%3Dx&password=pw",
         "postgresql://u@h/db?options=-csearch_path%3Dx"),
        ("postgresql://u@h/db?options=-csearch_path%3Dx", "postgresql://u@h/db?options=-csearch_path%3Dx"),
    ],
)  # fmt: skip
def test_without_password_takes_out_only_the_password(given: str, kept: str) -> None:
    assert without_password(given) == kept
