"""A real PostgreSQL cluster for the tests: one per test session, started on first use.

`initdb` refuses to run as root, so the cluster belongs to the `postgres` user: its data
directory and unix socket live in a temp directory owned by it, and `initdb` and `pg_ctl` run
through `runuser`. The server listens on 127.0.0.1 on a free port with password (SCRAM) auth, so
a wrong password is refused as it would be in production; the local socket trusts. `fsync=off`
and `full_page_writes=off`: a test cluster is thrown away, durability across power loss is not
what these tests measure, and it makes each commit cheap on a shared disk.

A test's store is a schema of its own in the one database (`url_for_directory`): opening a
store with `?options=-csearch_path=NAME` creates it, which costs a few ms, so every test gets a
fresh store. The schema is derived from the test's directory, so the children of the
concurrency tests (spawned processes, which inherit the environment) open the same store from
the same directory. The cluster is stopped at session end (`pg_ctl stop -m immediate`, then its
postmaster is killed by pid if it is still there) and its directory removed.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field

PG_BIN = os.environ.get("SETTLED_PG_BIN", "/usr/lib/postgresql/15/bin")
PG_USER = "postgres"
PASSWORD = "s3cret-pw-for-tests"
DATABASE = "settled_test"
URL_ENV = "SETTLED_TEST_PG_URL"  # the base URL, read by spawned children too
START_TIMEOUT_S = 60


def missing_reason() -> str | None:
    """Why a cluster cannot be started here, or None."""
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not os.access(os.path.join(PG_BIN, tool), os.X_OK):
            return f"PostgreSQL binaries not found: no {tool} in {PG_BIN} (set SETTLED_PG_BIN)"
    if shutil.which("runuser") is None:
        return "runuser is missing: initdb must run as the postgres user"
    try:
        import pwd

        pwd.getpwnam(PG_USER)
    except KeyError:
        return f"no {PG_USER!r} user to own the cluster (initdb refuses to run as root)"
    if os.geteuid() != 0:
        return "not root: cannot run initdb as the postgres user"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_postgres(*argv: str, timeout: float = START_TIMEOUT_S) -> None:
    """A minimal environment: the server must not inherit the marker of the test that happened
    to start it, or that test's cleanup would kill the session's one cluster."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    done = subprocess.run(
        ["runuser", "-u", PG_USER, "--", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr or done.stdout}")


@dataclass
class Cluster:
    root: str
    port: int
    stopped: bool = field(default=False)

    @property
    def data(self) -> str:
        return os.path.join(self.root, "data")

    def url(self, database: str = DATABASE, password: str = PASSWORD) -> str:
        secret = urllib.parse.quote(password, safe="")
        return f"postgresql://{PG_USER}:{secret}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        """Immediate stop, then the postmaster by pid if it outlived that; the directory goes."""
        if self.stopped:
            return
        self.stopped = True
        pid = _postmaster_pid(self.data)
        with contextlib.suppress(Exception):
            _as_postgres(
                os.path.join(PG_BIN, "pg_ctl"), "-D", self.data, "-m", "immediate", "-w",
                "-t", "15", "stop", timeout=30,
            )  # fmt: skip
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            give_up = time.monotonic() + 10
            while time.monotonic() < give_up and _alive(pid):
                time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)


def _postmaster_pid(data: str) -> int | None:
    try:
        with open(os.path.join(data, "postmaster.pid")) as handle:
            return int(handle.readline().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_cluster(*, durable: bool = False) -> Cluster:
    """initdb, start on a free port, create the test database; stopped at exit whatever happens.
    `durable` keeps fsync and full page writes on (a benchmark compares against SQLite's
    synchronous=FULL)."""
    import pwd

    entry = pwd.getpwnam(PG_USER)
    root = tempfile.mkdtemp(prefix="settled-pg-")
    os.chown(root, entry.pw_uid, entry.pw_gid)
    cluster = Cluster(root=root, port=free_port())
    atexit.register(cluster.stop)
    try:
        pwfile = os.path.join(root, "pw")
        with open(pwfile, "w") as handle:
            handle.write(PASSWORD + "\n")
        os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        _as_postgres(
            os.path.join(PG_BIN, "initdb"), "-D", cluster.data, "-U", PG_USER, "--no-sync",
            "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}",
            "-E", "UTF8", "--locale=C.UTF-8",
        )  # fmt: skip
        options = " ".join(
            [
                f"-p {cluster.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={root}",
                "-c max_connections=300",
                *([] if durable else ["-c fsync=off", "-c full_page_writes=off"]),
            ]
        )
        _as_postgres(
            os.path.join(PG_BIN, "pg_ctl"), "-D", cluster.data, "-l",
            os.path.join(root, "server.log"), "-o", options, "-w", "-t", str(START_TIMEOUT_S),
            "start",
        )  # fmt: skip
        import psycopg

        with psycopg.connect(cluster.url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {DATABASE}")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def schema_for_directory(directory: str) -> str:
    return "t_" + hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:24]


def url_for_directory(directory: str) -> str:
    """The store URL of a test directory: its own schema in the test database."""
    base = os.environ.get(URL_ENV)
    if not base:
        raise RuntimeError(f"{URL_ENV} is not set: the pg_cluster fixture was not started")
    return f"{base}?options=-csearch_path%3D{schema_for_directory(directory)}"
