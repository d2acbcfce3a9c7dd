"""Human views escape what a command controls (printable.py): the escape's cases, its
unambiguity, and real `settled` processes whose views of a hostile session, key, workspace and
file name hold no byte a terminal would obey, while --json and `logs` stay as they were."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from settled.printable import printable, printable_tree, surrogates_escaped
from settled.render import blocked_text, close_text, receipt_text, status_text

SETTLED = [sys.executable, "-m", "settled.cli"]
ERASE_AND_RETURN = "\x1b[2K\r"  # erase the row, go back to its start: the next text forges it
RTL_OVERRIDE = "\u202e"  # bidi: the rest of the row reads right to left
OSC8_LINK = "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"


def unprintable(view: str) -> str:
    """Read a view back: the inverse the scheme promises (tests only; nothing needs it)."""
    parts = []
    at = 0
    escape = re.compile(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")
    while at < len(view):
        if view[at] != "\\":
            parts.append(view[at])
            at += 1
            continue
        found = escape.match(view, at)
        assert found is not None, f"a lone backslash at {at} of {view!r}"
        code = found.group(1)
        if code == "\\":
            parts.append("\\")
        elif code[0] == "x":
            byte = int(code[1:], 16)
            assert byte < 0x20 or byte >= 0x7F, f"\\x{byte:02x} escapes a printable character"
            parts.append(chr(byte) if byte <= 0x7F else chr(0xDC00 + byte))
        else:
            parts.append(chr(int(code[1:], 16)))
        at = found.end()
    return "".join(parts)


# -- the function ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("\x1b[2K\rforged row", "\\x1b[2K\\x0dforged row"),  # C0: ESC, CR
        ("a\bb\tc\nd\x00e\x7f", "a\\x08b\\x09c\\x0ad\\x00e\\x7f"),  # BS, TAB, LF, NUL, DEL
        ("\x85\x9b2K", "\\u0085\\u009b2K"),  # C1: NEL and the one-byte CSI
        ("\u202aa\u202bb\u202cc\u202dd\u202ee", "\\u202aa\\u202bb\\u202cc\\u202dd\\u202ee"),
        ("\u2066a\u2067b\u2068c\u2069", "\\u2066a\\u2067b\\u2068c\\u2069"),  # bidi isolates
        ("zero\u200bwidth\u200d\ufeff\u00ad", "zero\\u200bwidth\\u200d\\ufeff\\u00ad"),  # Cf
        ("line\u2028para\u2029", "line\\u2028para\\u2029"),  # the separators
        ("tag\U000e0041\U000e007f", "tag\\U000e0041\\U000e007f"),  # invisible tag characters
        ("back\\slash", "back\\\\slash"),  # the escape's own character
        ("name-\udcff\udc80", "name-\\xff\\x80"),  # os.fsdecode of b"name-\xff\x80"
        ("\ud800\udc00\udfff", "\\ud800\\udc00\\udfff"),  # surrogates no byte made
        ("é 中文 ß emoji 🙂 ~!", "é 中文 ß emoji 🙂 ~!"),  # printable UTF-8 is itself
        ("", ""),
    ],
)
def test_each_class_of_character_is_escaped_as_documented(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert unprintable(shown) == text


def test_printable_text_is_returned_as_it_is() -> None:
    text = "pytest -q tests/ && echo 'done' # é 中文"
    assert printable(text) is text


def test_the_byte_a_surrogate_stands_for_is_shown_as_the_byte() -> None:
    name = os.fsdecode(b"report-\xe9\x1b.txt")  # Latin-1 é: not UTF-8
    assert printable(name) == "report-\\xe9\\x1b.txt"


def test_distinct_texts_give_distinct_views() -> None:
    tricky = [
        "\x1b", "\\x1b", "\\\\x1b", "\\", "\\\\",
        "\x85", "\udc85", "\\x85", "\\u0085",
        "\x80", "\udcc2\udc80", "\\xc2\\x80",
        "\n", "\\x0a", "\\n", "\r\n", "\\x0d\\x0a",
        "\u202e", "\\u202e", "\U0000202e", "\\U0000202e",
        "\U000e0041", "\\U000e0041", "\ud800", "\\ud800", "\udcff", "\xff", "ÿ", "\\xff",
        "a\x1bb", "a\\x1bb", "a\\\x1bb",
    ]  # fmt: skip
    views = [printable(text) for text in tricky]
    assert len(set(views)) == len(set(tricky)), sorted(views)
    for text, view in zip(tricky, views, strict=True):
        assert unprintable(view) == text


def test_every_code_point_is_shown_printably_and_read_back() -> None:
    every = "".join(map(chr, range(0x110000)))
    view = printable(every)
    assert view.isprintable()
    assert unprintable(view) == every


def test_random_texts_of_hostile_characters_read_back_exactly() -> None:
    alphabet = "\\x1bu0a[2K\x1b\r\n\x85\u202e\u2066\udcff\udc80\ud800é中 "
    draw = random.Random(36)
    for _ in range(3000):
        text = "".join(draw.choice(alphabet) for _ in range(draw.randrange(12)))
        view = printable(text)
        assert view.isprintable() and unprintable(view) == text, (text, view)


def test_a_tree_is_escaped_in_every_string_and_key_and_nothing_else() -> None:
    tree = {"key\x1b": ["a\rb", 7, None, {"n": 1.5, "\u202e": True}], "t": ("x\\",)}
    assert printable_tree(tree) == {
        "key\\x1b": ["a\\x0db", 7, None, {"n": 1.5, "\\u202e": True}],
        "t": ["x\\\\"],
    }


def test_surrogates_alone_are_escaped_for_a_strict_utf8_transport() -> None:
    tree = {"text": "line\nname-\udcff\ud800 \\ é", "n": [1, "\udc80"]}
    assert surrogates_escaped(tree) == {"text": "line\nname-\\xff\\ud800 \\ é", "n": [1, "\\x80"]}
    assert surrogates_escaped("ok é") == "ok é"


# -- the renderings ----------------------------------------------------------------------------

HOSTILE = f"echo ok{ERASE_AND_RETURN}{RTL_OVERRIDE}forged \\ \udcff"
SHOWN = "echo ok\\x1b[2K\\x0d\\u202eforged \\\\ \\xff"


def _receipt() -> dict[str, Any]:
    stream = {"cursor": 3, "digest": "blake3:" + "0" * 64}
    return {
        "session": "s_1", "task": "t_1", "key": f"k{RTL_OVERRIDE}{ERASE_AND_RETURN}",
        "exit": {"reason": "not_started", "stage": "exec", "error": f"no {HOSTILE}"},
        "death": {"proven": True, "evidence": "cgroup empty", "boundary": "b", "source": "o"},
        "output": {"stdout": stream, "stderr": stream, "drain": "complete"},
        "isolation": {"missing": {"view": f"cannot bind {HOSTILE}"}},
        "stragglers": [{"pid": 9, "cmdline": HOSTILE, "stopped_by": "cgroup.kill"}],
        "owner": {"role": "launcher", "pid": 1},
        "digest": "sha256:" + "0" * 64,
    }  # fmt: skip


def _assert_terminal_safe(text: str) -> None:
    assert all(ch == "\n" or ch.isprintable() for ch in text), repr(text)
    text.encode("utf-8")  # a strict UTF-8 terminal takes it: no lone surrogate left


def test_receipt_and_status_text_escape_the_commands_words_once() -> None:
    receipt = _receipt()
    text = receipt_text(receipt)
    _assert_terminal_safe(text)
    assert f"`{SHOWN}`" in text and "key k\\u202e\\x1b[2K\\x0d" in text
    view = {"session": "s_1", "state": "settled", "boundary": "b", "command": HOSTILE}
    shown = status_text({**view, "why": HOSTILE, "receipt": receipt})
    _assert_terminal_safe(shown)
    assert f"command: {SHOWN}" in shown and f"`{SHOWN}`" in shown  # escaped once, not twice
    task_view = {"task": "t_1", "state": "open", "workspace": f"/w/{HOSTILE}", "sessions": [
        {"session": "s_1", "key": RTL_OVERRIDE, "command": HOSTILE, "state": "running"}
    ]}  # fmt: skip
    listed = status_text(task_view)
    _assert_terminal_safe(listed)
    assert f"workspace /w/{SHOWN}" in listed and f"key \\u202e `{SHOWN}`" in listed


def test_close_and_blocked_text_escape_keys_and_obligations() -> None:
    receipt = {
        "task": "t_1", "sessions": ["s_1"], "digest": "sha256:0",
        "checkpoint": {"manifest": "m", "entries": 1, "watermark": 1,
                       "read_back": {"verified": True}},
        "fence": {"fenced_generation": 1, "generation": 2},
        "outcome": {"commands": {"failed": [f"s_1 ({HOSTILE})"]},
                    "all_commands_succeeded": False},
    }  # fmt: skip
    text = close_text(receipt)
    _assert_terminal_safe(text)
    assert f"failed: s_1 ({SHOWN})" in text
    blocked = blocked_text("t_1", {"authority": "owner", "obligation": HOSTILE})
    _assert_terminal_safe(blocked)
    assert SHOWN in blocked


def test_json_of_a_lone_surrogate_is_ascii_and_does_not_crash(tmp_path: Path) -> None:
    """What --json prints (`emit`), on a stdout that encodes strictly, as a pipe's does."""
    script = (
        "import argparse; from settled.cli.frame import emit; "
        "emit(argparse.Namespace(json=True), {'path': 'a\\udcff\\x1b'}, 'unused')"
    )
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=30, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b'{"path": "a\\udcff\\u001b"}\n'


