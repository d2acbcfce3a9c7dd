"""`settled probe --runtime http://HOST:PORT`: a settled service through its HTTP API.

Every call goes through `settled.client` with the token in SETTLED_TOKEN; a lost response is a
real one (the admission's POST on a raw connection closed before its reply is read). What the
API has no endpoint for (a restore, a write naming a generation) it says it cannot reach
(`CannotLook`); killing an owner is possible only when the service runs on this machine, which
`settled_backends.owner_here` decides by boot id and start time.
Must never: take an unreachable service or a refused token for an answer (both are bad input).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from settled.client import Blocked, Client, ClientError
from settled.errors import BadInput
from settled.probe.settled_backends import (
    CLOSE_DEADLINE_S,
    WAIT_S,
    Admitted,
    CannotLook,
    ProbeBroke,
)
from settled.states import UNKNOWN, is_live


class HttpBackend:
    """settled as a service: its HTTP API through `settled.client` (SETTLED_TOKEN)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadInput(f"--runtime {url!r} is neither a runtime name nor an http(s) URL")
        self.url = url.rstrip("/")
        token = os.environ.get("SETTLED_TOKEN", "")
        self.token = token
        self.client = Client(self.url, token or None, timeout=WAIT_S)
        self.version = self._reach()
        self.where = f"the service at {self.url}"
        self.on_this_machine = False  # decided per owner, by boot id and start time

    def _reach(self) -> str:
        """The service's version; BadInput (one line, exit 2) when it cannot be reached or
        refuses the token."""
        import httpx

        try:
            httpx.get(self.url + "/healthz", timeout=5.0).raise_for_status()
            answer = httpx.get(
                self.url + "/openapi.json", timeout=5.0,
                headers={"Authorization": f"Bearer {self.token}"},
            )  # fmt: skip
        except httpx.HTTPError as exc:
            raise BadInput(f"no settled service answers at {self.url}: {exc}") from None
        if answer.status_code in (401, 403):
            raise BadInput(f"the service at {self.url} refuses the token in SETTLED_TOKEN")
        info = answer.json().get("info", {}) if answer.status_code == 200 else {}
        return str(info.get("x-settled-version") or f"unknown (API {info.get('version', '?')})")

    def new_task(self) -> str:
        return str(self.client.new_task(None)["task"])

    def exec(self, task: str, shell: str, key: str, env: dict[str, str],
             timeout: float | None = None, grace: float | None = None) -> Admitted:  # fmt: skip
        a = self.client.exec(
            task, shell=shell, key=key, env=env, timeout=timeout, grace=grace, clean_env=True
        )  # as the raw POST of lose_response: one digest
        return Admitted(a.session, a.reused, a.state)

    def refusal(self, task: str, shell: str, key: str, env: dict[str, str]) -> str | None:
        try:
            self.exec(task, shell, key, env)
        except ClientError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def lose_response(self, task: str, shell: str, key: str, env: dict[str, str]) -> str:
        """The admission's POST sent on a raw connection that is closed, its reply unread,
        once the session is in the store."""
        parts = urlsplit(self.url)
        if parts.scheme != "http":
            self.exec(task, shell, key, env)
            return "the first exec's reply was dropped unread (https: not on a raw socket)"
        body = json.dumps({"key": key, "shell": shell, "env": env}).encode()
        port = parts.port or 80
        raw = socket.create_connection((parts.hostname or "", port), timeout=10)
        try:
            raw.sendall(
                f"POST /v1/tasks/{task}/sessions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            give_up = time.monotonic() + 20
            while not self.task_sessions(task) and time.monotonic() < give_up:
                time.sleep(0.01)
        finally:
            raw.close()
        return "the first POST reached the store and its connection was closed, the reply unread"

    def wait(self, session: str, timeout: float = WAIT_S) -> dict[str, Any]:
        return self.client.wait(session, timeout)

    def status(self, session: str) -> dict[str, Any]:
        return self.client.status(session)

    def task_sessions(self, task: str) -> list[str]:
        return [str(row["session"]) for row in self.client.task_status(task)["sessions"]]

    def output(self, session: str) -> bytes:
        return b"".join(self.client.stream(session, "stdout", via="output"))

    def peek(self, session: str) -> bytes:
        with contextlib.suppress(ClientError):
            return self.client.output(session, "stdout", 0)[0]
        return b""

    def read_file(self, task: str, name: str) -> bytes:
        """Through the service: a `cat` in the task (the workspace is the service's)."""
        key = f"probe-cat-{secrets.token_hex(4)}"
        admitted = self.exec(task, f"cat {name} 2>/dev/null || true", key, {})
        self.wait(admitted.session)
        return self.output(admitted.session)

    def close_task(self, task: str) -> dict[str, Any]:
        try:
            return self.client.close_task(task, deadline=CLOSE_DEADLINE_S)
        except Blocked as exc:
            raise ProbeBroke(f"close of {task} is blocked on {exc.blocked_on}") from None

    def explain(self, task: str) -> dict[str, Any]:
        return self.client.explain(task)

    def recover(self, task: str) -> list[dict[str, Any]]:
        return list(self.client.recover(task)["sessions"])

    def in_checkpoint(self, task: str, name: str) -> bytes | None:
        raise CannotLook("the HTTP API has no restore: the checkpoint's bytes stay the service's")

    def stale_write(self, task: str) -> str | None:
        raise CannotLook("the HTTP API has no write that names a generation")

    def finish(self, task: str) -> list[str]:
        done: list[str] = []
        view = self.client.task_status(task)
        if view["state"] == "complete":
            return done
        for row in view["sessions"]:
            if is_live(str(row["state"])):
                with contextlib.suppress(ClientError):
                    self.client.signal(str(row["session"]), "KILL", "the probe is over")
                    done.append(f"cancelled {row['session']}")
        for row in view["sessions"]:
            with contextlib.suppress(ClientError):
                self.client.wait(str(row["session"]), WAIT_S)
        if any(r["state"] == UNKNOWN for r in self.client.task_status(task)["sessions"]):
            self.client.recover(task)
            done.append("recovered its unknown sessions")
        self.close_task(task)
        return done

    def owners(self, task: str) -> list[dict[str, Any]]:
        rows = self.client.task_status(task)["sessions"]
        return [self.client.status(str(r["session"])).get("owner") or {} for r in rows]

    def close(self) -> None:
        self.client.close()
