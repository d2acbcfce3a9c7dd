"""What a verb imports: an agent pays settled's start-up on every tool call, so a verb loads
only the modules it needs (issue 15). Each case runs the real CLI in a fresh interpreter and
reads `sys.modules` at exit; bench/startup.py measures what this saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import stop_journals

# Modules no read-only verb may load: the checkpoint code, the close join, recovery, the
# launchers, the sandboxes and every face but the CLI.
HEAVY = (
    "settled.workspace.checkpoint",
    "settled.workspace.scan",
    "settled.close.join",
    "settled.recovery",
    "settled.owner.launcher",
    "settled.owner.zygote",
    "settled.boundary.sandbox",
    "settled.boundary.cgroup2",
    "settled.server",
    "settled.mcp_server",
    "settled.client",
    "pathspec",
    "starlette",
    "httpx",
    "mcp",
)

PROBE = (
    "import atexit, json, sys\n"
    "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
    "from settled.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _modules_of(argv: list[str], home: Path) -> set[str]:
    env = {**os.environ, "SETTLED_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return set(json.loads(done.stderr.decode().strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def closed_task(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    """A home with one task that ran a command and closed: a session, logs and a receipt.
    Its journal daemon is stopped at the end (the per-test teardown sees only tmp_path)."""
    from settled.runtime import Runtime

    home = tmp_path_factory.mktemp("home")
    with Runtime(str(home)) as rt:
        task = rt.new_task().task
        session = rt.exec(task, argv=["echo", "hi"]).session
        rt.wait(session, timeout=30)
        assert rt.close_task(task).complete
    try:
        yield home, task, session
    finally:
        stop_journals(home)


@pytest.mark.parametrize(
    "verb",
    [
        ["status", "{task}", "--json"],
        ["status", "{session}", "--json"],
        ["ls", "--json"],
        ["ps", "{task}"],
        ["logs", "{session}"],
        ["explain", "{task}", "--json"],
        ["hosts"],
    ],
    ids=lambda verb: " ".join(verb),
)
def test_read_only_verbs_do_not_import_the_checkpoint_the_server_or_mcp(
    closed_task: tuple[Path, str, str], verb: list[str]
) -> None:
    home, task, session = closed_task
    argv = [word.format(task=task, session=session) for word in verb]
    loaded = _modules_of(argv, home)
    assert "settled.runtime" in loaded  # the probe saw the verb run
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == [], f"`settled {' '.join(verb)}` imported {heavy}"


# What the standard library would add to every `settled status` if let in: argparse brings
# gettext and locale, dataclasses brings inspect (ast, dis, tokenize), hashlib loads OpenSSL,
# typing is a module as large as the rest; together they cost more than the interpreter's start.
NOT_ON_THE_READ_PATH = ("argparse", "dataclasses", "inspect", "typing", "_hashlib")


@pytest.mark.parametrize(
    "verb",
    [["status", "{task}", "--json"], ["status", "{session}"], ["ps", "{task}"], ["ls", "-q"]],
    ids=lambda verb: " ".join(verb),
)
def test_plain_read_verbs_load_none_of_the_costly_standard_library(
    closed_task: tuple[Path, str, str], verb: list[str]
) -> None:
    home, task, session = closed_task
    argv = [word.format(task=task, session=session) for word in verb]
    loaded = _modules_of(argv, home)
    assert "settled.runtime" in loaded  # the probe saw the verb run
    assert sorted(set(NOT_ON_THE_READ_PATH) & loaded) == []


QUICK_LINES = [
    ["status", "t_0123456789abcdef"],
    ["status", "s_0123456789abcdef", "--json"],
    ["--json", "status", "t_0123456789abcdef", "-q", "--debug"],
    ["--home", "/tmp/h", "status", "--home=/tmp/other", "t_0123456789abcdef"],
    ["status", "t_0123456789abcdef", "--store", "sqlite:///tmp/x.db", "--objects=file:///o"],
    ["ps", "t_0123456789abcdef", "--quiet"],
    ["ls"],
    ["ls", "--limit", "7", "--json"],
    ["ls", "--limit=100000"],
    ["--home=/tmp/h", "ls", "--json", "--json"],
]
NOT_QUICK = [
    [],
    ["status"],
    ["status", "t_1", "t_2"],
    ["status", "--help"],
    ["status", "-h", "t_0123456789abcdef"],
    ["status", "--js", "t_0123456789abcdef"],  # an abbreviation: argparse's to accept
    ["status", "--home", "t_0123456789abcdef"],
    ["status", "--home", "-x", "t_0123456789abcdef"],
    ["status", "--", "t_0123456789abcdef"],
    ["status", "bad id!"],
    ["--limit", "5", "ls"],
    ["ls", "--limit", "0"],
    ["ls", "--limit", "ten"],
    ["ps"],
    ["logs", "s_0123456789abcdef"],
    ["task", "new"],
    ["--version"],
]


def test_the_quick_parse_of_a_read_verb_is_the_full_parsers_or_none() -> None:
    """Every line the quick path takes gives the namespace argparse gives; every other line is
    left to argparse, so help, abbreviations and refusals read as they always have."""
    from settled.cli.parser import build_parser
    from settled.cli.reads import parse_quick

    for argv in QUICK_LINES:
        quick = parse_quick(argv)
        assert quick is not None, argv
        assert vars(quick) == vars(build_parser().parse_args(argv)), argv
    for argv in NOT_QUICK:
        assert parse_quick(argv) is None, argv


def test_a_refused_read_verb_line_is_worded_by_the_full_parser(tmp_path: Path) -> None:
    env = {**os.environ, "SETTLED_HOME": str(tmp_path)}
    for argv, words in ((["status"], "required"), (["ls", "--limit", "0"], "--limit")):
        done = subprocess.run(
            [sys.executable, "-m", "settled", *argv, "--json"], env=env, capture_output=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert words in done.stderr.decode(), done.stderr
        assert "error" in json.loads(done.stdout)


def test_version_imports_nothing_but_the_package(tmp_path: Path) -> None:
    from settled import __version__

    done = subprocess.run(
        [sys.executable, "-m", "settled", "--version"], capture_output=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.decode().strip() == f"settled {__version__}"
    loaded = _modules_of(["--version"], tmp_path)
    ours = sorted(m for m in loaded if m.startswith("settled"))
    assert ours == ["settled", "settled.cli"], ours
    assert "argparse" not in loaded


def test_a_verb_parsed_alone_parses_as_the_whole_parser_does() -> None:
    """The one-verb parser must give the same namespace, and its errors the whole parser's."""
    from settled.cli.parser import UsageError, _named_verb, build_parser, parse

    lines = [
        ["--json", "status", "t_0123456789abcdef"],
        ["--home", "/tmp/h", "run", "--task", "t_0123456789abcdef", "--env", "A=1", "--", "ls"],
        ["task", "new", "--ignore", ".venv/", "-q"],
        ["logs", "s_0123456789abcdef", "--stream", "stderr", "--from", "5"],
    ]
    for argv in lines:
        assert vars(parse(argv)) == vars(build_parser().parse_args(argv)), argv
    assert _named_verb(["--help", "status"]) is None  # the whole list of verbs, not one
    assert _named_verb(["--home", "status", "ls"]) == "ls"
    for bad in (["bogus"], ["status"], ["--home"], ["run", "--task"]):
        with pytest.raises(UsageError) as alone:
            parse(bad)
        with pytest.raises(UsageError) as whole:
            build_parser().parse_args(bad)
        assert str(alone.value) == str(whole.value), bad


def test_run_does_not_import_the_checkpoint_the_server_or_mcp(tmp_path: Path) -> None:
    """`settled run` admits, relays and exits: the checkpoint code is the close's, not its."""
    from settled.runtime import Runtime

    with Runtime(str(tmp_path)) as rt:
        task = rt.new_task().task
    try:
        loaded = _modules_of(["run", "--task", task, "--", "true"], tmp_path)
        forbidden = ("settled.workspace.checkpoint", "settled.server", "settled.mcp_server")
        assert [m for m in forbidden if m in loaded] == []
        assert "settled.relay" in loaded
        heavy = ("typing", "dataclasses", "inspect", "socket")  # ~10 ms the call never uses
        assert [m for m in heavy if m in loaded] == []
    finally:
        with Runtime(str(tmp_path)) as rt:
            assert rt.close_task(task).complete  # the run's session settled; its journal stops