# -- real command lines ------------------------------------------------------------------------


class CLI:
    def __init__(self, home: Path) -> None:
        self.env = {**os.environ, "SETTLED_HOME": str(home)}

    def run(self, *args: str, code: int = 0) -> bytes:
        done = subprocess.run(
            [*SETTLED, *args], capture_output=True, timeout=120, env=self.env
        )  # fmt: skip
        assert done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
        return done.stdout

    def json(self, *args: str, code: int = 0) -> dict[str, Any]:
        at = args.index("--") if "--" in args else len(args)
        payload: dict[str, Any] = json.loads(self.run(*args[:at], "--json", *args[at:], code=code))
        return payload


def _assert_no_terminal_orders(out: bytes, verb: str) -> None:
    """No control byte but the newline, no ESC, no C1 and no bidi control, in UTF-8 text."""
    text = out.decode("utf-8")  # strict: a lone surrogate would have failed to print
    assert not [b for b in out if b < 0x20 and b != 0x0A], (verb, out)
    assert all(ch == "\n" or ch.isprintable() for ch in text), (verb, text)


@pytest.fixture
def cli(tmp_path: Path) -> CLI:
    return CLI(tmp_path / "home")


def test_listing_verbs_escape_a_hostile_workspace_key_and_command(cli: CLI, tmp_path: Path) -> None:
    workspace = tmp_path / f"ws{ERASE_AND_RETURN}{RTL_OVERRIDE}x"
    workspace.mkdir()
    task_key = f"task{RTL_OVERRIDE}\\key"  # a key holds no control character (grammar)
    task = cli.json("task", "new", "--workspace", str(workspace), "--key", task_key)
    shell = f"printf 'out{ERASE_AND_RETURN}forged\\n'; : '{OSC8_LINK}{RTL_OVERRIDE}'"
    by_shell = cli.json("exec", "--task", task["task"], "--key", f"k{RTL_OVERRIDE}1", "--", shell)
    by_argv = cli.json(
        "exec", "--task", task["task"], "--key", f"k{RTL_OVERRIDE}2",
        "--", "echo", f"argv{ERASE_AND_RETURN}", OSC8_LINK,
    )  # fmt: skip
    for admitted in (by_shell, by_argv):
        assert cli.json("wait", admitted["session"])["exit"]["code"] == 0
    shown_ws = printable(str(workspace))
    assert "\\x1b[2K\\x0d\\u202ex" in shown_ws
    views = {
        "ls": cli.run("ls"),
        "ps": cli.run("ps", task["task"]),
        "status task": cli.run("status", task["task"]),
        "status session": cli.run("status", by_shell["session"]),
        "wait": cli.run("wait", by_argv["session"]),
        "task new": cli.run("task", "new", "--workspace", str(workspace), "--key", task_key),
    }
    for verb, out in views.items():
        _assert_no_terminal_orders(out, verb)
    assert shown_ws.encode() in views["ls"] and shown_ws.encode() in views["status task"]
    assert b"k\\u202e1" in views["ps"] and b"k\\u202e2" in views["ps"]
    assert b"out\\x1b[2K\\x0dforged" in views["status session"]
    assert b"argv\\x1b[2K\\x0d" in views["status task"]
    assert b"\\x1b]8;;https://evil.example/\\x1b\\\\click" in views["status task"]
    assert b"task\\u202e\\\\key" in views["task new"]
    # the JSON is the truth, and the command's own output is relayed as it was written
    assert cli.json("status", by_argv["session"])["key"] == f"k{RTL_OVERRIDE}2"
    assert cli.run("logs", by_shell["session"]) == f"out{ERASE_AND_RETURN}forged\n".encode()


