"""Both streams in the order the owner stored them: real commands, real owners, real files."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from conftest import COMMAND_PYTHON
from test_server import (  # noqa: F401
    TOKEN,
    Server,
    home,
    new_task,
    receipt_of,
    run,
    server,
    start_server,
    workspace,
)

from settled.client import Client
from settled.home import session_dir
from settled.log import interleave
from settled.records import TaskRecord
from settled.runtime import Runtime

ALTERNATE = (
    "import sys, time\n"
    "for i in range(6):\n"
    "    s = sys.stdout if i % 2 == 0 else sys.stderr\n"
    "    s.buffer.write(b'%d\\xff\\x00|' % i); s.flush(); time.sleep(0.1)\n"
)
EXPECTED = b"".join(b"%d\xff\x00|" % i for i in range(6))


def _merged(chunks: list[interleave.Chunk]) -> bytes:
    return b"".join(c.data for c in chunks)


def _run(rt: Runtime, task: TaskRecord, argv: list[str], key: str) -> str:
    admission = rt.exec(task.task, argv=argv, key=key)
    rt.wait(admission.session, timeout=30)
    return admission.session


def test_alternating_writes_come_back_merged_in_order_binary_safe(
    rt: Runtime, task: TaskRecord
) -> None:
    session = _run(rt, task, [COMMAND_PYTHON, "-c", ALTERNATE], "alt")
    chunks = rt.read_merged(session)
    assert _merged(chunks) == EXPECTED
    assert [c.stream for c in chunks] == ["stdout", "stderr"] * 3
    assert all(c.ordered for c in chunks)
    # each stream's projection is exactly its log
    for name in ("stdout", "stderr"):
        got = b"".join(c.data for c in chunks if c.stream == name)
        assert got == rt.read(session, name)


def test_a_merged_cursor_resumes_anywhere(rt: Runtime, task: TaskRecord) -> None:
    session = _run(rt, task, [COMMAND_PYTHON, "-c", ALTERNATE], "resume")
    for start in range(len(EXPECTED) + 1):
        assert _merged(rt.read_merged(session, start)) == EXPECTED[start:]
        assert _merged(rt.read_merged(session, start, size=3)) == EXPECTED[start : start + 3]


def test_follow_merged_while_running_ends_at_both_final_cursors(
    rt: Runtime, task: TaskRecord
) -> None:
    admission = rt.exec(task.task, argv=[COMMAND_PYTHON, "-c", ALTERNATE], key="follow")
    got = b"".join(c.data for c in rt.follow_merged(admission.session, timeout=30))
    assert got == EXPECTED


def test_a_session_whose_owner_died_reads_merged_up_to_the_recovered_cursors(
    rt: Runtime, task: TaskRecord
) -> None:
    script = ALTERNATE.replace("range(6)", "range(100000)").replace("0.1", "0.01")
    admission = rt.exec(task.task, argv=[COMMAND_PYTHON, "-c", script], key="dead")
    session = admission.session
    deadline = time.monotonic() + 20
    while rt.store.get_session(session).stderr_durable < 40:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    owner = rt.store.get_session(session).owner
    assert owner is not None
    os.kill(owner.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while True:
        facts = rt.owner_facts(rt.store.get_session(session))
        if facts is not None and not facts.alive:
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    rt.recover()
    receipt = rt.store.get_session(session).receipt
    assert receipt is not None
    cursors = {n: int(receipt["output"][n]["cursor"]) for n in ("stdout", "stderr")}
    chunks = rt.read_merged(session, size=1 << 30)
    for name in ("stdout", "stderr"):
        got = b"".join(c.data for c in chunks if c.stream == name)
        assert got == rt.read(session, name, size=1 << 30)
        assert len(got) == cursors[name]
    ordered = _merged([c for c in chunks if c.ordered])
    # the ordered part alternates record by record as the command wrote it
    assert ordered.startswith(EXPECTED)


def test_an_old_session_without_an_index_falls_back_stdout_then_stderr_flagged(
    rt: Runtime, task: TaskRecord
) -> None:
    session = _run(rt, task, [COMMAND_PYTHON, "-c", ALTERNATE], "old")
    os.unlink(interleave.index_path(session_dir(rt.home, session)))
    chunks = rt.read_merged(session)
    assert [(c.stream, c.ordered) for c in chunks] == [("stdout", False), ("stderr", False)]
    assert _merged(chunks) == rt.read(session, "stdout") + rt.read(session, "stderr")


def test_an_index_claiming_more_than_the_limits_is_clamped(tmp_path: Path) -> None:
    (tmp_path / "stdout.log").write_bytes(b"abcdef")
    (tmp_path / "stderr.log").write_bytes(b"XYZ")
    writer = interleave.IndexWriter(interleave.index_path(str(tmp_path)))
    writer.record("stdout", 0, 2)
    writer.record("stderr", 0, 1)
    writer.record("stdout", 2, 6)
    writer.record("stderr", 1, 3)
    writer.close()
    full = interleave.read_merged(str(tmp_path), {"stdout": 6, "stderr": 3})
    assert _merged(full) == b"abXcdefYZ"
    cut = interleave.read_merged(str(tmp_path), {"stdout": 4, "stderr": 3})
    assert _merged(cut) == b"abXcdYZ"  # order cut at stdout 4, the rest unordered
    assert [c.ordered for c in cut] == [True, True, True, False]


def test_the_merged_route_serves_chunks_and_a_resumable_cursor(
    server: Server,  # noqa: F811 (the fixture imported above)
    workspace: Path,  # noqa: F811
) -> None:
    import base64

    with server.client() as client:
        task = new_task(client, workspace)
        session = run(client, task, "merged", argv=[COMMAND_PYTHON, "-c", ALTERNATE])
        receipt_of(client, session)
        answer = client.get(f"/v1/sessions/{session}/merged")
        assert answer.status_code == 200, answer.text
        body = answer.json()
        got = b"".join(base64.b64decode(c["data"]) for c in body["chunks"])
        assert got == EXPECTED and body["final"] is True and body["cursor"] == len(EXPECTED)
        assert [c["stream"] for c in body["chunks"]] == ["stdout", "stderr"] * 3
        rest = client.get(f"/v1/sessions/{session}/merged", params={"from": 5, "max": 4}).json()
        assert b"".join(base64.b64decode(c["data"]) for c in rest["chunks"]) == EXPECTED[5:9]
        assert rest["cursor"] == 9
        beyond = client.get(f"/v1/sessions/{session}/merged", params={"from": 999})
        assert beyond.status_code == 416, beyond.text
    with Client(server.url, TOKEN) as http:
        page = http.merged(session, 3, size=6)
        assert b"".join(base64.b64decode(c["data"]) for c in page["chunks"]) == EXPECTED[3:9]


def test_the_ordered_prefix_a_live_follow_may_serve_only_grows(tmp_path: Path) -> None:
    """A live follow serves the last record's unsynced tail as ordered while the other stream
    ends at its records. The drain writes that record's end before it stores a byte of the
    other stream, so a reader that then sees the other stream grow still finds the tail it
    served recorded: what it served is never taken back (CursorOutOfRange for its cursor)."""
    index = interleave.IndexWriter(interleave.index_path(str(tmp_path)))
    logs = {name: tmp_path / f"{name}.log" for name in ("stdout", "stderr")}
    logs["stdout"].write_bytes(b"xy")
    logs["stderr"].write_bytes(b"")
    index.before_storing("stdout")
    index.record("stdout", 0, 1)
    index.record("stdout", 1, 2)  # the same stream: its end moves in memory only
    served = interleave.ordered_limits(str(tmp_path), {"stdout": 2, "stderr": 0})
    assert served == {"stdout": 2, "stderr": 0}  # the unsynced tail, served as ordered
    index.before_storing("stderr")  # the drain, about to store stderr's first byte
    logs["stderr"].write_bytes(b"e")  # stored; the index has no stderr record yet
    later = interleave.ordered_limits(str(tmp_path), {"stdout": 2, "stderr": 1})
    assert later["stdout"] >= served["stdout"]
    index.record("stderr", 0, 1)
    index.close()
    assert interleave.ordered_limits(str(tmp_path), {"stdout": 2, "stderr": 1}) == {
        "stdout": 2, "stderr": 1,
    }  # fmt: skip
