"""The splice path of the drain: pipe to log in the kernel, the digest read back from the file.

Every test pushes real bytes through a real pipe into a real file; a failure of the kernel or
the disk is injected by replacing one os call. What must hold on every path: the log is a prefix
of the output, the digest covers exactly the receipt's cursor of it, and every drained byte is
stored or counted.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from blake3 import blake3

from settled.log.writer import SPLICE_BLOCK, StreamSummary, StreamWriter, drain_once, enlarge_pipe
from settled.owner.launch import LOG_SPLICE_ENV, log_out_of_reach
from settled.records import TaskRecord
from settled.runtime import Runtime

MIB = 1 << 20


def b3(data: bytes) -> str:
    return "blake3:" + blake3(data).hexdigest()


class Pipe:
    """A real pipe (1 MiB), fed in slices and drained as the supervise loop drains a stream."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        enlarge_pipe(self.r)
        os.set_blocking(self.r, False)
        self.buffer = bytearray(MIB)

    def feed(self, writer: StreamWriter, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.w, view[: 256 * 1024]) :]
            self.drain(writer)

    def drain(self, writer: StreamWriter) -> int:
        moved = 0
        while True:
            try:
                n = writer.splice_from(self.r, MIB) if writer.splicing else None
                if n is None:
                    n = drain_once(self.r, self.buffer, writer)
            except BlockingIOError:
                return moved
            if n == 0:
                return moved
            moved += n

    def close(self) -> None:
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1


@pytest.fixture
def pipe() -> Any:
    made = Pipe()
    yield made
    made.close()


def _stored(path: Path, summary: StreamSummary) -> bytes:
    data = path.read_bytes()[: summary.cursor]
    assert summary.digest == b3(data)
    assert summary.cursor + summary.not_stored + summary.dropped == summary.drained
    return data


def test_a_splicing_writer_stores_every_byte_and_its_digest_is_the_files(
    tmp_path: Path, pipe: Pipe
) -> None:
    sent = os.urandom(5 * MIB + 12345)
    writer = StreamWriter(str(tmp_path / "stdout.log"), splice=True)
    pipe.feed(writer, sent[: 2 * MIB])
    assert writer.splicing and writer.sync() == 2 * MIB  # hashed behind, then fsynced
    pipe.feed(writer, sent[2 * MIB :])
    summary = writer.close()
    assert _stored(tmp_path / "stdout.log", summary) == sent
    assert summary.complete and summary.cursor == len(sent) == writer.durable


def test_past_the_cap_the_splice_stops_and_the_rest_is_read_and_counted(
    tmp_path: Path, pipe: Pipe
) -> None:
    sent = os.urandom(3 * MIB)
    writer = StreamWriter(str(tmp_path / "stdout.log"), cap=MIB + 7, splice=True)
    pipe.feed(writer, sent)
    summary = writer.close()
    assert _stored(tmp_path / "stdout.log", summary) == sent[: MIB + 7]
    assert (summary.not_stored, summary.dropped, summary.complete) == (2 * MIB - 7, 0, True)


def test_a_splice_the_kernel_refuses_falls_back_to_read_and_write_and_stores_on(
    tmp_path: Path, pipe: Pipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*_args: object, **_kwargs: object) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "splice", refused)
    sent = os.urandom(2 * MIB + 3)
    writer = StreamWriter(str(tmp_path / "stdout.log"), splice=True)
    pipe.feed(writer, sent)
    assert not writer.splicing
    summary = writer.close()
    assert _stored(tmp_path / "stdout.log", summary) == sent and summary.complete


