"""What a zygote imports for the homes it serves whose evidence lives outside them, once, so
that no owner it forks pays the import.

An owner of a home bound to PostgreSQL loads psycopg and its store (~0.14 s of CPU here), and
one whose home seals its logs to S3 loads boto3 and makes a client (~0.3 s), each in every
owner: that was most of a remote owner's CPU (issue 39). A zygote notes each request's home
(`Remote.note`) and, when its refill is due (forking.Refill: after the caller has its answer,
before the spare is forked), imports what that home's backends need through their seams
(`store.load_implementation(home)`, `objects.prepare_object_store`: an S3 client made and
rehearsed without a request), then freezes the heap again, so that each fork shares those
pages copy-on-write and its collector never walks them. The first caller of a home waits for
none of it (that first owner imports what it needs itself, as before). An embedded home
imports nothing more.

SETTLED_DEBUG_ZYGOTE_MODULES (the zygote's own environment) names a file where it writes the
names of its modules after each refill, for tests.

Must never: open a connection or start a thread (the zygote forks: a fork would share the
one, and lose the other), or fail a launch (a home it cannot prepare is named on its log,
and its owners import what they need).
"""

from __future__ import annotations

import contextlib
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, ClassVar


class Remote:
    """The homes a zygote was asked for and has not prepared yet, and those it has."""

    pending: ClassVar[dict[str, dict[str, str]]] = {}  # home -> the environment its owners get
    prepared: ClassVar[set[str]] = set()

    @classmethod
    def note(cls, request: dict[str, Any]) -> None:
        home = str(request["home"])
        if home not in cls.prepared:
            cls.pending.setdefault(home, dict(request["env"]))

    @classmethod
    def prepare(cls) -> None:
        """Import what each noted home's owners need (once a home), then freeze the heap
        again: the collector of every fork never walks those objects either."""
        pending, cls.pending = cls.pending, {}
        imported = False
        for home, env in pending.items():
            cls.prepared.add(home)
            try:
                imported |= _import_remote(home, env)
            except Exception as exc:  # the owner imports it itself, and says why
                _say(f"could not prepare the remote backends of {home}: {exc!r}")
        if imported:
            import gc

            gc.freeze()
        _debug_modules()


def _import_remote(home: str, env: dict[str, str]) -> bool:
    """Import the remote backends `home` is bound to; True if anything was."""
    from settled import store
    from settled.backends import seals_logs
    from settled.objects import prepare_object_store

    imported = store.load_implementation(home)
    if seals_logs(home) and prepare_object_store(home, env):
        from settled.log import seal  # noqa: F401 - what the owner runs to seal its logs

        imported = True
    return imported


def _debug_modules() -> None:
    path = os.environ.get("SETTLED_DEBUG_ZYGOTE_MODULES")
    if path:
        import sys

        with contextlib.suppress(OSError), open(path, "w") as handle:
            handle.write("\n".join(sorted(sys.modules)) + "\n")


def _say(message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"zygote[{os.getpid()}] {message}\n".encode(errors="replace"))
