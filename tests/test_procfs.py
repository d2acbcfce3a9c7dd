"""The process tree read from /proc while its processes vanish: a process gone between two steps
of a walk is gone, whatever the kernel answers, never an error that ends its reader (an owner
walking its killed fork storm died of one, leaving its session without a receipt)."""

from __future__ import annotations

import builtins
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from settled.boundary import procfs


class _Reaped:
    """A real process, and /proc/PID held open while it lived: a walk replayed through the held
    directory once the process is reaped is the kernel's own answer to a walk that found
    /proc/PID alive and the process reaped at its next step (ESRCH, not ENOENT)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(["sleep", "300"])
        self.pid = self.process.pid
        self.held = os.open(f"/proc/{self.pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def reap(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            self.process.wait()

    def through_held(self, path: str) -> str:
        prefix = f"/proc/{self.pid}/"
        if not path.startswith(prefix):
            return path
        return f"/proc/self/fd/{self.held}/{path[len(prefix) :]}"

    def close(self) -> None:
        self.reap()
        os.close(self.held)


@pytest.fixture
def reaped() -> Iterator[_Reaped]:
    process = _Reaped()
    yield process
    process.close()


class _WalkReapingAt:
    """procfs's `os` and `open`: the process is reaped just before the walk's `step` ("task":
    the listing of its threads; "children": the read of a thread's children), and that step
    walks through /proc/PID as it was found, alive."""

    def __init__(self, process: _Reaped, step: str) -> None:
        self.process, self.step = process, step

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def listdir(self, path: str) -> list[str]:
        if self.step != "task":
            return os.listdir(path)
        self.process.reap()
        return os.listdir(self.process.through_held(path))

    def open(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.step != "children":
            return builtins.open(path, *args, **kwargs)
        self.process.reap()
        return builtins.open(self.process.through_held(path), *args, **kwargs)


def test_the_kernel_answers_esrch_for_a_walk_through_a_reaped_process(reaped: _Reaped) -> None:
    """The fact the tests below replay: ENOENT for a fresh path, ESRCH through the one found."""
    reaped.reap()
    with pytest.raises(FileNotFoundError):
        os.listdir(f"/proc/{reaped.pid}/task")
    with pytest.raises(ProcessLookupError):
        os.listdir(reaped.through_held(f"/proc/{reaped.pid}/task"))


@pytest.mark.parametrize("step", ["task", "children"])
def test_a_process_reaped_during_the_walk_has_no_children(
    reaped: _Reaped, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    walk = _WalkReapingAt(reaped, step)
    monkeypatch.setattr(procfs, "os", walk)
    monkeypatch.setattr(procfs, "open", walk.open, raising=False)
    assert procfs.children(reaped.pid) == []
    assert procfs.live_descendants(reaped.pid) == []
