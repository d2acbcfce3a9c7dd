"""The drain's bookkeeping off the copy path: fsyncs behind it, the index written at switches.

Real pipes, real files, real threads; no timing is asserted. A wait for the flusher's thread is
a bounded wait for a fact (its round count), never a measure of how fast it came.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from blake3 import blake3

from settled.log import interleave
from settled.log.flush import FLUSH_ENV, FLUSH_EVERY, Flusher, flush_every
from settled.log.writer import StreamWriter, enlarge_pipe
from settled.owner.supervise import Streams
from settled.records import TaskRecord
from settled.runtime import Runtime

MIB = 1 << 20


def _until(fact: object, what: str, seconds: float = 30.0) -> None:
    """Wait (bounded) for `fact()` to hold; fail naming `what` if it never does."""
    give_up = time.monotonic() + seconds
    while not fact():  # type: ignore[operator]
        assert time.monotonic() < give_up, f"never: {what}"
        time.sleep(0.005)


def _streams(tmp_path: Path, flusher: Flusher | None) -> tuple[Streams, dict[str, int]]:
    fds: dict[str, int] = {}
    writes: dict[str, int] = {}
    for name in ("stdout", "stderr"):
        r, w = os.pipe2(os.O_CLOEXEC)
        enlarge_pipe(r)
        os.set_blocking(r, False)
        fds[name], writes[name] = r, w
    writers = {n: StreamWriter(str(tmp_path / f"{n}.log")) for n in ("stdout", "stderr")}
    index = interleave.IndexWriter(interleave.index_path(str(tmp_path)))
    return Streams(fds, writers, index=index, flusher=flusher), writes


def _feed(streams: Streams, write_fd: int, name: str, data: bytes) -> None:
    """Push `data` through the real pipe and drain it as the supervise loop would."""
    view = memoryview(data)
    while view:
        sent = os.write(write_fd, view[: 256 * 1024])
        view = view[sent:]
        while True:
            before = streams.writers[name].cursor
            streams.drain(name)
            if streams.writers[name].cursor == before:
                break


def test_the_flusher_fsyncs_behind_the_drain_and_the_durable_cursor_moves_before_close(
    tmp_path: Path,
) -> None:
    flusher = Flusher(every=4 * MIB)
    flusher.start()
    streams, writes = _streams(tmp_path, flusher)
    try:
        data = os.urandom(MIB) * 12
        _feed(streams, writes["stdout"], "stdout", data)
        writer = streams.writers["stdout"]
        _until(lambda: flusher.syncs >= 1 and writer.durable >= 4 * MIB, "a sync behind")
        assert writer.durable <= writer.cursor == len(data)
        for w in writes.values():
            os.close(w)
        summaries = streams.close()
    finally:
        flusher.close()
    assert summaries["stdout"].digest == "blake3:" + blake3(data).hexdigest()
    assert summaries["stdout"].cursor == len(data) == writer.durable
    assert (tmp_path / "stdout.log").read_bytes() == data


def test_syncs_from_two_threads_beside_appends_keep_the_durable_cursor_growing_and_true(
    tmp_path: Path,
) -> None:
    """The flusher and the heartbeat both sync while the drain appends: a durable cursor
    never goes back and never names a byte that was not written before its fsync began."""
    writer = StreamWriter(str(tmp_path / "stdout.log"))
    seen: list[int] = []
    stop = threading.Event()

    def syncing() -> None:
        while not stop.is_set():
            durable = writer.sync()
            seen.append(durable)

    threads = [threading.Thread(target=syncing) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(400):
            writer.append(b"z" * 8192)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    summary = writer.close()
    assert summary.cursor == 400 * 8192 == writer.durable
    assert all(0 <= d <= summary.cursor for d in seen)
    assert writer.durable >= max(seen)


def test_a_failed_fsync_in_the_flusher_stops_storing_and_nothing_is_lost_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flusher = Flusher(every=MIB)
    flusher.start()
    streams, writes = _streams(tmp_path, flusher)
    real_fsync = os.fsync
    failed = threading.Event()

    def failing_fsync(fd: int) -> None:
        failed.set()
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    try:
        _feed(streams, writes["stdout"], "stdout", b"a" * (2 * MIB))
        _until(lambda: failed.is_set() and flusher.syncs >= 1, "the flusher's failed fsync")
        _feed(streams, writes["stdout"], "stdout", b"b" * MIB)  # still drained
        monkeypatch.setattr(os, "fsync", real_fsync)
        for w in writes.values():
            os.close(w)
        summaries = streams.close()
    finally:
        monkeypatch.setattr(os, "fsync", real_fsync)
        flusher.close()
    out = summaries["stdout"]
    assert out.drained == 3 * MIB
    assert out.cursor + out.dropped == out.drained and out.dropped >= MIB
    assert not out.complete and "EIO" in (out.dropped_reason or "")
    stored = (tmp_path / "stdout.log").read_bytes()
    assert len(stored) == out.cursor and out.digest == "blake3:" + blake3(stored).hexdigest()


def test_one_streams_chunks_cost_no_index_write_until_a_switch_or_a_sync(tmp_path: Path) -> None:
    path = interleave.index_path(str(tmp_path))
    index = interleave.IndexWriter(path)
    header = len(interleave.HEADER)
    index.record("stdout", 0, 10)
    on_disk = os.path.getsize(path)
    assert on_disk == header + interleave.RECORD.size
    first = (tmp_path / "interleave.idx").read_bytes()
    for end in range(20, 1000, 10):
        index.record("stdout", end - 10, end)
    assert (tmp_path / "interleave.idx").read_bytes() == first  # nothing written per chunk
    index.record("stderr", 0, 5)  # the switch writes stdout's final end, then stderr's record
    records = list(interleave._records(path))
    assert records == [("stdout", 0, 990), ("stderr", 0, 5)]
    index.record("stderr", 5, 9)
    index.sync()
    assert list(interleave._records(path))[-1] == ("stderr", 0, 9)
    index.close()


def test_the_unsynced_tail_of_the_last_record_is_served_in_order_only_when_it_must_be(
    tmp_path: Path,
) -> None:
    """stdout [0,4) then stderr [0,2) are recorded; stderr then went on to 6 bytes without a
    sync. With stdout at its records, stderr's tail is ordered; once stdout has a byte past
    its records, a live reader no longer knows where that byte goes and stops at the index."""
    (tmp_path / "stdout.log").write_bytes(b"abcd")
    (tmp_path / "stderr.log").write_bytes(b"XYZUVW")
    index = interleave.IndexWriter(interleave.index_path(str(tmp_path)))
    index.record("stdout", 0, 4)
    index.record("stderr", 0, 2)
    index.record("stderr", 2, 6)  # in memory only: the file still says stderr [0, 2)
    limits = {"stdout": 4, "stderr": 6}
    assert interleave.ordered_limits(str(tmp_path), limits) == limits
    merged = interleave.read_merged(str(tmp_path), limits)
    assert b"".join(c.data for c in merged) == b"abcdXYZUVW" and all(c.ordered for c in merged)

    with open(tmp_path / "stdout.log", "ab") as out:
        out.write(b"e")  # stored after the limits were read: its place is not known yet
    assert interleave.ordered_limits(str(tmp_path), limits) == {"stdout": 4, "stderr": 2}
    index.close()


def test_a_flood_in_turns_syncs_behind_the_drain_and_the_merged_view_keeps_the_turns(
    tmp_path: Path,
) -> None:
    """A real command writes 8 MiB blocks to stdout and stderr in turns through real pipes
    (each block once the previous one was drained); both logs and their merged view are
    exactly the bytes, in the order the command wrote them."""
    script = (
        "import os\n"
        "for i in range(6):\n"
        "    os.read(0, 1)\n"
        "    os.write(1 + i % 2, bytes([65 + i]) * (8 << 20))\n"
    )
    flusher = Flusher(every=4 * MIB)
    flusher.start()
    streams, writes = _streams(tmp_path, flusher)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=go_r, stdout=writes["stdout"],
        stderr=writes["stderr"],
    )  # fmt: skip
    for fd in (go_r, *writes.values()):
        os.close(fd)
    try:
        for i in range(6):
            name = ("stdout", "stderr")[i % 2]
            os.write(go_w, b"g")
            want = (i // 2 + 1) * (8 << 20)
            while streams.writers[name].cursor < want:
                streams.drain(name)
        os.close(go_w)
        go_w = -1
        while streams.open:
            for name in ("stdout", "stderr"):
                if name in streams.open:
                    streams.drain(name)
        assert proc.wait(timeout=60) == 0
        summaries = streams.close()
    finally:
        if go_w >= 0:
            os.close(go_w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        flusher.close()
    assert flusher.syncs >= 1
    for name, letters in (("stdout", b"ACE"), ("stderr", b"BDF")):
        stored = (tmp_path / f"{name}.log").read_bytes()
        assert stored == b"".join(bytes([c]) * (8 << 20) for c in letters)
        assert summaries[name].digest == "blake3:" + blake3(stored).hexdigest()
    limits = {n: s.cursor for n, s in summaries.items()}
    chunks = interleave.read_merged(str(tmp_path), limits, 0, 1 << 30)
    assert all(c.ordered for c in chunks)
    assert b"".join(c.data for c in chunks) == b"".join(
        bytes([65 + i]) * (8 << 20) for i in range(6)
    )


def test_the_flush_interval_comes_from_the_environment_and_zero_means_none(
    tmp_path: Path,
) -> None:
    assert flush_every(None) == flush_every("") == FLUSH_EVERY
    assert flush_every("1048576") == MIB
    assert flush_every("0") is None
    with pytest.raises(ValueError):
        flush_every("-1")
    flusher = Flusher(None)
    flusher.start()  # nothing to start
    streams, writes = _streams(tmp_path, flusher)
    _feed(streams, writes["stdout"], "stdout", b"q" * (3 * MIB))
    assert streams.writers["stdout"].durable == 0  # no fsync before the end
    for w in writes.values():
        os.close(w)
    summaries = streams.close()
    assert flusher.syncs == 0 and summaries["stdout"].cursor == 3 * MIB


def test_an_owner_without_the_flusher_still_stores_and_digests_every_byte(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FLUSH_ENV, "0")  # the owner reads it as it starts
    session = rt.exec(task.task, shell="head -c 20M /dev/zero | tr '\\0' w", key="noflush").session
    receipt = rt.wait(session, timeout=60)["receipt"]
    out = receipt["output"]["stdout"]
    assert out["cursor"] == 20 * MIB and out["complete"]
    assert out["digest"] == "blake3:" + blake3(b"w" * (20 * MIB)).hexdigest()
