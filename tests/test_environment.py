"""The command's environment is explicit: a base, what the caller chose, all in the digest."""

from __future__ import annotations

from pathlib import Path

import pytest

from settled.environment import (
    STANDARD_PATH,
    CallerEnv,
    base_environment,
    compose,
    from_caller,
    parse_env_file,
    standing_inherit,
)
from settled.errors import BadInput
from settled.identity import CommandSpec


def test_the_base_is_path_home_and_lang_only() -> None:
    base = base_environment(0)
    assert base == {"PATH": STANDARD_PATH, "HOME": "/root", "LANG": "C.UTF-8"}


def test_an_env_file_reads_comments_export_and_quotes(tmp_path: Path) -> None:
    path = tmp_path / "vars"
    path.write_text("# a comment\n\nexport A=1\nB='two words'\nC=\"x=y\"\nD=\n")
    assert parse_env_file(str(path)) == {"A": "1", "B": "two words", "C": "x=y", "D": ""}


@pytest.mark.parametrize("line", ["no equals sign", "1BAD=x", "=value", "BAD NAME=x"])
def test_a_malformed_env_file_line_is_refused_naming_file_and_line(
    tmp_path: Path, line: str
) -> None:
    path = tmp_path / "vars"
    path.write_text(f"GOOD=1\n{line}\n")
    with pytest.raises(BadInput, match=rf"--env-file {path}:2: "):
        parse_env_file(str(path))


def test_a_missing_env_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="cannot be read"):
        parse_env_file(str(tmp_path / "absent"))


def test_inherit_names_what_it_takes_and_refuses_an_unset_name() -> None:
    environ = {"A": "1", "B": "2"}
    assert from_caller(["A"], False, environ) == CallerEnv({"A": "1"}, ("A",), ())
    with pytest.raises(BadInput, match="--inherit C: not set"):
        from_caller(["A", "C"], False, environ)


def test_inherit_env_withholds_settled_and_credentials_by_name() -> None:
    environ = {"A": "1", "SETTLED_HOME": "/h", "AWS_SECRET_ACCESS_KEY": "s", "KEEP": "k"}
    got = from_caller(["AWS_SECRET_ACCESS_KEY"], True, environ, ["AWS_SECRET_ACCESS_KEY"])
    assert got.env == {"A": "1", "KEEP": "k", "AWS_SECRET_ACCESS_KEY": "s"}  # asked by name
    got = from_caller([], True, environ, ["AWS_SECRET_ACCESS_KEY"])
    assert got.env == {"A": "1", "KEEP": "k"}
    assert got.removed == ("AWS_SECRET_ACCESS_KEY", "SETTLED_HOME")


def test_explicit_wins_over_inherited_over_base() -> None:
    caller = CallerEnv({"PATH": "/mine", "X": "inherited"}, ("PATH", "X"), ())
    env = compose({"PATH": STANDARD_PATH, "LANG": "C"}, caller, {"X": "explicit"})
    assert env == {"PATH": "/mine", "LANG": "C", "X": "explicit"}


def test_standing_inherit_splits_commas_and_spaces() -> None:
    assert standing_inherit({"SETTLED_INHERIT": "A, B C"}) == ["A", "B", "C"]
    assert standing_inherit({}) == []


def test_every_variable_and_what_was_inherited_is_in_the_digest() -> None:
    plain = CommandSpec(argv=("env",), env=(("A", "1"),))
    other_value = CommandSpec(argv=("env",), env=(("A", "2"),))
    inherited = CommandSpec(argv=("env",), env=(("A", "1"),), inherited=("A",))
    digests = {plain.digest, other_value.digest, inherited.digest}
    assert len(digests) == 3
    with pytest.raises(BadInput, match="not in the command's env"):
        CommandSpec(argv=("env",), env=(("A", "1"),), inherited=("B",))


def test_inherit_env_withholds_what_is_named_like_a_secret_unless_asked_by_name() -> None:
    environ = {
        "OPENAI_API_KEY": "sk", "ANTHROPIC_AUTH_TOKEN": "t", "GITHUB_TOKEN": "g",
        "PGPASSWORD": "p", "DB_PASSWORD": "d", "MY_SECRET": "s", "GOOGLE_CREDENTIALS": "c",
        "SSH_PRIVATE_KEY": "k", "TOKENIZERS_PARALLELISM": "false", "KEYBOARD": "us",
        "PATH": "/bin", "SECRETARY": "no", "OPENAI_KEY": "k", "API_KEYS": "k", "DB_PASS": "p",
        "GITHUB_PAT": "p", "NPM_AUTH": "a", "SENTRY_DSN": "d", "CLIENT_SECRETS": "s",
        "DATABASE_URL": "postgresql://app:hunter2@db/app", "PIP_INDEX_URL": "https://u:p@pypi/",
        "PUBLIC_URL": "https://example.com/a:b", "PATHEXT": "x", "PASSAGE": "y",
    }  # fmt: skip
    got = from_caller(["GITHUB_TOKEN"], True, environ)
    assert got.env == {
        "GITHUB_TOKEN": "g", "TOKENIZERS_PARALLELISM": "false", "KEYBOARD": "us",
        "PATH": "/bin", "SECRETARY": "no", "PUBLIC_URL": "https://example.com/a:b",
        "PATHEXT": "x", "PASSAGE": "y",
    }  # fmt: skip
    assert got.removed == tuple(sorted(set(environ) - set(got.env)))
