"""Owner launchers: a fresh interpreter per session, or a warm zygote owned by one Runtime."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from settled.errors import BadInput
from settled.owner.zygote import WarmLauncher
from settled.runtime import Runtime


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or between open and read
        return False


def _within(check: Callable[[], bool], seconds: float) -> bool:
    """Whether `check()` holds within `seconds`, looked at every 20 ms."""
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        if check():
            return True
        time.sleep(0.02)
    return False


def _gone_within(pid: int, seconds: float) -> bool:
    return _within(lambda: not _alive(pid), seconds)


@pytest.fixture
def warm(tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    monkeypatch.setenv("TEST_SESSION_MARKER", marker)
    (tmp_path / "ws").mkdir()
    return Runtime(str(tmp_path / "home"), launcher="warm")


def test_a_warm_launched_command_gets_the_callers_inherited_variable_and_umask(
    warm: Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        task = warm.new_task(str(tmp_path / "ws"))
        first = warm.exec(task.task, shell="echo $PROBE_VALUE")  # starts the zygote
        warm.wait(first.session, timeout=30)
        monkeypatch.setenv("PROBE_VALUE", "changed-after-the-zygote-started")
        old = os.umask(0o077)
        try:
            second = warm.exec(
                task.task, shell="echo $PROBE_VALUE; umask; touch made", inherit=["PROBE_VALUE"]
            )
        finally:
            os.umask(old)
        warm.wait(second.session, timeout=30)
        out = warm.read(second.session, "stdout").decode().split()
        assert out == ["changed-after-the-zygote-started", "0077"]
        assert (tmp_path / "ws" / "made").stat().st_mode & 0o777 == 0o600
    finally:
        warm.close()


def test_the_zygote_ends_with_its_runtime_and_owners_outlive_it(
    warm: Runtime, tmp_path: Path
) -> None:
    task = warm.new_task(str(tmp_path / "ws"))
    admission = warm.exec(task.task, shell="sleep 1; echo outlived")
    launcher = warm._launcher
    assert isinstance(launcher, WarmLauncher) and launcher._process is not None
    zygote = launcher._process.pid
    owner = warm.store.get_session(admission.session).owner
    assert owner is not None and owner.pid != zygote
    warm.close()
    assert not _alive(zygote), "closing the Runtime must end its zygote"
    with Runtime(str(tmp_path / "home")) as reader:
        view = reader.wait(admission.session, timeout=30)
        assert view["receipt"]["exit"]["code"] == 0
        assert reader.read(admission.session, "stdout") == b"outlived\n"


def test_an_unknown_launcher_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="'lukewarm'"):
        Runtime(str(tmp_path / "home"), launcher="lukewarm")


def test_warm_and_fresh_launchers_give_the_same_receipt_shape(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    shapes = []
    for mode in ("fresh", "warm"):
        with Runtime(str(tmp_path / "home"), launcher=mode) as rt:
            task = rt.new_task(str(tmp_path / "ws"), key="shared")
            admission = rt.exec(task.task, shell="exit 3", key=mode)
            receipt = rt.wait(admission.session, timeout=30)["receipt"]
            assert receipt["exit"]["code"] == 3 and receipt["death"]["proven"]
            shapes.append(sorted(receipt))
    assert shapes[0] == shapes[1]


@pytest.fixture
def many_descriptors() -> Iterator[int]:
    """More than FD_SETSIZE (1,024) descriptors open in this process, as in a busy server, so
    that every pipe a launcher makes next is numbered past what select() accepts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1_200
    if hard != resource.RLIM_INFINITY and hard < wanted + 64:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {wanted + 64}")
    if soft != resource.RLIM_INFINITY and soft < wanted + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted + 64, hard))
    held = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in range(wanted)]
    try:
        yield max(held)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("launcher", ["fresh", "warm"])
def test_a_launcher_with_more_than_1024_descriptors_open_still_launches(
    tmp_path: Path, launcher: str, many_descriptors: int
) -> None:
    assert many_descriptors > 1024
    (tmp_path / "ws").mkdir()
    with Runtime(str(tmp_path / "home"), launcher=launcher) as rt:
        task = rt.new_task(str(tmp_path / "ws"))  # starts the task's journal: its report too
        admission = rt.exec(task.task, shell="echo many", key="k")
        view = rt.wait(admission.session, timeout=30)
        assert view["receipt"]["exit"]["code"] == 0
        assert rt.read(admission.session, "stdout") == b"many\n"
        assert rt.close_task(task.task).complete


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _comm(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/comm", "rb") as handle:
            return handle.read().strip()
    except OSError:
        return b""


def _forks_of(zygote: int, line: bytes | None = None) -> list[int]:
    """Live processes that are copies of the zygote (its command line, `line` once it is
    gone), but not it, nor a spare's placer (boundary/placer.py, named settled-placer), nor a
    command's namespace init, a clone of one (settled-init)."""
    line = line or _cmdline(zygote)
    assert line, f"no command line for zygote {zygote}: pass the one read while it ran"
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and int(entry) != zygote and _cmdline(int(entry)) == line
        and _alive(int(entry)) and _comm(int(entry)) not in (b"settled-placer", b"settled-init")
    ]  # fmt: skip