@pytest.mark.skipif(os.geteuid() != 0, reason="a set-id file of another owner needs root")
def test_a_checkpoint_path_with_an_escape_and_a_newline_is_escaped_where_it_is_listed(
    cli: CLI, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    name = f"evil{ERASE_AND_RETURN}\nsettled: COMPLETE{RTL_OVERRIDE}"
    prog = workspace / name
    prog.write_bytes(b"#!/bin/sh\nid\n")
    os.chown(prog, 65534, 65534)
    os.chmod(prog, 0o4755)  # restored without --same-owner: its set-id bits dropped, by path
    task = cli.json("task", "new", "--workspace", str(workspace))
    closed = cli.run("close", task["task"])
    explained = cli.run("explain", task["task"])
    restored = cli.run("restore", task["task"], str(tmp_path / "restored"))
    for verb, out in (("close", closed), ("explain", explained), ("restore", restored)):
        _assert_no_terminal_orders(out, verb)
    assert b"dropped (not earned by this restore): evil\\x1b[2K\\x0d\\x0a" in restored
    assert b"settled: COMPLETE\\u202e" in restored
    as_json = cli.json("restore", task["task"], str(tmp_path / "again"))
    assert as_json["setid_dropped"] == [name]
    assert (tmp_path / "restored" / name).is_file()


def test_an_error_line_quoting_a_callers_text_is_escaped(cli: CLI, tmp_path: Path) -> None:
    missing = tmp_path / f"no{ERASE_AND_RETURN}such{RTL_OVERRIDE}"
    done = subprocess.run(
        [*SETTLED, "task", "new", "--workspace", str(missing)],
        capture_output=True, timeout=60, env=cli.env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = done.stderr.decode("utf-8")
    assert line.count("\n") == 1 and line.endswith("\n")
    assert all(ch == "\n" or ch.isprintable() for ch in line), line
    # the message quotes the path as Python's repr does; the escape doubles repr's backslashes,
    # so the line still reads back to exactly the message
    assert "--workspace '" + str(tmp_path) + "/no\\\\x1b[2K\\\\rsuch\\\\u202e'" in line
