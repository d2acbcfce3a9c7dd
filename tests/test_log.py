"""Behaviours of settled.log: logs are bytes with cursors, not lines."""

from __future__ import annotations

import os
import random
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from blake3 import blake3

from settled import errors
from settled.home import log_path
from settled.log import (
    CursorOutOfRange,
    StreamWriter,
    drain_once,
    enlarge_pipe,
    follow,
    model_view,
    read_range,
    read_window,
    render_view,
    stored_length,
    stream_path,
)
from settled.records import TaskRecord
from settled.runtime import Runtime

MARKER = re.compile(
    r"\n\[settled: omitted (\w+) bytes (\d+)\.\.(\d+) \((\d+) bytes\); "
    r"read them with: settled logs (\S+) --stream (\w+) --from (\d+)\]\n"
)


def b3(data: bytes) -> str:
    return "blake3:" + blake3(data).hexdigest()


def write_log(path: Path, data: bytes, cap: int | None = None) -> StreamWriter:
    writer = StreamWriter(str(path), cap=cap)
    writer.append(data)
    return writer


def split_view(view: str) -> tuple[str, int, int, str]:
    found = list(MARKER.finditer(view))
    assert len(found) == 1, view[:300]
    match = found[0]
    a, b, omitted = int(match[2]), int(match[3]), int(match[4])
    assert b - a == omitted
    assert int(match[7]) == a
    return view[: match.start()], a, b, view[match.end() :]


# --- writer -----------------------------------------------------------------------------------


def test_random_binary_round_trips_bit_for_bit(tmp_path: Path) -> None:
    rng = random.Random(1)
    data = b"\x00\r\n\r\xff\xfe\xc3(\xf0\x9f\x98" + rng.randbytes(3 << 20) + b"\x00\r\xc3"
    path = tmp_path / "stdout.log"
    writer = StreamWriter(str(path))
    offset = 0
    while offset < len(data):  # appends of irregular sizes, as a pipe delivers them
        step = rng.randint(1, 200_000)
        writer.append(memoryview(data)[offset : offset + step])
        offset += step
    summary = writer.close()
    assert path.read_bytes() == data
    assert read_range(str(path), 0, len(data) + 10) == data
    assert summary.cursor == summary.drained == len(data)
    assert summary.not_stored == 0
    assert summary.digest == b3(data)