def _spare_of(launcher: WarmLauncher, *used: int) -> int:
    """The zygote's one child once it has one (its spare is forked a moment after the request
    it follows, forking.Refill), seen in one look. `used` are owners the zygote forked for
    sessions already run: they share its command line and may still be leaving, so they are
    not counted."""
    assert launcher._process is not None
    zygote = launcher._process.pid
    seen: list[list[int]] = []

    def one_spare() -> bool:
        seen.append([pid for pid in _forks_of(zygote) if pid not in used])
        return len(seen[-1]) == 1

    assert _within(one_spare, 10), seen[-1:]
    (spare,) = seen[-1]
    return spare


def _owner_pid(runtime: Runtime, session: str) -> int:
    owner = runtime.store.get_session(session).owner
    assert owner is not None
    return owner.pid


def test_the_zygote_forks_the_next_owner_ahead_and_it_becomes_the_next_sessions_owner(
    warm: Runtime, tmp_path: Path
) -> None:
    try:
        task = warm.new_task(str(tmp_path / "ws"))
        first = warm.exec(task.task, shell="echo first")  # starts the zygote; no spare yet
        assert warm.wait(first.session, timeout=30)["receipt"]["exit"]["code"] == 0
        launcher = warm._launcher
        assert isinstance(launcher, WarmLauncher)
        spare = _spare_of(launcher, _owner_pid(warm, first.session))
        second = warm.exec(task.task, shell="echo second")
        owner = warm.store.get_session(second.session).owner
        assert owner is not None and owner.pid == spare  # the spare, not a new fork
        view = warm.wait(second.session, timeout=30)
        assert view["receipt"]["exit"]["code"] == 0 and view["receipt"]["death"]["proven"]
        assert view["receipt"]["owner"]["pid"] == spare
        assert warm.read(second.session, "stdout") == b"second\n"
        assert _spare_of(launcher, spare) != spare  # and the next one waits already
    finally:
        warm.close()


def test_a_spare_leaves_with_its_zygote_having_run_nothing(warm: Runtime, tmp_path: Path) -> None:
    task = warm.new_task(str(tmp_path / "ws"))
    first = warm.exec(task.task, shell="true")
    warm.wait(first.session, timeout=30)
    launcher = warm._launcher
    assert isinstance(launcher, WarmLauncher) and launcher._process is not None
    zygote = launcher._process.pid
    spare = _spare_of(launcher, _owner_pid(warm, first.session))
    warm.close()
    assert not _alive(zygote) and not _alive(spare), "the zygote waits for its spare to leave"
    with Runtime(str(tmp_path / "home")) as reader:
        assert [s.session for s in reader.store.live_sessions()] == []


def test_a_spare_made_for_another_home_is_let_go_and_the_owner_forked(tmp_path: Path) -> None:
    launcher = WarmLauncher()
    homes = [tmp_path / "a", tmp_path / "b"]
    try:
        runtimes = [Runtime(str(home), shared_launcher=launcher) for home in homes]
        (tmp_path / "ws").mkdir()
        tasks = [rt.new_task(str(tmp_path / "ws"), key=f"t{n}") for n, rt in enumerate(runtimes)]
        first = runtimes[0].exec(tasks[0].task, shell="true")
        runtimes[0].wait(first.session, timeout=30)
        spare_for_a = _spare_of(launcher, _owner_pid(runtimes[0], first.session))
        other = runtimes[1].exec(tasks[1].task, shell="echo b")
        view = runtimes[1].wait(other.session, timeout=30)
        assert view["receipt"]["exit"]["code"] == 0
        assert view["receipt"]["owner"]["pid"] != spare_for_a
        assert runtimes[1].read(other.session, "stdout") == b"b\n"
        assert _gone_within(spare_for_a, 10)
        for rt in runtimes:
            rt.close()
    finally:
        launcher.close()


@pytest.mark.parametrize("failing", ["socketpair", "fork"])
def test_a_zygote_that_cannot_fork_a_spare_goes_on_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    import socket

    from settled.owner import forking

    def refused(*_args: object, **_kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    made: list[socket.socket] = []
    real_pair = socket.socketpair

    def pair(*args: object) -> tuple[socket.socket, socket.socket]:
        ends = real_pair(*args)  # type: ignore[arg-type]
        made.extend(ends)
        return ends

    monkeypatch.setattr(socket, "socketpair", refused if failing == "socketpair" else pair)
    if failing == "fork":
        monkeypatch.setattr(forking, "fork_child", refused)
    monkeypatch.setattr(forking.Spare, "current", None)
    forking.Spare.refill(str(tmp_path / "home"), ())  # no exception: the zygote serves on
    assert forking.Spare.current is None
    assert all(end.fileno() == -1 for end in made)  # both ends closed, none leaked
