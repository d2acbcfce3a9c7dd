"""Resource walls: memory, pids and cpu limits enforced by each session's cgroups, the kernel's
evidence in the receipt, settled's own processes kept out of the OOM killer's way, and owners
that start no thread or process once their command runs.

Real processes and cgroups, as root. On this kind of hybrid host the controllers are v1 (the
unified tree offers only hugetlb): the v2 path is tested where the unified hierarchy offers a
controller, and skipped here with the reason. Everything a test makes, it removes
(`_no_limit_cgroup_left` checks the limits' cgroups).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import proc_files

from settled.boundary import limits
from settled.boundary.walls import Walls
from settled.errors import BadInput
from settled.identity import CommandSpec
from settled.owner import handoff
from settled.records import TaskRecord
from settled.runtime import Runtime

MIB = 1 << 20
V1_ONLY = {c: w for c, w in limits.controllers().items() if w["version"] == "v1"}


def _v1_or_skip() -> None:
    missing = [c for c in limits.CONTROLLERS if c not in V1_ONLY]
    if missing:
        pytest.skip(f"no v1 controller for {missing}: {limits.controllers()}")


def _placer_or_skip() -> None:
    """The placer starts every command where clone3 is there; the fork path has none. Asked
    of the environment the owners will get and of the kernel (spawn caches its answer for
    this process's life)."""
    from settled.boundary import linux

    missing = "SETTLED_SPAWN=fork" if os.environ.get("SETTLED_SPAWN") == "fork" else None
    missing = missing or linux.clone3_missing()
    if missing is not None:
        pytest.skip(f"no placer on the fork path: {missing}")


@pytest.fixture(params=("clone3", "fork"))
def spawn(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How owners start their commands: through the placer (clone3), or on the fork path,
    where the forked child joins the v1 cgroups itself (SETTLED_SPAWN=fork, as a kernel
    without clone3 would take)."""
    if request.param == "fork":
        monkeypatch.setenv("SETTLED_SPAWN", "fork")
    else:
        monkeypatch.delenv("SETTLED_SPAWN", raising=False)
        _placer_or_skip()
    return str(request.param)


def _settled_roots() -> list[Path]:
    return [Path(str(w["root"])) for w in limits.controllers().values() if w["root"]]


def _owner_dirs() -> set[Path]:
    return {p for root in _settled_roots() if root.is_dir() for p in root.iterdir() if p.is_dir()}


@pytest.fixture(autouse=True)
def _no_limit_cgroup_left() -> Iterator[None]:
    """Every owner cgroup a test's sessions made is gone at its end (the spare's of a warm
    launcher included, once the launcher closed)."""
    before = _owner_dirs()
    yield
    deadline = time.monotonic() + 10
    while (_owner_dirs() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (_owner_dirs() - before), f"cgroups left: {_owner_dirs() - before}"


def _wait_until(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _threads(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return None


# -- pure: the defaults and a session's limits ----------------------------------------------


def test_the_host_defaults_keep_room_for_the_host_and_split_it_between_sessions() -> None:
    facts = {"mem_total": 24 << 30, "mem_limit": 24 << 30, "pid_max": 32768,
             "threads_max": 192735, "cpus": 2}  # fmt: skip
    made = limits.host_defaults(facts)
    assert made["ceiling"] == {"memory": 18 << 30, "pids": 16384, "cpus": None}
    assert made["session"] == {"memory": 9 << 30, "pids": 4096, "cpus": None}
    tight = limits.host_defaults({**facts, "mem_limit": 2 << 30, "pid_max": 4096})
    assert tight["ceiling"]["memory"] == 3 << 29  # the owner's own cgroup's limit bounds it
    assert tight["session"]["pids"] == 512  # a quarter of the ceiling, under 4096


def test_a_limit_comes_from_the_exec_else_the_task_else_the_host() -> None:
    host = {"memory": 100, "pids": 10, "cpus": None}
    chosen = limits.effective({"memory": 5, "pids": None}, host, {"pids": 7, "cpus": 0.5})
    assert chosen == {
        "memory": {"value": 5, "source": "explicit"},
        "pids": {"value": 7, "source": "task"},
        "cpus": {"value": 0.5, "source": "task"},
    }
    assert limits.effective({}, host)["cpus"] == {"value": None, "source": "host"}


def test_an_explicit_limit_the_host_cannot_enforce_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, rt: Runtime, task: TaskRecord
) -> None:
    assert limits.refusal({"pids": 1}) == "pids must be a number of at least 2, got 1"
    assert "memory must be" in str(limits.refusal({"memory": "1g"}))
    missing = {**limits.controllers(), "memory": {"version": None, "root": None,
                                                  "why": "no memory controller here"}}  # fmt: skip
    monkeypatch.setattr(limits, "controllers", lambda: missing)
    with pytest.raises(BadInput) as refused:
        rt.exec(task.task, shell="true", key="k", memory=64 * MIB)
    assert (
        str(refused.value) == "--memory cannot be enforced on this host: no memory controller here"
    )
    assert rt.store.find_session(task.task, "k") is None  # nothing admitted, nothing launched


def test_a_default_that_cannot_apply_is_named_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = {**limits.controllers(), "cpu": {"version": None, "root": None,
                                               "why": "no cpu controller here"}}  # fmt: skip
    monkeypatch.setattr(limits, "controllers", lambda: missing)
    chosen = limits.effective({}, {"memory": 1 << 30, "pids": 64, "cpus": None})
    facts = Walls(chosen, {}, None, {"memory": 2 << 30, "pids": 128, "cpus": None}).facts(0)
    assert facts["cpus"] == {"limit": None, "source": "host", "controller": None,
                             "missing": "no cpu controller here"}  # fmt: skip
    assert facts["oom"]["command"] == 1000
    assert facts["oom"]["owner"]["protected"] is False and facts["oom"]["owner"]["why"]


# -- the walls, enforced --------------------------------------------------------------------


def test_the_host_defaults_are_applied_to_the_sessions_cgroups_and_named(
    rt: Runtime, task: TaskRecord, spawn: str
) -> None:
    _v1_or_skip()
    admission = rt.exec(task.task, shell="cat /proc/self/oom_score_adj; exec sleep 30", key="d")
    _wait_until(lambda: rt.read(admission.session, "stdout"))
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    session = limits.defaults()["session"]
    by_controller = dict(zip(limits.CONTROLLERS, limits.owner_paths(owner.pid, owner.start_time),
                             strict=True))  # fmt: skip
    memory, pids, cpu = (Path(by_controller[c]) for c in limits.CONTROLLERS)
    assert int((memory / "memory.limit_in_bytes").read_text()) == session["memory"] // 4096 * 4096
    assert int((pids / "pids.max").read_text()) == session["pids"]
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "-1"  # no quota by default
    assert str(owner.pid) not in (pids / "cgroup.procs").read_text().split()
    rt.cancel(admission.session, "seen")
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert rt.read(admission.session, "stdout") == b"1000\n"  # the OOM killer's first choice
    resources = receipt["resources"]
    assert resources["memory"]["limit"] == session["memory"]
    assert resources["pids"]["limit"] == session["pids"]
    assert resources["cpus"]["limit"] is None
    for name in limits.LIMITS:
        assert resources[name]["source"] == "host" and resources[name]["controller"] == "v1"
        assert resources[name]["cgroup"] == by_controller[limits.CONTROLLER_OF[name]]
    assert resources["pids"]["peak"] >= 2 and resources["pids"]["refused"] == 0
    assert resources["ceiling"] == limits.defaults()["ceiling"]
    assert resources["oom"]["command"] == 1000
    assert receipt["owner"]["spawn"] == spawn
    assert not any(Path(p).exists() for p in by_controller.values()), "removed with the session"


def test_a_tasks_default_limit_applies_to_its_commands_and_an_execs_own_replaces_it(
    rt: Runtime, tmp_path: Path
) -> None:
    _v1_or_skip()
    (tmp_path / "ws").mkdir()
    task = rt.new_task(str(tmp_path / "ws"), pids=100, cpus=1.5)
    plain = rt.wait(rt.exec(task.task, shell="true", key="a").session, timeout=30)["receipt"]
    own = rt.exec(task.task, shell="true", key="b", pids=50)
    mine = rt.wait(own.session, timeout=30)["receipt"]
    assert (plain["resources"]["pids"]["limit"], plain["resources"]["pids"]["source"]) == (
        100,
        "task",
    )
    assert (plain["resources"]["cpus"]["limit"], plain["resources"]["cpus"]["source"]) == (
        1.5,
        "task",
    )
    assert plain["resources"]["memory"]["source"] == "host"
    assert (mine["resources"]["pids"]["limit"], mine["resources"]["pids"]["source"]) == (
        50,
        "explicit",
    )
    assert mine["resources"]["cpus"]["source"] == "task"
    spec = CommandSpec.from_json(rt.store.get_session(own.session).spec)
    assert handoff.asked_limits(spec, rt.store.get_task(task.task))[0] == {"pids": 50}


def test_a_hog_under_a_memory_limit_is_killed_and_named_while_another_task_lives_on(
    rt: Runtime, task: TaskRecord, tmp_path: Path, spawn: str
) -> None:
    _v1_or_skip()
    other_ws = tmp_path / "other"
    other_ws.mkdir()
    other = rt.new_task(str(other_ws))
    bystander = rt.exec(other.task, shell="sleep 2; echo alive", key="b")
    hog = rt.exec(task.task, argv=["tail", "/dev/zero"], key="h", memory=64 * MIB)  # one line
    receipt = rt.wait(hog.session, timeout=60)["receipt"]
    assert receipt["death"]["proven"] is True and receipt["death"]["source"] == "owner"
    assert receipt["exit"]["reason"] == "oom" and receipt["exit"]["signal"] == "KILL"
    memory = receipt["resources"]["memory"]
    assert memory["limit"] == 64 * MIB and memory["source"] == "explicit"
    assert memory["oom_kill"] >= 1 and receipt["exit"]["oom_kill"] == memory["oom_kill"]
    assert memory["peak"] <= 64 * MIB and memory["hit_limit"] > 0
    owner = rt.store.get_session(bystander.session).owner
    assert owner is not None and _alive(owner.pid), "the other task's owner lives on"
    other_receipt = rt.wait(bystander.session, timeout=30)["receipt"]
    assert other_receipt["exit"]["code"] == 0 and other_receipt["exit"]["reason"] == "exited"
    assert other_receipt["death"]["source"] == "owner"
    assert other_receipt["resources"]["memory"]["oom_kill"] == 0
    assert rt.read(bystander.session, "stdout") == b"alive\n"


def _confine(pid: int, name: str) -> Path:
    """Move the process `pid` (all its threads) into a v1 pids cgroup of its own whose pids.max
    is its thread count now: any thread or process it starts from now on is refused, and
    counted in pids.events."""
    cgroup = Path(str(V1_ONLY["pids"]["root"])).parent / name
    cgroup.mkdir()
    threads = _threads(pid)
    assert threads is not None
    (cgroup / "pids.max").write_text(str(threads))
    (cgroup / "cgroup.procs").write_text(str(pid))
    return cgroup


def _release(cgroup: Path, pid: int) -> None:
    _wait_until(lambda: not _alive(pid), 30)
    _wait_until(lambda: not (cgroup / "cgroup.procs").read_text().split(), 30)
    cgroup.rmdir()


def test_an_owner_starts_no_thread_or_process_after_its_command_started(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From its command's start to its receipt the owner needs no new task: confined to a pids
    cgroup at its thread count, it still drains 20 MiB (the flusher's fsyncs), renews its lease
    every 0.3 s, and writes its receipt; the kernel counted no refused fork or thread."""
    _v1_or_skip()
    monkeypatch.setenv("SETTLED_LEASE_S", "1.5")
    admission = rt.exec(
        task.task, shell="echo started; sleep 1; head -c 20000000 /dev/zero; sleep 1", key="t"
    )
    _wait_until(lambda: rt.read(admission.session, "stdout").startswith(b"started"))
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    confined = _confine(owner.pid, f"settled-test-owner-{owner.pid}")
    try:
        most = _threads(owner.pid)
        assert most is not None
        while rt.store.get_session(admission.session).receipt is None:
            now = _threads(owner.pid)
            assert now is None or now <= most, f"the owner went from {most} to {now} threads"
            time.sleep(0.005)
        events = (confined / "pids.events").read_text().split()
        assert events == ["max", "0"], "the owner tried to start a thread or a process"
    finally:
        _release(confined, owner.pid)
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert receipt["exit"]["code"] == 0 and receipt["death"]["proven"] is True
    assert receipt["output"]["stdout"]["cursor"] == len("started\n") + 20_000_000
    assert receipt["output"]["drain"] == "complete"


STORM = "f() { f | f & }; f; exec sleep 600"  # each forks two until refused; the main execs


def test_a_fork_storm_under_a_pids_limit_ends_at_its_deadline_with_a_true_receipt(
    rt: Runtime, task: TaskRecord, spawn: str
) -> None:
    """The storm exhausts its session's pids.max; its owner, confined to no spare task at all,
    still stops it at the deadline, proves it dead and writes its receipt."""
    _v1_or_skip()
    admission = rt.exec(task.task, shell=STORM, key="s", timeout=2.0, grace=0.5, pids=64)
    _wait_until(lambda: rt.store.get_session(admission.session).command_pid is not None)
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    confined = _confine(owner.pid, f"settled-test-owner-{owner.pid}")
    try:
        receipt = rt.wait(admission.session, timeout=60)["receipt"]
        assert (confined / "pids.events").read_text().split() == ["max", "0"]
    finally:
        _release(confined, owner.pid)
    assert receipt["exit"]["reason"] == "timeout"
    assert receipt["death"]["proven"] is True and receipt["death"]["source"] == "owner"
    pids = receipt["resources"]["pids"]
    assert pids["limit"] == 64 and pids["source"] == "explicit"
    assert pids["refused"] > 0, "the storm met its wall"
    assert pids["peak"] == 64
    assert 2.0 <= receipt["exit"]["elapsed_s"] < 10.0


def test_a_cpu_limit_throttles_the_command(rt: Runtime, task: TaskRecord) -> None:
    _v1_or_skip()
    admission = rt.exec(
        task.task, shell="while :; do :; done", key="c", timeout=1.0, grace=0, cpus=0.1
    )
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert receipt["exit"]["reason"] == "timeout"
    cpus = receipt["resources"]["cpus"]
    assert cpus["limit"] == 0.1 and cpus["source"] == "explicit"
    assert cpus["nr_throttled"] > 0 and cpus["throttled_s"] > 0


@pytest.mark.parametrize(
    ("fault", "why"),
    [("placer.after_join:crash", "the placer"), ("placer.limits_write:eio", "writing")],
)
def test_a_placement_that_fails_never_starts_its_command_and_leaves_nothing(
    rt: Runtime,
    task: TaskRecord,
    marker: str,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    why: str,
) -> None:
    """The placer dies after joining the session's cgroups, or the kernel refuses its limits:
    the session never starts, and no cgroup or process of it is left."""
    _v1_or_skip()
    _placer_or_skip()
    monkeypatch.setenv("SETTLED_FAULT", fault)  # the fresh owner's, and so its placer's
    admission = rt.exec(task.task, shell="echo never", key="p")
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert receipt["exit"]["reason"] == "not_started" and receipt["exit"]["stage"] == "limits"
    assert why in receipt["exit"]["error"]
    assert rt.read(admission.session, "stdout") == b""
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    _wait_until(lambda: not _alive(owner.pid))
    assert not any(Path(p).exists() for p in limits.owner_paths(owner.pid, owner.start_time))
    left = [
        pid
        for pid, (comm, environ) in proc_files("comm", "environ")
        if marker.encode() in environ and comm.strip() in (b"settled-placer", b"settled-init")
    ]
    assert left == [], "no placer or init is left"  # fmt: skip


def test_recovery_removes_the_v1_cgroups_of_a_session_whose_owner_was_killed(
    rt: Runtime, task: TaskRecord
) -> None:
    _v1_or_skip()
    admission = rt.exec(task.task, shell="echo up; exec sleep 300", key="r")
    _wait_until(lambda: rt.read(admission.session, "stdout") == b"up\n")
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    paths = limits.owner_paths(owner.pid, owner.start_time)
    assert paths and all(Path(p).is_dir() for p in paths)
    os.kill(owner.pid, signal.SIGKILL)
    _wait_until(lambda: not _alive(owner.pid))
    [result] = rt.recover(task.task)
    assert result["state"] == "settled", result
    assert not any(Path(p).exists() for p in paths), "recovery removed the limits' cgroups"


def test_the_cgroups_of_a_spare_that_was_killed_are_swept(tmp_path: Path) -> None:
    """A warm launcher's spare forks its placer (which joins its cgroups) before any request:
    killed, it leaves empty cgroups named for a dead owner, which recovery's sweep removes."""
    _v1_or_skip()
    _placer_or_skip()
    (tmp_path / "ws").mkdir()
    before = _owner_dirs()
    with Runtime(str(tmp_path / "home"), launcher="warm") as warm:
        task = warm.new_task(str(tmp_path / "ws"))
        warm.wait(warm.exec(task.task, shell="true").session, timeout=30)
        _wait_until(lambda: _owner_dirs() - before)  # the spare's, made by its placer
        dirs = _owner_dirs() - before
        pids = {int(p.name.split("-")[1]) for p in dirs}
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: not any(_alive(pid) for pid in pids))
        _wait_until(lambda: all(not (p / "cgroup.procs").read_text().split() for p in dirs))
        warm.recover()
        assert not any(p.exists() for p in dirs), "swept"


