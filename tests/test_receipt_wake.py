"""A waiter in the launching process wakes when its owner has written the receipt (the owner
closes its end of the readiness pipe then), not when the owner's process has exited."""

from __future__ import annotations

import os
import select
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from settled.boundary import procfs
from settled.owner import receipt_wake
from settled.runtime import Runtime

HOLDER = (
    "import os, sys, time; fd = int(sys.argv[1]); sys.stdin.readline(); os.close(fd); "
    "print('closed', flush=True); sys.stdin.readline()"
)  # holds the write end until told, closes it, then lives on until told again


def _readable(fd: int, seconds: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], seconds)[0])


def _sweep() -> None:
    """Close the kept ends that fired now, not at the next test's launch."""
    with receipt_wake._lock:
        receipt_wake._close_fired()


@pytest.fixture
def kept() -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """A live process holding a pipe's write end (as an owner does), the read end kept for it
    (`receipt_wake.keep`, as a launcher does), and the process's start time."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(write_end)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(write_end,),
    )  # fmt: skip
    os.close(write_end)
    receipt_wake.keep(child.pid, read_end)
    start = procfs.start_time(child.pid)
    assert start is not None
    yield child, read_end, start
    if child.poll() is None:
        child.kill()
    child.wait(10)
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            pipe.close()
    _sweep()


def test_the_kept_end_wakes_when_the_owner_closes_its_own_while_it_still_runs(
    kept: tuple[subprocess.Popen[str], int, int],
) -> None:
    child, _, start = kept
    handle = receipt_wake.handle(child.pid, start)
    assert handle is not None
    try:
        assert not _readable(handle)
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.stdout.readline() == "closed\n"
        assert _readable(handle, 10) and child.poll() is None  # awake, the process lives on
        assert os.read(handle, 1) == b""  # EOF: said by the close, not by bytes
    finally:
        os.close(handle)


def test_no_end_is_handed_for_another_process_or_a_reused_pid(
    kept: tuple[subprocess.Popen[str], int, int],
) -> None:
    child, _, start = kept
    assert receipt_wake.handle(child.pid, start + 1) is None  # same pid, another process
    assert receipt_wake.handle(os.getpid(), procfs.start_time(os.getpid())) is None
    assert receipt_wake.handle(child.pid, None) is None


def test_ends_that_fired_are_closed_at_the_next_launch(
    kept: tuple[subprocess.Popen[str], int, int],
) -> None:
    child, read_end, _ = kept
    child.kill()  # its death closes its end
    child.wait(10)
    other_r, other_w = os.pipe2(os.O_CLOEXEC)
    try:
        receipt_wake.keep(os.getpid(), other_r)  # the next launch sweeps
        with pytest.raises(OSError):
            os.fstat(read_end)  # closed by the sweep
        handle = receipt_wake.handle(os.getpid(), procfs.start_time(os.getpid()))
        assert handle is not None  # the live one is still kept
        os.close(handle)
    finally:
        os.close(other_w)
        _sweep()


@pytest.mark.parametrize("launcher", ["warm", "fresh"])
def test_the_waiters_handle_fires_only_once_the_receipt_is_in_the_store(
    tmp_path: Path, launcher: str
) -> None:
    (tmp_path / "ws").mkdir()
    with Runtime(str(tmp_path / "home"), launcher=launcher) as rt:
        task = rt.new_task(str(tmp_path / "ws"))
        for n in range(10):
            admission = rt.exec(task.task, shell=f"echo {n}", key=f"k{n}")
            handle = rt.exit_handle(admission.session)
            assert handle is not None
            try:
                assert stat.S_ISFIFO(os.fstat(handle).st_mode)  # the pipe, not the pidfd
                assert _readable(handle, 30)
                view = rt.session_status(admission.session)  # at once: no wait, no retry
                assert view["state"] == "settled" and "receipt" in view, view
            finally:
                rt.close_exit_handle(handle)
            assert rt.read(admission.session, "stdout") == f"{n}\n".encode()
        assert rt.close_task(task.task).complete
