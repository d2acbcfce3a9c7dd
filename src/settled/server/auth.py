"""Bearer-token authentication and task scopes of the HTTP service.

Owns: loading the token table (``SETTLED_TOKEN`` for full access, and an optional JSON tokens
file of scoped tokens), the constant-time check of a presented token against every configured
one, and the ASGI middleware that answers 401 on every path but ``/healthz``.

Must never: keep a token in clear once loaded (only SHA-256 digests are held), stop comparing at
the first match (the time taken must not depend on which token matched, or on how much of one
did), log or echo a presented token, or let the service start with no token at all.

Tokens file::

    {"tokens": [{"token": "...", "tasks": "*"}, {"token": "...", "tasks": ["t_..."]}]}

A ``"*"`` token sees and creates every task; a list-scoped token sees only those tasks (their
sessions, logs, receipts, explain) and cannot create tasks. Anything outside its scope answers
exactly as if it did not exist (404).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from settled.errors import BadInput
from settled.server.page import OPEN_PATHS as PAGE_PATHS

TOKEN_ENV = "SETTLED_TOKEN"
MIN_TOKEN_CHARS = 16
OPEN_PATHS = frozenset({"/healthz"}) | PAGE_PATHS  # the page holds no data (server/page.py)
GRANT_SCOPE_KEY = "settled.grant"


class TokenConfigError(BadInput):
    """The configured tokens cannot be used; the service refuses to start."""


@dataclass(frozen=True)
class Grant:
    """What one token may do: every task (``tasks is None``) or exactly these tasks."""

    tasks: frozenset[str] | None

    @property
    def creates_tasks(self) -> bool:
        return self.tasks is None

    def sees(self, task: str) -> bool:
        return self.tasks is None or task in self.tasks

    def describe(self) -> str:
        return "*" if self.tasks is None else ",".join(sorted(self.tasks))


FULL_ACCESS = Grant(None)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenTable:
    """Configured tokens (as digests) and their grants."""

    def __init__(self, entries: Iterable[tuple[str, Grant]] = ()) -> None:
        self._entries: list[tuple[bytes, Grant]] = []
        seen: set[bytes] = set()
        for token, grant in entries:
            _check_token(token)
            digest = _digest(token)
            if digest in seen:
                raise TokenConfigError("the same token is configured twice; give each one scope")
            seen.add(digest)
            self._entries.append((digest, grant))

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def load(cls, env: Mapping[str, str], tokens_file: str | None = None) -> TokenTable:
        """``SETTLED_TOKEN`` (full access) plus the tokens file's entries, if one is named."""
        entries: list[tuple[str, Grant]] = []
        full = env.get(TOKEN_ENV)
        if full is not None and full.strip():
            entries.append((full.strip(), FULL_ACCESS))
        if tokens_file is not None:
            entries += read_tokens_file(tokens_file)
        return cls(entries)

    def authenticate(self, presented: str) -> Grant | None:
        """The grant of the configured token equal to ``presented``, or None.

        Compares SHA-256 digests (fixed length) with ``hmac.compare_digest`` against every
        configured token without stopping early, so timing reveals neither which token matched
        nor how many bytes of one did.
        """
        digest = _digest(presented)
        found: Grant | None = None
        for known, grant in self._entries:
            if hmac.compare_digest(known, digest):
                found = grant
        return found


def _check_token(token: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenConfigError(
            f"a configured token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            '(for example `python -c "import secrets; print(secrets.token_urlsafe(32))"`)'
        )


def read_tokens_file(path: str) -> list[tuple[str, Grant]]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise TokenConfigError(f"tokens file {path!r} cannot be read: {exc.strerror}") from exc
    except ValueError as exc:
        raise TokenConfigError(f"tokens file {path!r} is not JSON: {exc}") from exc
    items = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise TokenConfigError(f'tokens file {path!r} needs {{"tokens": [...]}} at its top')
    return [_entry(path, index, item) for index, item in enumerate(items)]


def _entry(path: str, index: int, item: Any) -> tuple[str, Grant]:
    where = f"tokens file {path!r}, entry {index}"
    if not isinstance(item, dict) or set(item) - {"token", "tasks"}:
        raise TokenConfigError(f'{where}: expected {{"token": "...", "tasks": "*" | [...]}}')
    token, tasks = item.get("token"), item.get("tasks")
    if not isinstance(token, str) or not token.strip():
        raise TokenConfigError(f"{where}: `token` must be a non-empty string")
    if tasks == "*":
        return token.strip(), FULL_ACCESS
    if not isinstance(tasks, list) or not all(isinstance(t, str) and t for t in tasks):
        raise TokenConfigError(f'{where}: `tasks` must be "*" or a list of task ids')
    return token.strip(), Grant(frozenset(tasks))


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class BearerAuth:
    """ASGI middleware: 401 without a known bearer token, except on ``OPEN_PATHS``.

    On success the request's grant is put in the ASGI scope under ``GRANT_SCOPE_KEY``.
    """

    def __init__(self, app: ASGIApp, tokens: TokenTable) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = bearer_token(scope["headers"])
        grant = None if presented is None else self.tokens.authenticate(presented)
        if grant is None:
            why = "missing bearer token" if presented is None else "bearer token not recognised"
            await _unauthorized(send, why)
            return
        scope[GRANT_SCOPE_KEY] = grant
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, why: str) -> None:
    body = json.dumps(
        {
            "error": "Unauthorized",
            "message": f"{why}: send `Authorization: Bearer <token>` "
            f"(the server's {TOKEN_ENV} or a token from its tokens file)",
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b'Bearer realm="settled"'),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
