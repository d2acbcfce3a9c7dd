"""Admission without a warm launcher: the launcher claims for a fresh owner, the owner's launch
path imports almost nothing, and clone3(CLONE_INTO_CGROUP) starts the command inside its cgroup.

Each behaviour is checked on both ways a command starts: clone3 where the kernel has it, and
the fork-and-join fallback (SETTLED_SPAWN=fork), which a kernel before 5.7 would take.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import COMMAND_PYTHON, _skip_unavailable

from settled.boundary import availability, linux
from settled.boundary.cgroup2 import ROOT_DIR_NAME, find_hierarchy
from settled.boundary.isolation import KEPT_CAPS
from settled.errors import OwnerLaunchFailed
from settled.helper_process import json_text, python_command
from settled.identity import CommandSpec
from settled.owner import handoff
from settled.owner.launcher import owner_path
from settled.records import OwnerInfo, TaskRecord
from settled.runtime import Runtime

SPAWNS = ("clone3", "fork")
CGROUP_KINDS = ("cgroup2+pidns", "cgroup2")


@pytest.fixture(params=SPAWNS)
def spawn(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How owners start their commands: clone3 (skipped where the kernel lacks it, with why)
    or the fallback every kernel has. Owners read SETTLED_SPAWN from their environment."""
    if request.param == "fork":
        monkeypatch.setenv("SETTLED_SPAWN", "fork")
    else:
        monkeypatch.delenv("SETTLED_SPAWN", raising=False)
        missing = linux.clone3_missing()
        if missing is not None:
            pytest.skip(f"clone3 unavailable: {missing}")
    return str(request.param)


@pytest.fixture(params=("c", "ctypes"))
def calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which binding of boundary/linux.py owners use: the C module, which `pip install -e .`
    builds (a missing one fails here, never a silent skip), or the ctypes fallback."""
    if request.param == "ctypes":
        monkeypatch.setenv("SETTLED_LINUX_CALLS", "ctypes")
    else:
        monkeypatch.delenv("SETTLED_LINUX_CALLS", raising=False)
        assert linux.BINDING == "c", "the C binding is not built: run scripts/setup"
    return str(request.param)


@pytest.fixture(autouse=True)
def _no_cgroup_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test here ends with no cgroup of its tasks left: made ahead of need or not, each
    is removed by its owner, its lost launch, or recovery. (Its `rt` is set up first, so it is
    still open at this teardown.)"""
    uses_runtime = "rt" in request.fixturenames and availability()["cgroup2"] is None
    runtime: Runtime | None = request.getfixturevalue("rt") if uses_runtime else None
    yield
    if runtime is not None:
        hierarchy = find_hierarchy()
        tasks = [t.task for t in runtime.store.list_tasks()]
        left = [t for t in tasks if Path(hierarchy, ROOT_DIR_NAME, t).exists()]
        assert not left, f"cgroups left for tasks {left}"


def _session_cgroup(task: str, session: str) -> Path:
    return Path(find_hierarchy(), ROOT_DIR_NAME, task, session)


