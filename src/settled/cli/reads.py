"""The read verbs an agent calls between every two commands (`status`, `ps`, `ls`), and the
quick path that parses their plain command lines without argparse.

Why: an agent makes hundreds of tool calls a task, and `settled status` is the one it repeats.
argparse, with gettext and locale, costs as much as the interpreter's own start; these command
lines are a verb, one id and a few flags. `parse_quick` reads exactly those and answers None for
anything else (help, an unknown or abbreviated option, a value that does not pass its grammar,
a missing or extra word), which the full parser (`cli/parser.py`) then parses and words as it
always has. tests/test_startup.py checks that both parsers agree on every line the quick one
takes.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from settled import grammar
from settled.cli.frame import emit
from settled.errors import EXIT_OK, SettledError
from settled.printable import printable
from settled.render import status_text

TYPE_CHECKING = False
if TYPE_CHECKING:
    from argparse import Namespace
    from collections.abc import Callable
    from typing import Any

    from settled.runtime import Runtime


def cmd_status(rt: Runtime, args: Namespace) -> int:
    target: str = args.target
    view = rt.task_status(target) if target.startswith("t_") else rt.session_status(target)
    emit(args, view, status_text(view))
    return EXIT_OK


def cmd_ls(rt: Runtime, args: Namespace) -> int:
    rows = rt.list_tasks(args.limit)
    now = time.time()
    table: list[tuple[str, ...]] = [("TASK", "STATE", "SESSIONS", "AGE", "WORKSPACE")]
    for row in rows:
        state = _task_state(row)
        sessions = f"{row['sessions']}" + (f" ({row['live']} live)" if row["live"] else "")
        table.append((
            printable(row["task"]), printable(state), sessions, _age(now - row["created_at"]),
            printable(row["workspace"]),
        ))  # fmt: skip
    text = _table(table) if rows else "no tasks in this home (create one: settled task new)"
    emit(args, {"tasks": rows}, text, brief="\n".join(r["task"] for r in rows) or None)
    return EXIT_OK


def cmd_ps(rt: Runtime, args: Namespace) -> int:
    view = rt.task_status(args.task)
    table: list[tuple[str, ...]] = [
        ("SESSION", "KEY", "STATE", "EXIT", "OUT/ERR BYTES", "DURATION", "COMMAND")
    ]
    for s in view["sessions"]:
        code = _exit_column(s.get("exit") or {})
        cursors = s.get("cursors") or {}
        started, ended = s.get("started_at"), s.get("settled_at")
        took = _age((ended or time.time()) - started) if started else "-"
        table.append((
            printable(s["session"]), printable(s["key"]), printable(s["state"]),
            printable(code), f"{cursors.get('stdout', 0)}/{cursors.get('stderr', 0)}", took,
            _shorten(printable(s.get("command") or ""), 60),
        ))  # fmt: skip
    text = _table(table) if view["sessions"] else f"task {args.task} has no sessions"
    emit(args, view, text, brief="\n".join(s["session"] for s in view["sessions"]) or None)
    return EXIT_OK


def _task_state(row: dict[str, Any]) -> str:
    """The task's state, and whether its close proved completion when that is not the same
    word: `complete` once, `sealed (not complete)`, `complete (not complete)` for a close
    that ended without proof."""
    state: str = row["state"]
    if "complete" not in row or (row["complete"] and state == "complete"):
        return state
    return state + (" (complete)" if row["complete"] else " (not complete)")


def _exit_column(exit_fact: dict[str, Any]) -> str:
    """The exit code, else the signal that ended it (SIGKILL), else `-` (none yet, or it never
    started: the STATE column and `settled status` say which)."""
    if exit_fact.get("code") is not None:
        return str(exit_fact["code"])
    if exit_fact.get("signal") is not None:
        return f"SIG{exit_fact['signal']}"
    return "-"


def _age(seconds: float) -> str:
    """A duration the way `ps` and `docker ps` show one: the largest unit that fits."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.1f}s"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# -- the quick parse ---------------------------------------------------------------------------

LS_LIMIT = (1, 100_000, 50)  # --limit: lowest, highest, default (the full parser's too)

# verb -> (its handler, the name of its one positional and that word's grammar field)
_POSITIONAL: dict[str, tuple[Callable[[Runtime, Namespace], int], str | None, str]] = {
    "status": (cmd_status, "target", "target"),
    "ps": (cmd_ps, "task", "task"),
    "ls": (cmd_ls, None, ""),
}
_FLAGS = {"--json": "json", "-q": "quiet", "--quiet": "quiet", "--debug": "debug"}
_VALUES = ("--home", "--store", "--objects")


def parse_quick(argv: list[str]) -> Namespace | None:
    """The namespace the full parser would build for a plain read verb's command line, or None
    when the line is anything else (the full parser then reads it)."""
    try:
        return _parse(argv)
    except SettledError:
        return None  # a value outside its grammar: the full parser words the refusal


def _parse(argv: list[str]) -> Namespace | None:
    found: dict[str, object] = {}
    words: list[str] = []
    verb: str | None = None
    at = 0
    while at < len(argv):
        word = argv[at]
        at += 1
        name, eq, inline = word.partition("=")
        if word in _FLAGS:
            found[_FLAGS[word]] = True
        elif name in _VALUES or (verb == "ls" and name == "--limit"):
            if eq:
                value = inline
            elif at < len(argv) and not argv[at].startswith("-"):
                value, at = argv[at], at + 1
            else:
                return None
            found[name.removeprefix("--")] = value
        elif word.startswith("-"):
            return None  # help, `--`, an unknown or abbreviated option: the full parser's
        elif verb is None:
            if word not in _POSITIONAL:
                return None
            verb = word
        else:
            words.append(word)
    if verb is None:
        return None
    handler, positional, field = _POSITIONAL[verb]
    if len(words) != (1 if positional else 0):
        return None
    if "home" in found:
        found["home"] = grammar.check_path("--home", str(found["home"]))
    if positional is not None:
        found[positional] = grammar.check_id(field, words[0])
    if verb == "ls":
        low, high, default = LS_LIMIT
        limit = found.get("limit")
        found["limit"] = default if limit is None else grammar.parse_int(
            "--limit", str(limit), low, high
        )  # fmt: skip
    parsed = SimpleNamespace(verb=verb, handler=handler, **found)
    return parsed  # type: ignore[return-value]  # the attributes argparse would set, no more
