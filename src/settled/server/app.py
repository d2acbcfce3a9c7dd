"""The HTTP service's routes: a thin async shell over ``settled.server.views`` and ``streams``.

Owns: the route table (paths, methods and status codes of DESIGN.md's HTTP contract, and the
OpenAPI document at ``/openapi.json`` that describes exactly these routes), the service's
lifespan (a Runtime pool sharing one warm launcher, a recovery pass at start and every 10 s,
the live view's feed), the choice of status code for each answer, and the page at ``/ui``
(server/page.py), nudging the feed after every write so the page sees it at once.

Must never: call the Runtime on the event loop (every call goes through the pool), wait on a
worker thread for a session (waits poll from the loop), cancel a session because a request or a
stream ended, or answer anything but ``/healthz`` and the page's static files without a known
bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from settled import faults, grammar
from settled.errors import BadInput
from settled.requests import ExecRequest, TaskRequest
from settled.runtime import Runtime
from settled.server import bodies, streams, views
from settled.server.auth import GRANT_SCOPE_KEY, BearerAuth, Grant, TokenTable
from settled.server.errors import EXCEPTION_HANDLERS
from settled.server.feed import ChangeFeed, parse_event_id
from settled.server.follow import FollowHub
from settled.server.jsonbody import AsciiJSONResponse
from settled.server.openapi import document
from settled.server.page import FILES as PAGE_FILES
from settled.server.page import Page
from settled.server.pool import RECOVER_EVERY_S, Recoverer, RuntimePool, recover_once
from settled.states import SETTLED

MAX_WAIT_S = grammar.MAX_HTTP_WAIT_S  # a long poll holds a connection (settled.grammar)


class Service:
    """The state one app holds: its home, its tokens and (while running) its Runtime pool."""

    def __init__(self, home: str, tokens: TokenTable) -> None:
        self.home, self.tokens = home, tokens
        self._pool: RuntimePool | None = None
        self._recoverer: Recoverer | None = None
        self._feed: ChangeFeed | None = None
        self._hub: FollowHub | None = None

    @property
    def pool(self) -> RuntimePool:
        if self._pool is None:
            raise RuntimeError("the service is not running (its lifespan has not started)")
        return self._pool

    @property
    def feed(self) -> ChangeFeed:
        if self._feed is None:
            raise RuntimeError("the service is not running (its lifespan has not started)")
        return self._feed

    @property
    def hub(self) -> FollowHub:
        if self._hub is None:
            raise RuntimeError("the service is not running (its lifespan has not started)")
        return self._hub

    async def start(self) -> None:
        self._pool = RuntimePool(self.home)
        await self._pool.call(recover_once)  # sessions whose owner died while we were down
        notifies = await self._pool.call(store_notifies)
        self._hub = FollowHub(self._pool)
        self._feed = ChangeFeed(self._pool, notifies, self._hub.stopping)
        self._recoverer = Recoverer(self.home, self._pool.launcher, RECOVER_EVERY_S)
        self._recoverer.start()

    def begin_stop(self) -> None:
        """The server stops: every open event stream ends now with an ``event: stop``
        (before uvicorn's graceful wait, so each says so instead of being cut)."""
        if self._hub is not None:
            self._hub.stop()

    async def stop(self) -> None:
        self.begin_stop()
        if self._hub is not None:
            await self._hub.close()
        if self._feed is not None:
            await self._feed.stop()
        if self._recoverer is not None:
            self._recoverer.stop()
        if self._pool is not None:
            self._pool.close()
        self._pool = self._recoverer = self._feed = self._hub = None


def store_notifies(rt: Runtime) -> bool:
    """Whether the store wakes a waiter on a change (PostgreSQL NOTIFY) or only sleeps."""
    return rt.backends.store_scheme == "postgresql"


def grant_of(request: Request) -> Grant:
    grant = request.scope.get(GRANT_SCOPE_KEY)
    assert isinstance(grant, Grant), "BearerAuth runs before every route but /healthz"
    return grant


def _json(payload: Any, status: int = 200) -> AsciiJSONResponse:
    return AsciiJSONResponse(payload, status_code=status)


class Handlers:
    """One coroutine per route; each parses, asks the pool, and picks the status code."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.page = Page()

    @property
    def pool(self) -> RuntimePool:
        return self.service.pool

    async def healthz(self, _request: Request) -> Response:
        return _json({"ok": True})

    async def openapi(self, _request: Request) -> Response:
        return _json(document())

    async def create_task(self, request: Request) -> Response:
        body = TaskRequest.from_json(await bodies.json_body(request, bodies.TASK_FIELDS))
        task = await self.pool.call(views.new_task, grant_of(request), body)
        self.service.feed.nudge()
        return _json(task, 201)

    async def task_status(self, request: Request) -> Response:
        task = request.path_params["task"]
        return _json(await self.pool.call(views.task_status, grant_of(request), task))

    async def admit(self, request: Request) -> Response:
        body = ExecRequest.from_json(await bodies.json_body(request, bodies.SESSION_FIELDS))
        task = request.path_params["task"]
        admission = await self.pool.call(views.admit, grant_of(request), task, body)
        self.service.feed.nudge()
        faults.point("server.after_admission")
        return _json(admission, 200 if admission["reused"] else 201)

    async def close(self, request: Request) -> Response:
        body = bodies.close_request(await bodies.json_body(request, bodies.CLOSE_FIELDS))
        task = request.path_params["task"]
        self.service.feed.nudge()  # the close seals at once: show it, then its receipt
        complete, answer = await self.pool.call_long(
            views.close, grant_of(request), task, body["final"], body["deadline"]
        )
        self.service.feed.nudge()
        faults.point("server.before_close_response")
        return _json(answer, 200 if complete else 409)

    async def explain(self, request: Request) -> Response:
        task = request.path_params["task"]
        return _json(await self.pool.call(views.explain, grant_of(request), task))

    async def recover(self, request: Request) -> Response:
        body = await bodies.json_body(request, bodies.RECOVER_FIELDS)
        task = bodies.recover_request(body)
        return _json(await self.pool.call(views.recover, grant_of(request), task))

    async def session(self, request: Request) -> Response:
        """The status view; with ``?wait=S`` it first waits up to S seconds for the receipt
        (from the event loop, no thread held), and answers 202 if it is not there yet. The
        wait wakes when the owner exits (it records the receipt just before), so a short
        command's receipt is answered then, not at the next look; the looks remain for an
        owner elsewhere or none yet."""
        session = request.path_params["session"]
        wait_s = bodies.query_wait(request, MAX_WAIT_S)
        grant = grant_of(request)
        view = await self.pool.call(views.session_status, grant, session)
        if wait_s and not views.is_settled(view):
            view = await self._await_settled(grant, session, time.monotonic() + wait_s)
        if wait_s and view["state"] != SETTLED:  # recovery runs itself, as a CLI wait's does
            view = await self.pool.call(views.recover_lost, grant, session)
        return _json(view, 202 if wait_s and not views.is_settled(view) else 200)

    async def _await_settled(self, grant: Grant, session: str, give_up: float) -> dict[str, Any]:
        handle = await self.pool.call(views.exit_handle, grant, session)
        exited = asyncio.Event()
        loop = asyncio.get_running_loop()
        if handle is not None:
            loop.add_reader(handle, exited.set)
        try:
            pause = 0.005
            while True:
                view = await self.pool.call(views.session_status, grant, session)
                if views.is_settled(view) or time.monotonic() >= give_up:
                    return view
                seconds = max(0.0, min(pause, give_up - time.monotonic()))
                if handle is None or exited.is_set():  # nothing left to wake us: look again
                    await asyncio.sleep(seconds)
                    pause = min(pause * 1.5, 0.1)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(exited.wait(), seconds)
                pause = min(pause * 1.5, 1.0)  # the owner's exit wakes us before this
        finally:
            if handle is not None:
                loop.remove_reader(handle)
                os.close(handle)

    async def signal(self, request: Request) -> Response:
        name, reason = bodies.signal_request(await bodies.json_body(request, bodies.SIGNAL_FIELDS))
        session = request.path_params["session"]
        delivered, answer = await self.pool.call(
            views.signal, grant_of(request), session, name, reason
        )
        self.service.feed.nudge()
        return _json(answer, 202 if delivered else 200)

    async def _facts(self, request: Request) -> streams.StreamFacts:
        session = request.path_params["session"]
        stream = bodies.query_stream(request)
        log, final, stored = await self.pool.call(
            views.stream_facts, grant_of(request), session, stream
        )
        return streams.StreamFacts(session, stream, log, final, stored)

    async def output(self, request: Request) -> Response:
        start = bodies.cursor_value(request.query_params.get("from", "0"), "from")
        follow = bodies.query_flag(request, "follow")
        max_bytes = bodies.query_max(request)
        if follow and max_bytes is not None:
            raise BadInput("max and follow=1 cannot be combined: a follow ends at the end")
        facts = await self._facts(request)
        return streams.raw_response(self.pool, self.service.hub, facts, start, follow, max_bytes)

    async def merged(self, request: Request) -> Response:
        start = bodies.cursor_value(request.query_params.get("from", "0"), "from")
        size = bodies.query_max(request) or 1 << 20
        session = request.path_params["session"]
        return _json(await self.pool.call(views.merged, grant_of(request), session, start, size))

    async def events(self, request: Request) -> Response:
        start = bodies.query_cursor(request)
        facts = await self._facts(request)
        return streams.events_response(self.pool, self.service.hub, facts, start)

    async def clocks(self, request: Request) -> Response:
        task = request.path_params["task"]
        return _json(await self.pool.call(views.clocks, grant_of(request), task))

    async def live(self, request: Request) -> Response:
        """The tasks this token sees with their clocks: a snapshot (or, with Last-Event-ID,
        what changed since), then with ``follow=1`` every change as it is seen."""
        resume = parse_event_id(request.headers.get("last-event-id"))
        follow = bodies.query_flag(request, "follow")
        body = self.service.feed.events(grant_of(request), resume, follow)
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)


def routes(h: Handlers) -> list[Route]:
    return [
        Route("/healthz", h.healthz, methods=["GET"]),
        Route("/openapi.json", h.openapi, methods=["GET"]),
        Route("/v1/tasks", h.create_task, methods=["POST"]),
        Route("/v1/tasks/{task}", h.task_status, methods=["GET"]),
        Route("/v1/tasks/{task}/sessions", h.admit, methods=["POST"]),
        Route("/v1/tasks/{task}/close", h.close, methods=["POST"]),
        Route("/v1/tasks/{task}/explain", h.explain, methods=["GET"]),
        Route("/v1/sessions/{session}", h.session, methods=["GET"]),
        Route("/v1/sessions/{session}/output", h.output, methods=["GET"]),
        Route("/v1/sessions/{session}/events", h.events, methods=["GET"]),
        Route("/v1/sessions/{session}/merged", h.merged, methods=["GET"]),
        Route("/v1/sessions/{session}/signal", h.signal, methods=["POST"]),
        Route("/v1/recover", h.recover, methods=["POST"]),
        Route("/v1/tasks/{task}/clocks", h.clocks, methods=["GET"]),
        Route("/v1/events", h.live, methods=["GET"]),
        *(Route(path, h.page.serve, methods=["GET"]) for path in PAGE_FILES),
    ]


def create_app(home: str, tokens: TokenTable) -> Starlette:
    """The ASGI app over the settled home ``home``; refuses an empty token table."""
    if len(tokens) == 0:
        raise ValueError("no token configured: the service never runs open")
    service = Service(home, tokens)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = Starlette(
        routes=routes(Handlers(service)),
        middleware=[Middleware(BearerAuth, tokens=tokens)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.begin_stop = service.begin_stop  # serve() calls it as uvicorn starts to stop
    return app