def test_the_v2_controllers_hold_the_limits_where_the_unified_hierarchy_offers_them(
    rt: Runtime, task: TaskRecord
) -> None:
    v2 = [c for c, w in limits.controllers().items() if w["version"] == "v2"]
    if not v2:
        pytest.skip(
            "the cgroup v2 hierarchy offers none of memory, pids, cpu to settled here: "
            + "; ".join(f"{w.get('v2_why') or w['why']}" for w in limits.controllers().values())
        )
    admission = rt.exec(task.task, shell="echo up; exec sleep 30", key="v2")
    _wait_until(lambda: rt.read(admission.session, "stdout") == b"up\n")
    record = rt.store.get_session(admission.session)
    from settled.boundary.inspect import cgroup_path_of

    path = Path(str(cgroup_path_of(task.task, admission.session)))
    session = limits.defaults()["session"]
    if "memory" in v2:
        assert int((path / "memory.max").read_text()) == session["memory"] // 4096 * 4096
    if "pids" in v2:
        assert int((path / "pids.max").read_text()) == session["pids"]
    rt.cancel(admission.session, "seen")
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    for name in limits.LIMITS:
        if limits.CONTROLLER_OF[name] in v2:
            assert receipt["resources"][name]["controller"] == "v2"
            assert receipt["resources"][name]["cgroup"] == str(path)
    assert record.boundary in ("cgroup2+pidns", "cgroup2")


@pytest.mark.parametrize("kind", ["cgroup2+pidns", "cgroup2", "pidns", "subreaper", "pgroup"])
def test_the_placement_sent_from_the_orders_is_the_boundarys_own(kind: str) -> None:
    """An owner sends its placer the launch from its orders alone, before it makes the
    boundary (boundary.placement): what the placer clones and where must be what the
    boundary's own object says."""
    from settled import boundary as boundaries

    hierarchy = boundaries.find_hierarchy() if "cgroup2" in kind else None
    made = boundaries.make(kind, "t_0123456789abcdef", "s_0123456789abcdef", None, hierarchy)
    child, cgroup = boundaries.placement(
        kind, "t_0123456789abcdef", "s_0123456789abcdef", hierarchy
    )
    assert (child, cgroup) == (made.placed_child(), made.birth_cgroup())