def test_64mib_single_line_without_newline_round_trips_and_digest_matches(tmp_path: Path) -> None:
    line = bytes(range(ord("a"), ord("z") + 1)) * ((64 << 20) // 26 + 1)
    line = line[: 64 << 20]
    assert b"\n" not in line
    path = tmp_path / "stdout.log"
    writer = StreamWriter(str(path))
    view = memoryview(line)
    for offset in range(0, len(line), 1 << 20):
        writer.append(view[offset : offset + (1 << 20)])
    summary = writer.close()
    assert summary.cursor == len(line) == stored_length(str(path))
    assert summary.digest == b3(line)
    assert read_range(str(path), 0, len(line)) == line


def test_cap_counts_bytes_past_cap_stores_exactly_cap_and_digests_stored_bytes(
    tmp_path: Path,
) -> None:
    data = random.Random(2).randbytes(10_000)
    path = tmp_path / "stderr.log"
    writer = StreamWriter(str(path), cap=4096)
    for offset in range(0, len(data), 1000):
        writer.append(data[offset : offset + 1000])  # crosses the cap mid-append
    summary = writer.close()
    assert os.path.getsize(path) == 4096 == summary.cursor
    assert summary.drained == 10_000
    assert summary.not_stored == 10_000 - 4096
    assert summary.digest == b3(data[:4096])
    assert summary.to_json() == {
        "cursor": 4096,
        "digest": b3(data[:4096]),
        "drained": 10_000,
        "not_stored": 5904,
        "cap": 4096,
        "dropped": 0,
        "dropped_reason": None,
        "complete": True,
    }


def test_writer_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    path.write_bytes(b"earlier run")
    with pytest.raises(FileExistsError):
        StreamWriter(str(path))
    assert path.read_bytes() == b"earlier run"


def test_writer_creates_the_file_private_0600_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    old = os.umask(0)
    try:
        StreamWriter(str(path)).close()
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600


def test_durable_cursor_advances_only_after_sync(tmp_path: Path) -> None:
    writer = StreamWriter(str(tmp_path / "stdout.log"))
    writer.append(b"abc")
    assert (writer.cursor, writer.durable) == (3, 0)
    assert writer.sync() == 3
    writer.append(b"defg")
    assert (writer.cursor, writer.durable) == (7, 3)
    summary = writer.close()
    assert writer.durable == 7 == summary.cursor


def test_close_is_idempotent_and_append_after_close_fails(tmp_path: Path) -> None:
    writer = write_log(tmp_path / "stdout.log", b"x" * 10)
    first = writer.close()
    assert writer.close() is first
    with pytest.raises(ValueError, match="closed"):
        writer.append(b"more")


def test_an_fsync_error_is_never_retried_and_the_summary_says_the_stream_is_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = write_log(tmp_path / "stdout.log", b"data")
    real_fsync = os.fsync
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    assert writer.sync() == 0, "a failed fsync publishes no durable cursor"
    monkeypatch.setattr(os, "fsync", real_fsync)  # the disk "recovers": still not trusted
    assert writer.sync() == 0 and len(calls) == 1, "never fsynced again"
    writer.append(b"later")  # still drained, no longer stored
    summary = writer.close()
    assert writer.durable == 0
    assert (summary.cursor, summary.drained, summary.dropped) == (4, 9, 5)
    assert not summary.complete
    assert summary.dropped_reason is not None and "EIO" in summary.dropped_reason
    assert (tmp_path / "stdout.log").read_bytes() == b"data"


# --- drain ------------------------------------------------------------------------------------


def test_drain_once_through_a_real_pipe_stores_exactly_what_was_sent(tmp_path: Path) -> None:
    sent = tmp_path / "sent.bin"
    proc = subprocess.Popen(
        ["sh", "-c", 'head -c 8M /dev/urandom | tee "$1"', "sh", str(sent)],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        assert enlarge_pipe(fd) >= 4096
        writer = StreamWriter(str(tmp_path / "stdout.log"))
        buf = bytearray(1 << 20)
        while drain_once(fd, buf, writer):
            pass
        summary = writer.close()
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
        assert proc.wait(timeout=30) == 0
    expected = sent.read_bytes()
    assert len(expected) == 8 << 20 == summary.cursor == summary.drained
    assert summary.digest == b3(expected)


def test_drain_once_lets_blocking_io_error_propagate_on_an_empty_nonblocking_pipe(
    tmp_path: Path,
) -> None:
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        writer = StreamWriter(str(tmp_path / "stdout.log"))
        buf = bytearray(4096)
        with pytest.raises(BlockingIOError):
            drain_once(r, buf, writer)
        os.write(w, b"hello")
        assert drain_once(r, buf, writer) == 5
        os.close(w)
        w = -1
        assert drain_once(r, buf, writer) == 0
        assert writer.close().digest == b3(b"hello")
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_enlarge_pipe_reports_the_size_the_kernel_granted() -> None:
    r, w = os.pipe()
    try:
        assert enlarge_pipe(w, 1 << 20) == 1 << 20
        # Beyond /proc/sys/fs/pipe-max-size: EPERM unless privileged; either way a real size.
        assert enlarge_pipe(w, 1 << 30) >= 1 << 20
    finally:
        os.close(r)
        os.close(w)


# --- reader -----------------------------------------------------------------------------------


@pytest.fixture
def log400(tmp_path: Path) -> str:
    path = tmp_path / "stdout.log"
    write_log(path, bytes(range(200)) * 2).close()
    return str(path)


def test_read_range_from_cursor_zero(log400: str) -> None:
    assert read_range(log400, 0, 10) == bytes(range(10))


def test_read_range_from_a_middle_cursor(log400: str) -> None:
    assert read_range(log400, 195, 10) == bytes([195, 196, 197, 198, 199, 0, 1, 2, 3, 4])
    assert read_range(log400, 390, 1000) == bytes(range(190, 200))


def test_read_range_at_the_end_is_empty(log400: str) -> None:
    assert read_range(log400, 400, 10) == b""


def test_read_range_past_the_end_names_the_cursor(log400: str) -> None:
    with pytest.raises(CursorOutOfRange, match=r"cursor 500 is beyond the end of stdout \(400 "):
        read_range(log400, 500, 10)
    with pytest.raises(CursorOutOfRange, match="cursor -1"):
        read_range(log400, -1, 10)


def test_the_cursor_error_is_the_one_every_face_maps_and_stays_a_value_error(
    log400: str,
) -> None:
    with pytest.raises(errors.CursorOutOfRange) as caught:
        read_range(log400, 401, 1)
    assert CursorOutOfRange is errors.CursorOutOfRange
    assert isinstance(caught.value, ValueError)
    assert not isinstance(caught.value, errors.SettledError)
    assert (caught.value.cursor, caught.value.end, caught.value.stream) == (401, 400, "stdout")


def test_read_range_of_a_stream_not_yet_created(tmp_path: Path) -> None:
    path = str(tmp_path / "stderr.log")
    assert stored_length(path) == 0
    assert read_range(path, 0, 10) == b""
    with pytest.raises(CursorOutOfRange, match="cursor 1 is beyond the end of stderr"):
        read_range(path, 1, 10)


def _concurrent_writer(path: Path, chunks: list[bytes]) -> tuple[threading.Thread, list[int]]:
    final: list[int] = []

    def run() -> None:
        writer = StreamWriter(str(path))
        for piece in chunks:
            writer.append(piece)
            time.sleep(0.002)
        final.append(writer.close().cursor)  # published only after close (fsync)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, final


def test_follow_yields_exactly_what_a_concurrent_writer_wrote_and_stops(tmp_path: Path) -> None:
    rng = random.Random(3)
    chunks = [rng.randbytes(rng.randint(1, 50_000)) for _ in range(60)]
    path = tmp_path / "stdout.log"
    thread, final = _concurrent_writer(path, chunks)
    got = b"".join(
        follow(
            str(path),
            0,
            lambda: final[0] if final else None,
            chunk=7_000,
            poll_interval=0.001,
            timeout=20,
        )
    )
    thread.join(timeout=20)
    assert got == b"".join(chunks)


def test_follow_never_yields_past_the_final_cursor(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    write_log(path, b"a" * 100 + b"b" * 100).close()
    assert b"".join(follow(str(path), 10, lambda: 100, chunk=7, timeout=5)) == b"a" * 90


def test_follow_from_a_middle_cursor_yields_exactly_the_remainder(tmp_path: Path) -> None:
    data = random.Random(4).randbytes(300_000)
    path = tmp_path / "stdout.log"
    thread, final = _concurrent_writer(
        path, [data[i : i + 30_000] for i in range(0, 300_000, 30_000)]
    )
    thread.join(timeout=20)
    resume = 123_457  # as if a client had read this far and reconnected
    got = b"".join(follow(str(path), resume, lambda: final[0], chunk=10_000, timeout=5))
    assert got == data[resume:]
    with pytest.raises(CursorOutOfRange, match="cursor 300001"):
        list(follow(str(path), 300_001, lambda: final[0], timeout=5))


def test_follow_times_out_naming_the_cursor_reached(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    writer = write_log(path, b"x" * 1234)  # still open: no final cursor
    got: list[bytes] = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="cursor 1234"):
        got.extend(follow(str(path), 0, lambda: None, poll_interval=0.01, timeout=0.2))
    assert 0.2 <= time.monotonic() - started < 2
    assert b"".join(got) == b"x" * 1234
    writer.close()


def test_follow_waits_for_a_log_that_does_not_exist_yet(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    thread, final = _concurrent_writer(path, [b"late", b" bytes"])
    got = b"".join(
        follow(str(path), 0, lambda: final[0] if final else None, poll_interval=0.001, timeout=10)
    )
    thread.join(timeout=10)
    assert got == b"late bytes"


# --- model view -------------------------------------------------------------------------------


def test_model_view_returns_text_unchanged_when_it_fits(tmp_path: Path) -> None:
    text = "line one\r\nline two\n\ttabbed é € 😀\x00 end"
    path = tmp_path / "stdout.log"
    write_log(path, text.encode()).close()
    assert model_view(str(path), len(text.encode())) == text
    assert model_view(str(tmp_path / "stderr.log"), 100, stream="stderr") == ""


def test_model_view_counts_replacement_chars_at_three_bytes(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    write_log(path, b"ok\xff\xfe").close()  # 4 stored bytes decode to 8 UTF-8 bytes
    assert model_view(str(path), 8) == "ok\ufffd\ufffd"
    assert len(model_view(str(path), 7).encode()) <= 7


def test_model_view_of_a_4mib_line_fits_the_budget_with_exact_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(5)
    letters = bytes(ord("a") + i % 26 for i in range(256))
    data = rng.randbytes(4 << 20).translate(letters)  # one 4 MiB line, no newline
    path = tmp_path / "stdout.log"
    write_log(path, data).close()
    budget = 4096
    read: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, size: int, offset: int) -> bytes:
        read.append(size)
        return real_pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    view = model_view(str(path), budget, session="s-123")
    monkeypatch.undo()
    assert sum(read) <= 2 * budget  # head and tail only, never the whole file
    assert len(view.encode()) <= budget
    head, a, b, tail = split_view(view)
    assert "settled logs s-123 --stream stdout --from" in view
    assert head.encode() == data[:a] and tail.encode() == data[b:]
    assert a + (b - a) + (len(data) - b) == len(data)
    assert 1800 <= a <= 2048 and 1800 <= len(data) - b <= 2048  # roughly half and half


@pytest.mark.parametrize("budget", [*range(128, 700, 7), 2048, 5000])
def test_model_view_cuts_multibyte_text_only_at_character_boundaries(
    tmp_path: Path, budget: int
) -> None:
    rng = random.Random(budget)
    text = "".join(rng.choice(["a", "é", "€", "😀", "\n"]) for _ in range(3000))
    data = text.encode()
    path = tmp_path / "stdout.log"
    write_log(path, data).close()
    view = model_view(str(path), budget)
    assert len(view.encode()) <= budget
    assert "\ufffd" not in view
    head, a, b, tail = split_view(view)
    assert head.encode() == data[:a] and tail.encode() == data[b:]
    assert a <= b


def test_render_view_with_invalid_bytes_keeps_budget_and_exact_marker() -> None:
    rng = random.Random(6)
    data = rng.randbytes(50_000)
    for budget in (128, 200, 333, 1000, 4096):
        view = render_view(data[:budget], data[-budget:], len(data), budget, "stderr")
        assert len(view.encode()) <= budget
        head, a, b, tail = split_view(view)
        assert head == data[:a].decode("utf-8", "replace")
        assert tail == data[b:].decode("utf-8", "replace")


def test_model_view_below_the_marker_size_is_the_short_marker_cut_to_budget(
    tmp_path: Path,
) -> None:
    path = tmp_path / "stdout.log"
    write_log(path, b"z" * 5000).close()
    short = "[settled: omitted stdout bytes 0..5000]"
    assert model_view(str(path), 100) == short
    assert model_view(str(path), 20) == short[:20]
    assert model_view(str(path), 0) == ""
    for budget in range(0, 128):
        assert len(model_view(str(path), budget).encode()) <= budget


def test_a_window_from_a_cursor_shows_exactly_its_bytes_with_the_marker_it_is_given(
    tmp_path: Path,
) -> None:
    data = ("aé€😀" * 2000).encode()
    path = tmp_path / "stdout.log"
    write_log(path, data).close()
    start, end = 1001, len(data) - 999  # the window stops short of what is stored
    marker = "\n[settled: omitted {stream} bytes {a}..{b} ({n} bytes); cursor={a}]\n"
    for budget in (0, 30, 150, 1000, 4096):
        window = read_window(str(path), start, end, budget, "stdout", "s_x", marker=marker)
        assert (window.start, window.end) == (start, end)
        assert len(window.text.encode()) <= budget
        if budget >= 150:  # room for the whole marker: head [start, a) and tail [b, end)
            assert window.omitted is not None
            a, b = window.omitted
            head, _, rest = window.text.partition("\n[settled: omitted")
            assert f"cursor={a}]" in rest and rest.split("]\n", 1)[1].encode() == data[b:end]
            assert head.encode() == data[start:a]
    whole = read_window(str(path), start, end, 2 * (end - start), "stdout")
    assert whole.omitted is None and whole.text.encode() == data[start:end]
    with pytest.raises(CursorOutOfRange, match=f"cursor {end + 1} is beyond the end of stdout"):
        read_window(str(path), end + 1, end, 100, "stdout")


def test_the_model_view_is_the_window_of_the_whole_stream(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(20_000)
    path = tmp_path / "stderr.log"
    write_log(path, data).close()
    for budget in (0, 100, 999, 30_000):
        window = read_window(str(path), 0, len(data), budget, "stderr", "s_1")
        assert model_view(str(path), budget, stream="stderr", session="s_1") == window.text


def test_stream_path_names_only_known_streams(tmp_path: Path) -> None:
    assert stream_path(str(tmp_path), "stdout") == str(tmp_path / "stdout.log")
    with pytest.raises(ValueError, match="unknown stream"):
        stream_path(str(tmp_path), "stdin")


def test_bytes_stored_past_a_settled_streams_final_cursor_are_never_served(
    rt: Runtime, task: TaskRecord
) -> None:
    """Recovery may close a lost owner's log in place (no room to copy it): bytes that owner
    appends later lie past the final cursor, and no read or view of the stream shows them."""
    admission = rt.exec(task.task, shell="printf proven")
    rt.wait(admission.session, timeout=30)
    assert rt.final_cursor(admission.session, "stdout") == len(b"proven")
    with open(log_path(rt.home, admission.session, "stdout"), "ab") as late:
        late.write(b" and appended after the receipt")
    assert rt.read(admission.session, "stdout", 0, 1 << 20) == b"proven"
    assert "appended" not in rt.view(admission.session, "stdout", 4096)
    with pytest.raises(CursorOutOfRange):
        rt.read(admission.session, "stdout", len(b"proven") + 1, 10)
