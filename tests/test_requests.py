"""One request type per verb (settled.requests): the fields every face shares, each with its
grammar. Pure: the tests hand bodies and keywords to the request types and read what they say."""

from __future__ import annotations

from typing import Any

import pytest

from settled import grammar
from settled.errors import BadInput
from settled.requests import ExecRequest, TaskRequest

# The HTTP contract's body fields (DESIGN.md, server/openapi.py): written here once more on
# purpose, so a field added to or dropped from a request is a visible change of the contract.
EXEC_BODY = {
    "argv", "shell", "key", "timeout", "grace", "cwd", "env", "inherited", "service",
    "boundary", "isolation", "user",
    "writable", "readable", "memory", "pids", "cpus", "network", "allow_hosts",
}  # fmt: skip
TASK_BODY = {
    "workspace", "key", "user", "shared_workspace", "ignore",
    "writable", "readable", "memory", "pids", "cpus", "network", "allow_hosts",
}  # fmt: skip


def test_the_body_fields_are_the_contracts() -> None:
    assert ExecRequest.fields() == EXEC_BODY
    assert TaskRequest.fields() == TASK_BODY


def test_the_server_takes_the_body_fields_from_the_requests() -> None:
    from settled.server import bodies

    assert ExecRequest.fields() == bodies.SESSION_FIELDS
    assert TaskRequest.fields() == bodies.TASK_FIELDS


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            {"key": "k", "shell": "true", "timout": 5},
            "unknown field(s) \"'timout'\"; this endpoint",
        ),
        ({"key": "k", "shell": "true", "stdin": "x"}, "unknown field(s) \"'stdin'\""),  # local only
        ({"key": "k", "shell": "true", "inherit_env": True}, "unknown field(s) \"'inherit_env'\""),
        ({"shell": "true"}, "`key` is required over HTTP"),
        ({"key": "k"}, "give exactly one of `shell`"),
        ({"key": "k", "shell": "true", "argv": ["true"]}, "give exactly one of `shell`"),
        ({"key": "k", "argv": "true"}, "argv"),
        ({"key": "k", "shell": "true", "timeout": "5"}, "timeout"),  # never coerced
        ({"key": "k", "shell": "true", "env": ["A=1"]}, "env"),
        ({"key": "k", "shell": "true", "inherited": "PATH"}, "inherited"),
        ({"key": "k", "shell": "true", "boundary": "box"}, "boundary"),
        ({"key": "k", "shell": "true", "service": 1}, "service"),
    ],
)
def test_an_exec_body_is_refused_naming_what_is_wrong(body: dict[str, Any], words: str) -> None:
    with pytest.raises(BadInput) as refused:
        ExecRequest.from_json(body)
    assert words in str(refused.value)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"workspace": "/w", "timeout": 5}, "unknown field(s) \"'timeout'\""),
        ({"ignore": "*.o"}, "ignore must be a list of at most 1024 patterns"),
        ({"shared_workspace": "yes"}, "shared_workspace"),
        ({"workspace": 7}, "workspace"),
    ],
)
def test_a_task_body_is_refused_naming_what_is_wrong(body: dict[str, Any], words: str) -> None:
    with pytest.raises(BadInput) as refused:
        TaskRequest.from_json(body)
    assert words in str(refused.value)


def test_absent_and_null_fields_take_the_defaults() -> None:
    request = ExecRequest.from_json({"key": "k", "shell": "true", "cwd": None, "service": None})
    assert (request.cwd, request.service, request.boundary, request.isolation) == (
        ".",
        False,
        "auto",
        "auto",
    )
    assert (request.writable, request.allow_hosts, request.env, request.stdin) == (
        (),
        None,
        None,
        None,
    )
    assert ExecRequest.from_json({"key": "k", "shell": "true", "cwd": ""}).cwd == "."


def test_a_request_sent_is_the_request_read() -> None:
    sent = ExecRequest(
        key="k",
        argv=["make", "-j2"],
        timeout=600,
        cwd="src",
        env={"A": "1"},
        inherited=["A"],
        service=True,
        isolation="strict",
        writable=("/opt/cache",),
        memory=1 << 30,
        network="none",
        allow_hosts=[],
    )
    read = ExecRequest.from_json(sent.to_json())
    assert read.to_json() == sent.to_json()
    assert read.writable == ["/opt/cache"] and read.allow_hosts == []


def test_a_body_carries_exactly_the_options_given_in_the_table_order() -> None:
    """What the client sends: no null and no default (an empty grant list, a false flag,
    cwd "."); an empty allow_hosts is sent (it means "the public internet only", not "the
    task's")."""
    body = ExecRequest(
        key="k", shell="true", cwd=".", writable=None, readable=[], service=False,
        allow_hosts=[], inherited=[], memory=None,
    ).to_json()  # fmt: skip
    assert list(body) == ["key", "shell", "allow_hosts"]
    task = TaskRequest(workspace=None, key="k", shared_workspace=False, ignore=()).to_json()
    assert task == {"key": "k"}


def test_an_unknown_keyword_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="'timout'"):
        ExecRequest(timout=5)
    with pytest.raises(TypeError, match="'argv'"):
        TaskRequest(argv=["true"])


def test_requests_are_frozen() -> None:
    request = TaskRequest(key="k")
    with pytest.raises(AttributeError):
        request.key = "other"  # type: ignore[misc]
    assert request.replace(key="other").key == "other"


def test_the_numbers_of_a_body_pass_their_grammar() -> None:
    with pytest.raises(grammar.BadNumber, match="memory"):
        TaskRequest.from_json({"memory": "512M"})
    assert TaskRequest.from_json({"cpus": 1.5}).cpus == 1.5


def test_every_option_is_a_flag_of_its_verb_of_the_same_name() -> None:
    """A new option is a row of its request and a flag whose dest is its name: the CLI
    builds its request from the table (cli/running.py, cli/verbs.py)."""
    from settled.cli.parser import build_parser
    from settled.cli.running import FROM_WORDS

    parser = build_parser()
    exec_args = vars(parser.parse_args(["exec", "--task", "t_0123", "--", "true"]))
    task_args = vars(parser.parse_args(["task", "new"]))
    missing = [o.name for o in ExecRequest.OPTIONS if o.name not in {*exec_args, *FROM_WORDS}]
    assert missing == []
    assert [name for name in TaskRequest.fields() if name not in {*task_args, "allow_hosts"}] == []


def test_the_openapi_document_describes_every_body_field() -> None:
    """The schema a client is given (GET /v1/openapi.json) names exactly the fields a body
    may carry: the request's table is the contract, openapi.py its description."""
    from settled.server.openapi import document

    schemas = document()["components"]["schemas"]
    assert set(schemas["SessionRequest"]["properties"]) == ExecRequest.fields()
    assert set(schemas["TaskRequest"]["properties"]) == TaskRequest.fields()
