"""`settled serve` with many idle SSE followers: every stream ends with its last word, and the
service answers while they wait. A real server process, real sessions, 100 real followers on
raw sockets (each its own TCP connection, read by an asyncio loop in this process).

What must hold (behaviour only; a timeout here is a hang guard, never a measure): a follower of
a session's events ends with `event: end` carrying the receipt once its session ends; a
follower still open when the server stops ends with `event: stop` (for a session's events, its
id is the cursor to resume from); none is cut; an idle stream gets keep-alive comments (a live
view whose board moves may get events instead); and `/healthz` answers while every follower
waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pg
import pytest
import s3
from test_server import TOKEN, Server, new_task, settle_all

from settled.server.feed import MIN_GAP_S, ChangeFeed

GATED_SESSIONS = 5
PER_GATED = 16  # followers of each gated session's stdout
OPEN_FOLLOWERS = 10  # of a session still running when the server stops
LIVE_FOLLOWERS = 10  # of /v1/events?follow=1
HANG_GUARD_S = 45.0  # each wait; pytest-timeout bounds the whole test
GATED = "echo started; while [ ! -e gate ]; do sleep 0.1; done; echo done"
RUNNING = "echo started; exec sleep 600"


@dataclass
class Follower:
    path: str
    events: list[tuple[str, str | None, str]] = field(default_factory=list)
    comments: int = 0
    how: str | None = None  # "clean" (the chunked body ended), "cut", or an error
    ready: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def last(self) -> str | None:
        return self.events[-1][0] if self.events else None


async def _read(host: str, port: int, follower: Follower) -> None:
    """One SSE stream over HTTP/1.1 to its end, recording its events and how it ended."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"GET {follower.path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}"
            "\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n")[0]:
            follower.how = f"answered {head!r} {await reader.read(4096)!r}"
            return
        buffer = b""
        while True:
            size = int((await reader.readline()).strip() or b"-1", 16)
            if size < 0:
                follower.how = "cut"
                break
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                follower.how = "clean"
                break
            buffer += chunk[:-2]
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                _record(follower, block.decode())
        writer.close()
    except BaseException as exc:  # reported by the assertions on `how`
        follower.how = follower.how or f"error {exc!r}"
    finally:
        follower.ready.set()
        follower.done.set()


def _record(follower: Follower, block: str) -> None:
    if block.startswith(":"):
        follower.comments += 1
        return
    fields = dict(line.split(": ", 1) for line in block.split("\n"))
    follower.events.append((fields.get("event", "message"), fields.get("id"), fields["data"]))
    follower.ready.set()


