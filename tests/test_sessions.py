"""The session runtime, end to end, with real processes in every boundary that gives evidence.

Each test reads like one of the seed's probes: one behaviour, named for what must hold.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import blake3
import pytest
from conftest import kill_marked, small_owner_kib

from settled.records import TaskRecord
from settled.runtime import Runtime

MIB = 1 << 20


def run(rt: Runtime, task: TaskRecord, boundary: str, shell: str, **kw: object) -> dict:
    admission = rt.exec(task.task, shell=shell, boundary=boundary, **kw)  # type: ignore[arg-type]
    view = rt.wait(admission.session, timeout=60)
    assert view["state"] == "settled", view
    receipt: dict = view["receipt"]
    assert receipt["death"]["proven"] is True
    assert receipt["death"]["boundary"] == boundary
    return receipt


def stdout_of(rt: Runtime, receipt: dict) -> bytes:
    return b"".join(rt.follow(receipt["session"], "stdout", 0, timeout=10))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: reaped mid-walk (test_procfs.py)
        return False


def test_a_4_mib_line_comes_back_bit_for_bit(rt: Runtime, task: TaskRecord, boundary: str) -> None:
    receipt = run(rt, task, boundary, "head -c 4194304 /dev/zero | tr '\\0' x")
    data = stdout_of(rt, receipt)
    assert data == b"x" * (4 * MIB)
    assert receipt["output"]["stdout"]["cursor"] == 4 * MIB
    assert receipt["output"]["stdout"]["digest"] == "blake3:" + blake3.blake3(data).hexdigest()
    assert receipt["output"]["drain"] == "complete"
    assert receipt["exit"] == {**receipt["exit"], "code": 0, "reason": "exited"}


def test_a_64_mib_line_without_newline_comes_back_whole(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    receipt = run(rt, task, boundary, "head -c 67108864 /dev/zero | tr '\\0' y")
    stdout = receipt["output"]["stdout"]
    assert stdout["cursor"] == 64 * MIB
    expected = blake3.blake3(b"y" * (64 * MIB)).hexdigest()
    assert stdout["digest"] == f"blake3:{expected}"


def test_random_binary_is_preserved(rt: Runtime, task: TaskRecord, boundary: str) -> None:
    blob = os.urandom(3 * MIB + 17) + b"\0\r\n\xff\xfe"
    with open(os.path.join(task.workspace, "blob.bin"), "wb") as handle:
        handle.write(blob)
    receipt = run(rt, task, boundary, "cat blob.bin; cat blob.bin >&2")
    assert stdout_of(rt, receipt) == blob
    stderr = b"".join(rt.follow(receipt["session"], "stderr", 0, timeout=10))
    assert stderr == blob


def test_a_silent_command_times_out_on_the_owners_clock(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    started = time.monotonic()
    receipt = run(rt, task, boundary, "sleep 30", timeout=1.0, grace=1.0)
    took = time.monotonic() - started
    assert receipt["exit"]["reason"] == "timeout"
    assert receipt["exit"]["signal"] == "TERM"
    assert 0.9 < receipt["exit"]["elapsed_s"] < 2.5
    assert took < 10, f"a 1 s timeout settled after {took:.1f} s"


def test_a_term_ignoring_command_is_killed_after_the_grace(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    receipt = run(
        rt, task, boundary, "trap '' TERM; sleep 30; echo survived", timeout=0.5, grace=0.5
    )
    assert receipt["exit"]["reason"] == "timeout"
    assert receipt["exit"]["signal"] == "KILL"
    assert b"survived" not in stdout_of(rt, receipt)
    assert receipt["timings"]["stop_to_evidence_s"] >= 0.5


def test_a_setsid_descendant_holding_stdout_is_stopped_and_named(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    receipt = run(rt, task, boundary, "setsid sleep 300 & echo parent exits", grace=2.0)
    assert receipt["exit"]["code"] == 0
    assert receipt["output"]["drain"] == "complete"
    assert stdout_of(rt, receipt) == b"parent exits\n"
    [straggler] = receipt["stragglers"]
    assert "sleep 300" in straggler["cmdline"]  # seen before or after its exec
    assert straggler["stopped_by"] == "TERM"
    assert not alive(straggler["pid"])


def test_a_double_forked_term_ignoring_descendant_is_killed(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    holder = "trap '' TERM; echo holder; touch ready; sleep 300"
    shell = f'(setsid sh -c "{holder}" &); while [ ! -e ready ]; do sleep 0.01; done; echo top'
    receipt = run(rt, task, boundary, shell, grace=0.5)
    assert receipt["output"]["drain"] == "complete"
    assert sorted(stdout_of(rt, receipt).split()) == [b"holder", b"top"]
    assert receipt["stragglers"], "the double-forked holder must be named"
    assert {s["stopped_by"] for s in receipt["stragglers"]} == {"KILL"}
    assert not any(alive(s["pid"]) for s in receipt["stragglers"])


@pytest.mark.timeout(90)
def test_a_500_process_fork_storm_is_killed_entirely(
    rt: Runtime, task: TaskRecord, boundary: str, marker: str
) -> None:
    shell = "for i in $(seq 500); do sleep 1000 & done; echo up; wait"
    admission = rt.exec(task.task, shell=shell, boundary=boundary, timeout=3.0, grace=0.2)
    view = rt.wait(admission.session, timeout=60)
    receipt = view["receipt"]
    assert receipt["death"]["proven"] is True
    assert receipt["exit"]["reason"] == "timeout"
    assert stdout_of(rt, receipt) == b"up\n"
    survivors = kill_marked(marker, b"sleep\0" + b"1000")
    assert survivors == [], "no process of the storm may survive its session"


def test_exit_codes_and_signals_are_reported_as_facts(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    assert run(rt, task, boundary, "exit 7")["exit"]["code"] == 7
    killed = run(rt, task, boundary, "kill -SEGV $$")["exit"]
    assert killed["signal"] == "SEGV" and killed["code"] is None
    assert killed["reason"] == "exited"


def test_a_session_finishes_and_is_recorded_with_no_reader(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    admission = rt.exec(task.task, shell="sleep 0.3; echo done", boundary=boundary)
    assert admission.state == "running"
    deadline = time.monotonic() + 20
    while rt.store.get_session(admission.session).receipt is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    receipt = rt.store.get_session(admission.session).receipt
    assert receipt is not None and receipt["exit"]["code"] == 0
    assert rt.read(admission.session, "stdout") == b"done\n"


def test_a_reader_resumes_from_any_cursor(rt: Runtime, task: TaskRecord, boundary: str) -> None:
    shell = "for i in $(seq 1 200); do printf 'chunk %05d|' $i; sleep 0.002; done"
    admission = rt.exec(task.task, shell=shell, boundary=boundary)
    first = next(iter(rt.follow(admission.session, "stdout", 0, timeout=20)))
    resumed = b"".join(rt.follow(admission.session, "stdout", len(first), timeout=20))
    expected = b"".join(b"chunk %05d|" % i for i in range(1, 201))
    assert first + resumed == expected
    assert rt.read(admission.session, "stdout", 1000, 12) == expected[1000:1012]


@pytest.mark.timeout(90)
def test_the_owner_stays_small_for_a_huge_line(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    receipt = run(rt, task, boundary, "head -c 268435456 /dev/zero | tr '\\0' z")
    assert receipt["output"]["stdout"]["cursor"] == 256 * MIB
    assert receipt["owner"]["maxrss_kib"] < small_owner_kib(rt), receipt["owner"]


def test_a_cancelled_session_is_stopped_over_its_whole_boundary(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    admission = rt.exec(task.task, shell="sleep 300 & sleep 300", boundary=boundary, grace=1.0)
    rt.cancel(admission.session, "the agent changed its mind")
    view = rt.wait(admission.session, timeout=20)
    assert view["state"] == "settled", view
    assert view["receipt"]["exit"]["reason"] == "cancelled"
    assert view["receipt"]["death"]["proven"] is True


def _has(kind: str) -> bool:
    from settled.boundary import availability

    return availability()[kind] is None


def test_bytes_past_the_log_cap_are_drained_and_counted_not_stored(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_LOG_CAP", "1000")
    receipt = run(rt, task, "subreaper", "head -c 5000 /dev/zero; echo done >&2")
    stdout = receipt["output"]["stdout"]
    assert (stdout["cursor"], stdout["drained"], stdout["not_stored"], stdout["cap"]) == (
        1000,
        5000,
        4000,
        1000,
    )
    assert receipt["exit"]["code"] == 0, "the command is never blocked by the cap"
    assert len(stdout_of(rt, receipt)) == 1000


def test_a_session_whose_owner_vanished_is_unknown_not_failed(
    rt: Runtime, task: TaskRecord
) -> None:
    if not _has("cgroup2"):
        pytest.skip("needs a cgroup2 boundary to end the orphaned command afterwards")
    admission = rt.exec(task.task, shell="sleep 300", boundary="cgroup2")
    record = rt.store.get_session(admission.session)
    assert record.owner is not None and record.boundary_ref is not None
    os.kill(record.owner.pid, 9)
    deadline = time.monotonic() + 10
    while rt.owner_facts(rt.store.get_session(admission.session)).alive:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    view = rt.session_status(admission.session)
    assert view["state"] == "unknown"
    assert "not failed" in view["why"] and str(record.owner.pid) in view["why"]
    [recovered] = rt.recover(task.task)  # the runtime ends what the dead owner left
    assert recovered["state"] == "settled"


@pytest.mark.timeout(90)
def test_twenty_concurrent_identical_admissions_launch_once(
    rt: Runtime, task: TaskRecord, boundary: str
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def admit(_: int) -> tuple[str, bool]:
        with Runtime(rt.home) as own:  # its own store connection, as another process would have
            admission = own.exec(
                task.task, shell="echo ran >> launches", key="k", boundary=boundary
            )
            return admission.session, admission.reused

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(admit, range(20)))
    assert len({session for session, _ in results}) == 1
    assert sorted(reused for _, reused in results) == [False] + [True] * 19
    rt.wait(results[0][0], timeout=30)
    assert Path(task.workspace, "launches").read_text() == "ran\n"


def test_a_key_conflict_launches_nothing(rt: Runtime, task: TaskRecord, boundary: str) -> None:
    from settled.errors import KeyConflict

    first = rt.exec(task.task, shell="echo one", key="k", boundary=boundary)
    with pytest.raises(KeyConflict) as conflict:
        rt.exec(task.task, shell="echo two >> never", key="k", boundary=boundary)
    assert conflict.value.existing_digest == first.digest
    assert len(rt.store.list_sessions(task.task)) == 1
    rt.wait(first.session, timeout=30)
    assert not Path(task.workspace, "never").exists()


@pytest.mark.timeout(120)
def test_a_1_gib_line_with_no_newline_comes_back_whole(rt: Runtime, task: TaskRecord) -> None:
    kind = "cgroup2" if _has("cgroup2") else "subreaper"
    receipt = run(rt, task, kind, "head -c 1073741824 /dev/zero | tr '\\0' q")
    stdout = receipt["output"]["stdout"]
    hasher = blake3.blake3()
    block = b"q" * MIB
    for _ in range(1024):
        hasher.update(block)
    assert stdout["cursor"] == 1 << 30
    assert stdout["digest"] == "blake3:" + hasher.hexdigest()
    assert receipt["owner"]["maxrss_kib"] < small_owner_kib(rt), receipt["owner"]
    tail = rt.read(receipt["session"], "stdout", (1 << 30) - 5, 100)
    assert tail == b"qqqqq"


def test_a_followers_pause_wakes_on_the_owners_exit_and_then_never_spins() -> None:
    """`pauses` sleeps on the owner's exit handle; once that fired it sleeps in the store
    (a lost owner's handle would stay readable, and a follower must poll, not spin)."""
    from types import SimpleNamespace
    from typing import Any

    from settled.sessions import SessionWatch

    calls: list[tuple[str, Any]] = []

    class Store:
        def get_session(self, session: str) -> Any:
            return SimpleNamespace(owner=SimpleNamespace(pid=1, start_time=1))

        def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
            calls.append(("store", seconds))

    class Owners:
        def exit_handle(self, owner: Any) -> int:
            calls.append(("handle", owner.pid))
            return 99

        def await_exit(self, handle: int | None, seconds: float) -> bool:
            calls.append(("exit", seconds))
            return True  # the owner exited

        def close_handle(self, handle: int) -> None:
            calls.append(("closed", handle))

    watch = SessionWatch(Store(), Owners())  # type: ignore[arg-type]
    with watch.pauses("s_0123456789abcdef") as pause:
        pause(0.05)
        pause(0.05)
        pause(0.05)
    assert calls == [
        ("handle", 1), ("exit", 0.05), ("closed", 99), ("store", 0.05), ("store", 0.05)
    ]  # fmt: skip


def test_the_owner_exit_handle_is_readable_exactly_when_the_owner_has_exited(
    rt: Runtime, task: TaskRecord
) -> None:
    """What the server's long poll waits on: a live owner's handle is not readable; once the
    command ends and the owner exits it is, and by then the receipt is recorded; a session
    that settled gives none."""
    import select

    session = rt.exec(task.task, shell="sleep 30", timeout=60).session
    handle = rt.exit_handle(session)
    assert handle is not None
    try:
        poller = select.poll()
        poller.register(handle, select.POLLIN)
        assert poller.poll(200) == []  # the owner runs while its command does
        rt.cancel(session, "the test is done with it")
        assert poller.poll(30_000) != []  # readable: the owner exited
        assert rt.session_record(session).receipt is not None  # recorded before it exited
    finally:
        os.close(handle)
    assert rt.exit_handle(session) is None  # settled: no owner acts for it any more