def test_a_splice_that_fails_stops_storing_and_the_bytes_are_drained_and_counted(
    tmp_path: Path, pipe: Pipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_splice = os.splice
    calls = {"n": 0}

    def full_after_one(*args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_splice(*args, **kwargs)

    monkeypatch.setattr(os, "splice", full_after_one)
    sent = os.urandom(3 * MIB)
    writer = StreamWriter(str(tmp_path / "stdout.log"), splice=True)
    pipe.feed(writer, sent)
    summary = writer.close()
    stored = _stored(tmp_path / "stdout.log", summary)
    assert sent.startswith(stored) and 0 < len(stored) < len(sent)
    assert summary.drained == len(sent) and summary.dropped == len(sent) - len(stored)
    assert not summary.complete and "ENOSPC" in (summary.dropped_reason or "")


def test_a_read_back_that_fails_ends_the_digest_where_it_failed(
    tmp_path: Path, pipe: Pipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = os.urandom(5 * MIB)
    writer = StreamWriter(str(tmp_path / "stdout.log"), splice=True)
    pipe.feed(writer, sent[: 3 * MIB])
    writer.sync()  # the first 3 MiB are in the digest
    pipe.feed(writer, sent[3 * MIB :])

    def unreadable(*_args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", unreadable)
    summary = writer.close()
    assert summary.cursor == 3 * MIB and summary.digest == b3(sent[: 3 * MIB])
    assert summary.dropped == 2 * MIB and not summary.complete
    assert writer.durable <= summary.cursor
    assert "EIO" in (summary.dropped_reason or "")


class _Guard:
    """A space guard that allows `left` bytes in all, then refuses for good."""

    def __init__(self, left: int) -> None:
        self.left, self.refused, self.asked = left, None, []

    def room(self, size: int) -> int:
        self.asked.append(size)
        granted = max(0, min(size, self.left))
        self.left -= granted
        if granted < size:
            self.refused = self.refused or "reserve reached (test)"
        return granted


def test_the_reserve_is_asked_per_block_and_its_refusal_stops_storing_at_a_prefix(
    tmp_path: Path, pipe: Pipe
) -> None:
    guard = _Guard(SPLICE_BLOCK + MIB)
    sent = os.urandom(SPLICE_BLOCK + 3 * MIB)
    writer = StreamWriter(str(tmp_path / "stdout.log"), space=guard, splice=True)  # type: ignore[arg-type]
    pipe.feed(writer, sent)
    summary = writer.close()
    assert _stored(tmp_path / "stdout.log", summary) == sent[: SPLICE_BLOCK + MIB]
    assert summary.dropped == 2 * MIB and summary.dropped_reason is not None
    assert guard.asked[:2] == [SPLICE_BLOCK, SPLICE_BLOCK]  # a look per block, not per read


def _out_of_reach(**facts: Any) -> bool:
    """owner/launch.py's choice (made before the logs are created, with their flags) for a
    plan, sandbox and boundary kind as given."""
    plan = SimpleNamespace(mount_namespace=True, home="/h", home_hidden=True, private_proc=True)
    chosen: dict[str, Any] = {"plan": plan, "sandbox": None, "kind": "cgroup2+pidns"}
    for name, value in facts.items():
        if hasattr(plan, name):
            setattr(plan, name, value)
        else:
            chosen[name] = value
    return log_out_of_reach(chosen["plan"], chosen["sandbox"], chosen["kind"])


def test_an_owner_splices_only_where_nothing_but_itself_can_write_the_log() -> None:
    assert _out_of_reach()
    assert not _out_of_reach(mount_namespace=False)
    assert not _out_of_reach(home_hidden=False)  # the home is visible
    assert not _out_of_reach(private_proc=False)  # the owner's fds are
    assert not _out_of_reach(kind="cgroup2")  # no PID namespace
    assert not _out_of_reach(sandbox={"sandbox": "x"})
    assert not _out_of_reach(plan=None)


@pytest.mark.parametrize("splice", ["1", "0"], ids=["splice", "read-write"])
def test_an_owner_stores_and_digests_the_same_bytes_with_or_without_splice(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch, splice: str
) -> None:
    monkeypatch.setenv(LOG_SPLICE_ENV, splice)
    command = "head -c 40M /dev/zero | tr '\\0' s; printf e >&2"
    session = rt.exec(task.task, shell=command, key=f"splice-{splice}").session
    receipt = rt.wait(session, timeout=60)["receipt"]
    out = receipt["output"]["stdout"]
    assert out["cursor"] == 40 * MIB and out["complete"]
    assert out["digest"] == b3(b"s" * (40 * MIB))
    assert rt.read(session, "stdout", 40 * MIB - 3) == b"sss"
    assert receipt["output"]["stderr"]["digest"] == b3(b"e")