@pytest.fixture
def followers() -> Iterator[Callable[[str, list[str]], list[Follower]]]:
    """Open followers on a loop of their own thread; every one is awaited at the end."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    opened: list[Follower] = []
    running: list[concurrent.futures.Future[None]] = []

    def open_all(url: str, paths: list[str]) -> list[Follower]:
        where = urlsplit(url)
        made = [Follower(path) for path in paths]
        for follower in made:  # each future held: a task nobody holds may be collected
            running.append(asyncio.run_coroutine_threadsafe(
                _read(str(where.hostname), int(where.port or 80), follower), loop
            ))  # fmt: skip
        opened.extend(made)
        return made

    try:
        yield open_all
    finally:
        for follower in opened:
            follower.done.wait(HANG_GUARD_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _heard(follower: Follower) -> bool:
    """A keep-alive came, or (a live view whose board moves, e.g. heartbeats on PostgreSQL)
    an event after the first: the stream is not left silent."""
    return bool(follower.comments) or (
        follower.path.startswith("/v1/events") and len(follower.events) > 1
    )


def _all(followers: list[Follower], what: str) -> None:
    give_up = time.monotonic() + HANG_GUARD_S
    for follower in followers:
        assert getattr(follower, what).wait(max(0.0, give_up - time.monotonic())), follower


def _await(check: Callable[[], bool], what: Callable[[], str]) -> None:
    give_up = time.monotonic() + HANG_GUARD_S
    while not check():
        assert time.monotonic() < give_up, f"hang guard: {what()}"
        time.sleep(0.05)


@pytest.mark.parametrize("backends", ["sqlite+local", "postgresql+s3"])
def test_every_followed_stream_ends_with_its_sessions_end_or_the_servers_stop(
    tmp_path: Path,
    home: Path,
    workspace: Path,
    followers: Callable[[str, list[str]], list[Follower]],
    backends: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if backends == "postgresql+s3":  # the test servers (tests/pg.py, tests/s3.py)
        request.getfixturevalue("pg_cluster")
        request.getfixturevalue("s3_env")
        monkeypatch.setenv("SETTLED_STORE", pg.url_for_directory(str(home)))
        monkeypatch.setenv("SETTLED_OBJECTS", f"s3://{s3.VERSIONED_BUCKET}/{s3.fresh_prefix()}")
    server = Server(home, tmp_path / "serve.log", None, {"SETTLED_SSE_KEEPALIVE_S": "0.5"})
    try:
        with server.client() as client:
            task = new_task(client, workspace)

            def start(key: str, shell: str) -> str:
                answer = client.post(f"/v1/tasks/{task}/sessions", json={"key": key,
                                     "argv": ["sh", "-c", shell]})  # fmt: skip
                assert answer.status_code == 201, answer.text
                return str(answer.json()["session"])

            gated = [start(f"gated-{n}", GATED) for n in range(GATED_SESSIONS)]
            running = start("running", RUNNING)
        ending = followers(server.url, [
            f"/v1/sessions/{s}/events?stream=stdout" for s in gated for _ in range(PER_GATED)
        ])  # fmt: skip
        staying = followers(
            server.url,
            [f"/v1/sessions/{running}/events?stream=stdout"] * OPEN_FOLLOWERS
            + ["/v1/events?follow=1"] * LIVE_FOLLOWERS,
        )
        _all(ending + staying, "ready")  # every stream answered its first event

        everyone = ending + staying
        _await(
            lambda: all(_heard(f) for f in everyone),
            lambda: f"a keep-alive on every idle stream: {[f for f in everyone if not _heard(f)]}",
        )
        for _ in range(5):  # the service answers while every follower waits
            assert httpx.get(server.url + "/healthz", timeout=HANG_GUARD_S).json() == {"ok": True}
        assert not any(f.done.is_set() for f in everyone), [f for f in everyone if f.how]

        (workspace / "gate").write_bytes(b"")
        _all(ending, "done")
        for follower in ending:
            assert (follower.how, follower.last) == ("clean", "end"), follower
            receipt = json.loads(follower.events[-1][2])
            assert receipt["exit"]["code"] == 0, receipt
            assert follower.events[-1][1] == str(len(b"started\ndone\n"))
        assert not any(f.done.is_set() for f in staying), [f for f in staying if f.how]
    finally:
        server.stop()
    _all(staying, "done")
    for follower in staying:
        assert (follower.how, follower.last) == ("clean", "stop"), follower
    for follower in staying[:OPEN_FOLLOWERS]:  # its id resumes after the bytes it was sent
        assert follower.events[-1][1] == str(len(b"started\n")), follower
        assert json.loads(follower.events[-1][2])["cursor"] == len(b"started\n")
    settle_all(home)


@pytest.mark.parametrize(
    ("spent", "rest"),
    [
        (0.0, MIN_GAP_S),  # a cheap refresh: the minimum gap from its start
        (0.01, MIN_GAP_S - 0.01),
        (0.05, 0.2),  # past the minimum: four times its cost, so at most a fifth of the time
        (0.5, 2.0),  # a board of thousands of sessions rests two seconds, whatever nudges it
    ],
)
def test_the_live_view_rests_long_enough_that_refreshing_takes_at_most_a_fifth(
    spent: float, rest: float
) -> None:
    assert ChangeFeed._gap(100.0, 100.0 + spent) == pytest.approx(rest)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path