def _wait_until(predicate: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


PROBE = (
    "grep -E '^(CapBnd|NoNewPrivs):' /proc/self/status; "
    "test -e {home}/settled.db && echo home-visible || echo home-hidden; echo $$; exec sleep 30"
)


@pytest.mark.parametrize("kind", ["cgroup2+pidns", "cgroup2", "pidns", "subreaper"])
def test_a_command_runs_inside_its_boundary_and_isolation_whichever_way_it_started(
    rt: Runtime, task: TaskRecord, spawn: str, calls: str, kind: str
) -> None:
    _skip_unavailable(kind)
    admission = rt.exec(task.task, shell=PROBE.format(home=rt.home), boundary=kind, key="k")
    _wait_until(lambda: rt.read(admission.session, "stdout").count(b"\n") >= 4)
    record = rt.store.get_session(admission.session)
    assert record.command_pid is not None and record.boundary == kind
    if kind in CGROUP_KINDS:
        procs = (_session_cgroup(task.task, admission.session) / "cgroup.procs").read_text()
        assert str(record.command_pid) in procs.split(), "the command runs in its own cgroup"
    bounding, no_new_privs, home, pid = (
        rt.read(admission.session, "stdout").decode().split("\n")[:4]
    )
    assert int(bounding.split()[1], 16) == sum(1 << cap for cap in KEPT_CAPS)
    assert no_new_privs.split()[1] == "1" and home == "home-hidden"
    if kind in ("cgroup2+pidns", "pidns"):  # init is pid 1 of the namespace, the command 2
        assert pid == "2"
    rt.cancel(admission.session, "seen")
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert receipt["death"]["proven"] is True
    # the placer clones every kind's first process (limits' v1 cgroups), a subreaper's too
    assert receipt["owner"]["spawn"] == spawn
    assert receipt["owner"]["calls"] == calls
    if kind in CGROUP_KINDS:
        assert not _session_cgroup(task.task, admission.session).exists()


PLACEMENT_PROBE = """
import os, sys
from settled.boundary import spawn
cgroup = sys.argv[1]
pid, pidfd, placed = spawn.fork_into(cgroup, new_pid_namespace=False)
if pid == 0:
    with open("/proc/self/cgroup") as handle:  # the child's first act
        first = [line[3:].strip() for line in handle if line.startswith("0::")][0]
    os.write(1, f"{placed} {first}\\n".encode())
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_clone3_makes_the_child_inside_its_cgroup_where_a_fork_must_join_it(
    spawn: str, tmp_path: Path
) -> None:
    """The cgroup a child is in at its very first instruction: clone3's is its boundary's, so
    it never runs outside it; a plain fork's is its parent's, so it joins before anything."""
    _skip_unavailable("cgroup2")
    hierarchy = find_hierarchy()
    cgroup = Path(hierarchy, f"{ROOT_DIR_NAME}-test-placement-{os.getpid()}")
    cgroup.mkdir()
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(owner_path())}
        out = subprocess.run(
            [sys.executable, "-c", PLACEMENT_PROBE, str(cgroup)],
            env=env, capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split()  # fmt: skip
    finally:
        cgroup.rmdir()
    own = Path("/proc/self/cgroup").read_text().split("0::", 1)[1].split()[0]
    if spawn == "clone3":
        assert out == ["True", f"{own.rstrip('/')}/{cgroup.name}"]
    else:
        assert out == ["False", own]


LAUNCH_PATH_PROBE = """
import sys
sys.path += sys.argv[1:]
import settled.owner.main
before_pid = set(sys.modules)
import settled.owner.launch
from settled import boundary
for kind in ("cgroup2+pidns", "cgroup2", "pidns", "subreaper"):
    boundary.make(kind, "t_probe", "s_probe", None, "/nonexistent")
settled.owner.launch.Ahead().close()  # the pipes, libc and the clone3 probe
print(" ".join(sorted(before_pid)))
print(" ".join(sorted(sys.modules)))
"""
HEAVY = (
    "json", "typing", "dataclasses", "enum", "re", "signal", "sqlite3", "inspect", "threading",
    "fcntl", "settled.store", "settled.records", "settled.identity", "settled.home",
    "settled.errors", "settled.log.writer", "settled.owner.session", "settled.owner.supervise",
)  # fmt: skip


EMPTINESS_PROBE = """
import os, select, sys, time
sys.path += sys.argv[2:]
from settled import boundary
from settled.boundary.spawn import ChildIO, Launch
made = boundary.make(sys.argv[1], "t_empty_" + str(os.getpid()), "s_empty")
cgroup = getattr(made, "cgroup", None)  # cgroup2+pidns: its session's cgroup, made at claim
if cgroup is not None:
    cgroup.create()
made.setup()
null = os.open(os.devnull, os.O_RDWR)
env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
made.start(Launch(["/bin/sh", "-c", "sleep 30 & exit 3"], "/", env, ChildIO(null, null, null)))
fd = made.empty_fd()
readable = lambda seconds: bool(select.select([fd], [], [], seconds)[0])
print("watched" if fd is not None else "unwatched")
select.select([made.exit_fd()], [], [], 10)
print("main", os.waitstatus_to_exitcode(made.collect_main()))
if not made.is_empty():
    print("readable before its end" if readable(0) else "not readable before its end")
    made.kill_all()
print("readable after its end" if readable(10) else "never readable")
print("empty" if made.is_empty() else "not empty", made.empty_fd())
made.teardown()
if cgroup is not None and os.path.isdir(cgroup.task_path):  # its teardown may remove it
    os.rmdir(cgroup.task_path)
"""


@pytest.mark.parametrize("kind", ["pidns", "cgroup2+pidns"])
def test_a_pid_namespace_boundary_hands_its_owner_a_handle_that_wakes_when_it_empties(
    kind: str,
) -> None:
    """The owner sleeps on `empty_fd` once stopping instead of looking every 0.25-5 ms: the
    init's pidfd, not readable while a member (here a background `sleep`) keeps the namespace
    alive, readable once the kill ended it, and None once the init is reaped."""
    reason = availability()[kind]
    if reason is not None:
        pytest.skip(f"{kind} unavailable here: {reason}")
    out = subprocess.run(
        [sys.executable, "-I", "-c", EMPTINESS_PROBE, kind, *owner_path()],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert out[:2] == ["watched", "main 3"]
    assert out[2:] in (
        ["not readable before its end", "readable after its end", "empty None"],
        ["readable after its end", "empty None"],  # the init ended the namespace first
    )


def test_the_owners_launch_path_imports_only_what_starting_the_command_needs() -> None:
    """Everything an owner loads before its command runs (the entry, the boundaries, the
    clone3 probe): no json, typing, dataclasses, signal (enum), re, sqlite3, the store,
    records, identity or the log writer, which load while the command runs. Before it says
    its pid (the launcher's claim waits for it), not even the boundaries or ctypes."""
    before_pid, loaded = (
        set(line.split())
        for line in subprocess.run(
            [sys.executable, "-I", "-S", "-c", LAUNCH_PATH_PROBE, *owner_path()],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.splitlines()
    )  # fmt: skip
    assert "settled.boundary.combined" in loaded
    for heavy in HEAVY:
        assert heavy not in loaded, f"{heavy} is imported on the owner's launch path"
    for later in ("settled.boundary", "ctypes", "settled.owner.launch"):
        assert later not in before_pid, f"{later} is imported before the owner says its pid"
    assert "ctypes" not in loaded, "with the C binding built, the launch path needs no ctypes"


def _admit(rt: Runtime, task: TaskRecord, key: str, shell: str, boundary: str) -> str:
    spec = CommandSpec(shell=shell, boundary=boundary)
    record, _ = rt.store.admit(task.task, key, spec.digest, spec.to_json())
    return record.session


def test_a_lost_claim_runs_nothing_and_removes_the_cgroup_made_for_it(
    rt: Runtime, task: TaskRecord, spawn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_unavailable("cgroup2")
    made: list[Path] = []
    claim_for = handoff.claim_for

    def rival_first(
        store: object, prepared: handoff.Prepared, owner_pid: int, start: int | None = None
    ) -> object:
        """Another owner's claim lands between this launcher's prepare and its own claim."""
        made.append(_session_cgroup(prepared.record.task, prepared.record.session))
        assert made[0].is_dir(), "the cgroup is made ahead of the claim"
        rival = OwnerInfo(owner_pid, 1, "another-boot", time.time() + 60)
        rt.store.claim(prepared.record.session, prepared.record.generation, rival)
        return claim_for(rt.store, prepared, owner_pid, start)

    monkeypatch.setattr(handoff, "claim_for", rival_first)
    with pytest.raises(OwnerLaunchFailed, match="claim lost"):
        rt.exec(task.task, shell="touch ran", boundary="cgroup2", key="lost")
    assert not made[0].exists(), "a lost claim leaves no cgroup"
    time.sleep(0.2)  # an owner with no orders exits at once; give a wrong one time to run
    assert not Path(task.workspace, "ran").exists(), "an owner without orders runs nothing"
    monkeypatch.setattr(handoff, "claim_for", claim_for)
    [result] = rt.recover(task.task)  # the rival (another boot) is gone: never started
    assert result["state"] == "settled"


def test_a_cgroup_made_for_a_claim_that_never_came_is_removed_by_recovery(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher that died between making the cgroup and claiming leaves it empty; recovery
    settles the session as never started and removes it (never as its evidence)."""
    _skip_unavailable("cgroup2")
    session = _admit(rt, task, "orphan", "touch ran", "cgroup2")
    prepared = handoff.prepare(rt.store, rt.home, session, time.time())
    cgroup = _session_cgroup(task.task, session)
    assert cgroup.is_dir()
    monkeypatch.setattr("settled.owner.launcher.READY_TIMEOUT_S", -1.0)  # as if it waited long
    [result] = rt.recover(task.task)
    assert result["state"] == "settled"
    receipt = rt.store.get_session(session).receipt
    assert receipt is not None and receipt["exit"]["reason"] == "not_started"
    assert not cgroup.exists()
    assert prepared.boundary is not None


def test_an_owner_that_gets_no_orders_runs_nothing_and_exits(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    """The orders come only after a claim: an owner whose launcher closed the pipe without
    them (its claim lost, or the launcher died) exits having run nothing."""
    session = _admit(rt, task, "silent", "touch ran", "auto")
    orders_r, orders_w = os.pipe()
    ready_r, ready_w = os.pipe()
    os.set_inheritable(orders_r, True)
    os.set_inheritable(ready_w, True)
    argv = python_command(
        "settled.owner.main:main", ("settled", "blake3"), session, str(ready_w), str(orders_r)
    )
    env = {**os.environ, "SETTLED_OWNER_HOME": rt.home}
    owner = subprocess.Popen(argv, env=env, pass_fds=(orders_r, ready_w))
    os.close(orders_r)
    os.close(ready_w)
    try:
        hello = json.loads(os.read(ready_r, 4096).split(b"\n")[0])
        assert hello["owner_pid"] == owner.pid
        os.close(orders_w)  # no claim, no orders
        assert owner.wait(timeout=30) == 0
    finally:
        os.close(ready_r)
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert not Path(task.workspace, "ran").exists()
    assert rt.store.get_session(session).owner is None


def test_a_cancel_before_the_command_starts_removes_its_cgroup(
    rt: Runtime, task: TaskRecord, spawn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_unavailable("cgroup2")
    claim_for = handoff.claim_for

    def cancelled_first(
        store: object, prepared: handoff.Prepared, owner_pid: int, start: int | None = None
    ) -> object:
        rt.store.request_cancel(prepared.record.session, "changed my mind")
        return claim_for(rt.store, prepared, owner_pid, start)

    monkeypatch.setattr(handoff, "claim_for", cancelled_first)
    admission = rt.exec(task.task, shell="touch ran", boundary="cgroup2", key="c")
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert receipt["exit"]["reason"] == "cancelled"
    assert not _session_cgroup(task.task, admission.session).exists()
    assert not Path(task.workspace, "ran").exists()


def test_json_text_writes_what_json_dumps_writes() -> None:
    rng = random.Random(7)
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "€", "😀", "a", " ", "/"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        value = {
            text: [text, rng.randint(-(1 << 40), 1 << 40), None, True, False],
            "f": rng.random() * 10 ** rng.randint(-5, 20),
            "nested": {"cgroup": f"/sys/fs/cgroup/{text}", "init": None},
        }
        assert json_text(value) == json.dumps(value)
    with pytest.raises(TypeError):
        json_text({"x": object()})


def test_a_signal_sent_before_a_fresh_owners_handlers_exist_becomes_a_cancel(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh owner is claimed for while its interpreter starts, before its handlers exist:
    it starts with TERM (and INT, HUP, USR1) blocked, so a TERM sent then waits for them and
    is a cancel, not the owner's death."""
    claim_for = handoff.claim_for

    def then_term(
        store: object, prepared: handoff.Prepared, owner_pid: int, start: int | None = None
    ) -> object:
        claimed = claim_for(rt.store, prepared, owner_pid, start)
        os.kill(owner_pid, signal.SIGTERM)  # its interpreter is still starting
        return claimed

    monkeypatch.setattr(handoff, "claim_for", then_term)
    admission = rt.exec(task.task, shell="touch ran", key="t")
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert receipt["exit"]["reason"] == "cancelled"
    assert "SIGTERM" in json.dumps(receipt["exit"])
    assert not Path(task.workspace, "ran").exists()


def test_the_reaper_thread_takes_no_signal_meant_for_the_callers_threads(
    rt: Runtime, task: TaskRecord
) -> None:
    """A fresh owner is the caller's child, reaped by a thread of the caller's: that thread
    blocks every signal, so one sent to the process (a Ctrl-C of `settled run`, whose relay
    holds SIGINT around each chunk it prints and counts) reaches the caller's own threads."""
    admission = rt.exec(task.task, shell="true", key="reaped")
    rt.wait(admission.session, timeout=30)
    [reaper] = [t for t in threading.enumerate() if t.name == "settled-reaper"]
    status = Path(f"/proc/self/task/{reaper.native_id}/status").read_text()
    blocked = int(
        next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1):
        assert blocked >> (sig - 1) & 1, f"the reaper thread does not block {sig.name}"


ALTERNATING = (
    "import sys, time\n"
    "for i in range(30):\n"
    "    s = sys.stdout if i % 2 == 0 else sys.stderr\n"
    "    s.buffer.write(b'%d|' % i); s.flush(); time.sleep(0.01)\n"
)


def test_the_order_of_the_two_streams_is_kept_while_the_owner_loads(
    rt: Runtime, task: TaskRecord
) -> None:
    """A fresh owner loads its drain while its command already writes (about 40 ms here):
    its first drain reads both pipes in order meanwhile, so a command alternating between them
    every 10 ms from its start comes back alternating, not as one batch per stream."""
    admission = rt.exec(task.task, argv=[COMMAND_PYTHON, "-c", ALTERNATING], key="alt")
    rt.wait(admission.session, timeout=30)
    chunks = rt.read_merged(admission.session)
    assert b"".join(c.data for c in chunks) == b"".join(b"%d|" % i for i in range(30))
    assert all(c.ordered for c in chunks)


def test_the_logs_exist_once_exec_returns(rt: Runtime, task: TaskRecord) -> None:
    """Created before the command runs (a full disk refuses the command, not its output),
    so a reader right after exec finds them, though the owner loads its writers later."""
    admission = rt.exec(task.task, shell="sleep 0.5; echo late", key="early")
    directory = Path(rt.home, "sessions", admission.session)
    assert (directory / "stdout.log").exists() and (directory / "stderr.log").exists()
    assert rt.read(admission.session, "stdout") == b""
    rt.wait(admission.session, timeout=30)
    assert rt.read(admission.session, "stdout") == b"late\n"


def _first_drain(
    tmp_path: Path, cap: int | None
) -> tuple[Any, dict[str, int], dict[str, int], dict[str, int]]:
    from settled.owner.early import EarlyDrain

    pipes, logs, ends = {}, {}, {}
    for name in ("stdout", "stderr"):
        pipes[name], ends[name] = os.pipe()
        logs[name] = os.open(
            tmp_path / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
    return EarlyDrain(pipes, logs, cap), pipes, logs, ends


def _until(check: Callable[[], bool], what: str) -> None:
    give_up = time.monotonic() + 10
    while not check():
        assert time.monotonic() < give_up, what
        time.sleep(0.005)


def _hand_over(early: Any, pipes: dict[str, int], logs: dict[str, int], tmp_path: Path,
               cap: int | None) -> dict[str, Any]:  # fmt: skip
    from settled.log.writer import StreamWriter
    from settled.owner.supervise import Streams

    writers = {
        name: StreamWriter(str(tmp_path / f"{name}.log"), cap=cap, fd=logs[name])
        for name in ("stdout", "stderr")
    }
    early.hand_to(Streams(dict(pipes), writers, index=None))
    return {name: writer.close() for name, writer in writers.items()}


def test_the_first_drain_writes_the_first_bytes_to_the_log_and_the_writer_adopts_them(
    tmp_path: Path,
) -> None:
    """An owner killed while it loads must leave what its command first wrote where recovery
    reads a lost owner's logs: the first drain writes each stream's first bytes (within the
    cap) to its log at once. The writer then counts them and digests them from the bytes read,
    and the log only ever grows, as its readers expect."""
    from blake3 import blake3

    early, pipes, logs, ends = _first_drain(tmp_path, cap=6)
    os.write(ends["stdout"], b"before the writers exist\n")
    os.write(ends["stderr"], b"and on stderr\n")
    _until(lambda: (tmp_path / "stderr.log").read_bytes() == b"and on", "nothing was written")
    _until(lambda: (tmp_path / "stdout.log").read_bytes() == b"before", "nothing was written")
    _until(lambda: len(early.reads) == 2, "not all read")
    summaries = _hand_over(early, pipes, logs, tmp_path, cap=6)
    assert (tmp_path / "stdout.log").read_bytes() == b"before"  # never past the cap
    assert summaries["stdout"].cursor == 6
    assert summaries["stdout"].not_stored == len(b"before the writers exist\n") - 6
    assert summaries["stdout"].digest == "blake3:" + blake3(b"before").hexdigest()
    assert summaries["stderr"].digest == "blake3:" + blake3(b"and on").hexdigest()
    for fd in (*pipes.values(), *ends.values()):
        os.close(fd)


def test_past_its_first_bytes_a_stream_is_stored_by_its_writer_whole_and_in_order(
    tmp_path: Path,
) -> None:
    from blake3 import blake3

    from settled.owner.early import COPY_LIMIT

    early, pipes, logs, ends = _first_drain(tmp_path, cap=None)
    data = os.urandom(COPY_LIMIT + 40_000)
    os.write(ends["stdout"], data)
    _until(lambda: (tmp_path / "stdout.log").stat().st_size == COPY_LIMIT, "no first bytes")
    _until(lambda: sum(len(d) for _, d in early.reads) == len(data), "not all read")
    summaries = _hand_over(early, pipes, logs, tmp_path, cap=None)
    assert (tmp_path / "stdout.log").read_bytes() == data
    assert summaries["stdout"].cursor == len(data)
    assert summaries["stdout"].digest == "blake3:" + blake3(data).hexdigest()
    for fd in (*pipes.values(), *ends.values()):
        os.close(fd)
