"""Every input has a grammar (issue 12, item 4): the grammar module itself, then every face.

The property throughout: a value outside its field's grammar is refused with a typed
``BadInput`` naming the field (CLI exit 2, HTTP 400/413/416), never a traceback or a 500, and
nothing is recorded. The faces are driven in process (``settled.cli.main``, the ASGI app through
``starlette.testclient``) so hypothesis can try many inputs quickly; every task a test creates is
closed or its sessions settled before it ends.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mcp.server.mcpserver.exceptions import ToolError
from starlette.testclient import TestClient

from settled import cli, grammar
from settled.errors import BadInput
from settled.identity import CommandSpec
from settled.mcp_server import Runtimes, build_server
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.server import TokenTable, bodies, create_app
from settled.server.auth import FULL_ACCESS

# No example database: a run writes nothing into the work tree. A local run explores afresh;
# under CI the examples are derived from each test's name, so the gate is reproducible (a run
# elsewhere that finds a counterexample prints it to be added here as an @example).
DERANDOMIZE = bool(os.environ.get("CI"))
FAST = settings(
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow],
)
FACE = settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

NON_ASCII_DIGITS = [
    "²",
    "٣",
    "۴",
    "߅",
    "१",
    "௫",
    "๕",
    "໖",
    "༧",
    "၈",
    "០",
    "᠑",
    "\uff11",
    "\U0001d7d3",
]


# -- numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [*NON_ASCII_DIGITS, "1²", "٣٣", "+1", "-1", " 1", "1 ", "0x10"])
def test_an_integer_is_ascii_digits_only(text: str) -> None:
    with pytest.raises(grammar.BadNumber) as caught:
        grammar.parse_int("from", text, 0, grammar.MAX_CURSOR)
    assert caught.value.field == "from"
    assert repr(text) in str(caught.value)


@pytest.mark.parametrize(
    "text", ["inf", "nan", "Infinity", "1e300", "1e3", "1E3", "-0", ".5", "5.", "0x1p3", "٣", "1_0"]
)
def test_seconds_are_ascii_decimals_without_sign_exponent_or_infinity(text: str) -> None:
    with pytest.raises(grammar.BadNumber) as caught:
        grammar.parse_seconds("--grace", text, grammar.MAX_GRACE_S)
    assert caught.value.field == "--grace" and repr(text) in str(caught.value)


@given(st.integers(min_value=0, max_value=grammar.MAX_CURSOR))
@FAST
def test_every_cursor_in_bounds_round_trips(value: int) -> None:
    assert grammar.parse_int("from", str(value), 0, grammar.MAX_CURSOR) == value
    assert grammar.parse_int("from", "000" + str(value), 0, grammar.MAX_CURSOR) == value


@given(st.text(max_size=30))
@FAST
def test_any_text_is_a_cursor_or_a_bad_number_never_another_exception(text: str) -> None:
    try:
        value = grammar.parse_int("from", text, 0, grammar.MAX_CURSOR)
    except grammar.BadNumber as exc:
        assert exc.field == "from"
    else:
        assert text.isascii() and text.isdigit() and 0 <= value <= grammar.MAX_CURSOR


@given(st.text(alphabet="0123456789.e+-infa", max_size=30))
@FAST
def test_any_text_is_seconds_in_bounds_or_a_bad_number(text: str) -> None:
    try:
        value = grammar.parse_seconds("grace", text, grammar.MAX_GRACE_S)
    except grammar.BadNumber as exc:
        assert exc.field == "grace"
    else:
        assert math.isfinite(value) and 0 <= value <= grammar.MAX_GRACE_S
        assert grammar.DECIMAL.fullmatch(text)


def test_huge_digit_strings_are_refused_without_asking_int() -> None:
    for text in ("9" * 5000, "1" + "0" * 64, str(grammar.MAX_CURSOR + 1)):
        with pytest.raises(grammar.BadNumber, match="from"):
            grammar.parse_int("from", text, 0, grammar.MAX_CURSOR)


@pytest.mark.parametrize(
    "value", [True, False, "5", None, [5], math.nan, math.inf, -math.inf, 1e300, -1, 3601]
)
def test_json_seconds_refuse_bools_strings_non_finite_and_out_of_bounds(value: object) -> None:
    with pytest.raises(grammar.BadNumber, match=r"^grace "):
        grammar.check_seconds("grace", value, grammar.MAX_GRACE_S)


@pytest.mark.parametrize("value", [True, 5.0, "5", -1, 1 << 63, None])
def test_json_integers_refuse_bools_floats_and_out_of_bounds(value: object) -> None:
    with pytest.raises(grammar.BadNumber, match=r"^cursor "):
        grammar.check_cursor("cursor", value)


def test_a_grace_of_1e300_and_a_timeout_past_seven_days_are_refused_at_the_spec() -> None:
    with pytest.raises(grammar.BadNumber, match="grace 1e"):
        CommandSpec(argv=("true",), grace=1e300)
    with pytest.raises(grammar.BadNumber, match="timeout"):
        CommandSpec(argv=("true",), timeout=grammar.MAX_TIMEOUT_S + 1)
    assert CommandSpec(argv=("true",), grace=grammar.MAX_GRACE_S).grace == grammar.MAX_GRACE_S


# -- strings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("a\0b", "NUL"),
        ("\ud800", "UTF-8"),
        ("ok\udcff", "UTF-8"),
        (b"bytes", "string"),
        (5, "string"),
    ],
)
def test_text_refuses_nul_lone_surrogates_and_non_strings_naming_the_field(
    value: object, why: str
) -> None:
    with pytest.raises(grammar.BadText, match=why) as caught:
        grammar.check_text("argv[1]", value, 100)
    assert caught.value.field == "argv[1]"
    assert str(caught.value).startswith("argv[1] ")


def test_a_value_over_its_length_is_too_large_and_its_message_is_truncated() -> None:
    with pytest.raises(grammar.TooLarge) as caught:
        grammar.check_text("final", "x" * (grammar.MAX_FINAL_BYTES + 1), grammar.MAX_FINAL_BYTES)
    assert len(str(caught.value)) < 300
    assert f"{grammar.MAX_FINAL_BYTES + 1} chars" in str(caught.value)
    assert isinstance(caught.value, BadInput)


@given(st.text(max_size=40))
@FAST
def test_any_text_is_storable_or_a_bad_text(value: str) -> None:
    try:
        text = grammar.check_text("shell", value, grammar.MAX_ARG_BYTES)
    except grammar.BadText as exc:
        assert exc.field == "shell"
        assert "\0" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    else:
        text.encode("utf-8")  # strict: it can be stored, hashed and exec'd
        json.dumps(grammar.shown(text), ensure_ascii=False).encode("utf-8")


@given(st.text(max_size=200))
@FAST
def test_an_error_message_is_always_valid_utf8_whatever_the_value(value: str) -> None:
    message = str(grammar.BadText("key", value, "is refused"))
    message.encode("utf-8")
    assert len(message) < 200


@pytest.mark.parametrize("key", ["", "a\nb", "a\x1bb", "x" * 257, "a\0", "\ud800"])
def test_a_key_is_short_text_without_control_characters(key: str) -> None:
    with pytest.raises(BadInput) as caught:
        grammar.check_key("key", key)
    assert isinstance(caught.value, grammar.BadValue) and caught.value.field == "key"


@pytest.mark.parametrize("ident", ["", "t_ab/c", "t_\0", "t_é", "s_" + "a" * 200, "t_\ud800"])
def test_an_id_is_ascii_letters_digits_underscore_and_dash(ident: str) -> None:
    with pytest.raises(grammar.BadValue) as caught:
        grammar.check_id("task", ident)
    assert caught.value.field == "task"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"argv": ("echo", "\ud800")}, "argv[1]"),
        ({"argv": ("echo", "a\0")}, "argv[1]"),
        ({"shell": "echo \udcff"}, "shell"),
        ({"shell": "true", "cwd": "a\0b"}, "cwd"),
        ({"shell": "true", "env": (("A", "\ud800"),)}, "env A"),
        ({"shell": "true", "env": (("A\0", "v"),)}, "env name"),
        ({"shell": "true", "writable": ("/tmp\0",)}, "writable"),
        ({"shell": "x" * (grammar.MAX_ARG_BYTES + 1)}, "shell"),
        ({"argv": ("x",) * (grammar.MAX_ARGV_ITEMS + 1)}, "argv"),
        ({"argv": ("x" * 100_000,) * 11}, "command"),
    ],
)
def test_a_spec_refuses_what_cannot_be_recorded_or_run_naming_the_field(
    spec: dict[str, object], field: str
) -> None:
    with pytest.raises(grammar.BadValue) as caught:
        CommandSpec(**spec)  # type: ignore[arg-type]
    assert caught.value.field == field


@given(st.lists(st.text(max_size=10), min_size=1, max_size=5))
@FAST
def test_any_argv_is_a_spec_with_a_digest_or_a_bad_input(argv: list[str]) -> None:
    assume(argv)
    try:
        spec = CommandSpec(argv=tuple(argv))
    except BadInput as exc:
        assert isinstance(exc, grammar.BadValue) and exc.field.startswith("argv")
    else:
        assert spec.digest


# -- strategies of values outside every grammar ------------------------------------------------

BAD_CHAR = st.sampled_from(["\0", "\ud800", "\udcff", "\udfff"])
UNREPRESENTABLE = st.builds(
    lambda head, bad, tail: head + bad + tail, st.text(max_size=6), BAD_CHAR, st.text(max_size=6)
)
NOT_DIGITS = st.one_of(
    st.sampled_from([*NON_ASCII_DIGITS, "inf", "nan", "-1", "1e3", "1E300", "+5", " 5", "0x10"]),
    st.builds(lambda d, s: d + s, st.sampled_from(NON_ASCII_DIGITS), st.text(max_size=4)),
    st.text(min_size=1, max_size=8).filter(lambda t: not t.isascii() or not t.isdigit()),
)
BAD_SECONDS = st.one_of(
    NOT_DIGITS.filter(lambda t: grammar.DECIMAL.fullmatch(t) is None),
    st.integers(min_value=10**7, max_value=10**30).map(str),
)
BAD_CURSOR = st.one_of(
    NOT_DIGITS, st.integers(min_value=grammar.MAX_CURSOR + 1, max_value=10**40).map(str)
)
BAD_ID = st.one_of(
    UNREPRESENTABLE,
    st.text(min_size=1, max_size=12).filter(lambda t: grammar.ID.fullmatch(t) is None),
    st.just("t_" + "a" * 200),
)


# -- the CLI: every verb, in process ---------------------------------------------------------

NUMBER_SLOTS = [
    (("logs", "s_x", "--from", "V"), "--from", BAD_CURSOR),
    (("logs", "s_x", "--view", "V"), "--view", BAD_CURSOR),
    (("logs", "s_x", "--follow", "--timeout", "V"), "--timeout", BAD_SECONDS),
    (("wait", "s_x", "--timeout", "V"), "--timeout", BAD_SECONDS),
    (("exec", "--task", "t_x", "--timeout", "V", "--", "true"), "--timeout", BAD_SECONDS),
    (("exec", "--task", "t_x", "--grace", "V", "--", "true"), "--grace", BAD_SECONDS),
    (("close", "t_x", "--deadline", "V"), "--deadline", BAD_SECONDS),
    (("serve", "--port", "V"), "--port", BAD_CURSOR),
]
TEXT_SLOTS = [
    (("task", "new", "--workspace", "V"), "--workspace"),
    (("task", "new", "--key", "V"), "--key"),
    (("task", "new", "--user", "V"), "--user"),
    (("task", "destroy", "V"), "task"),
    (("exec", "--task", "V", "--", "true"), "--task"),
    (("exec", "--task", "t_x", "--key", "V", "--", "true"), "--key"),
    (("exec", "--task", "t_x", "--cwd", "V", "--", "true"), "--cwd"),
    (("exec", "--task", "t_x", "--env", "V", "--", "true"), "--env"),
    (("exec", "--task", "t_x", "--stdin", "V", "--", "true"), "--stdin"),
    (("exec", "--task", "t_x", "--user", "V", "--", "true"), "--user"),
    (("exec", "--task", "t_x", "--writable", "V", "--", "true"), "--writable"),
    (("wait", "V"), "session"),
    (("logs", "V"), "session"),
    (("status", "V"), "target"),
    (("cancel", "V"), "session"),
    (("cancel", "s_x", "--reason", "V"), "--reason"),
    (("close", "V"), "task"),
    (("close", "t_x", "--final", "V"), "--final"),
    (("checkpoint", "V"), "task"),
    (("recover", "--task", "V"), "--task"),
    (("explain", "V"), "task"),
    (("restore", "V", "/nonexistent-dest"), "target"),
    (("restore", "t_x", "V"), "dest"),
    (("verify", "V"), "target"),
    (("serve", "--tokens", "V"), "--tokens"),
    (("status", "--home", "V", "t_x"), "--home"),
]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``settled.cli.main`` in this process, its stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_refused(argv: list[str], field: str | None) -> dict[str, object]:
    """Exit 2, one JSON error on stdout naming the field, one line on stderr; no traceback."""
    code, out, err = run_cli(["--json", *argv])
    assert code == 2, (argv, out, err)
    payload = json.loads(out)
    assert payload["error"] in BAD_INPUT_KINDS, payload
    assert err.startswith(f"settled: {payload['error']}: ") and "Traceback" not in err
    if field is not None and payload["error"] != "UsageError":
        assert payload["field"] == field, (argv, payload)
        assert str(payload["message"]).startswith(f"{field} ")
    return payload


BAD_INPUT_KINDS = {"BadNumber", "BadText", "TooLarge", "BadValue", "UsageError"}


@pytest.mark.parametrize(("template", "field", "values"), NUMBER_SLOTS, ids=lambda v: str(v))
@given(data=st.data())
@FACE
def test_every_number_of_every_verb_outside_its_grammar_exits_2_naming_it(
    tmp_path_factory: pytest.TempPathFactory,
    template: tuple[str, ...],
    field: str,
    values: st.SearchStrategy[str],
    data: st.DataObject,
) -> None:
    value = data.draw(values)
    argv = [value if part == "V" else part for part in template]
    home = str(tmp_path_factory.getbasetemp() / "cli-home")
    assert_refused(["--home", home, *argv], field)


@pytest.mark.parametrize(("template", "field"), TEXT_SLOTS, ids=lambda v: str(v))
@given(value=UNREPRESENTABLE)
@FACE
def test_every_string_of_every_verb_that_cannot_be_represented_exits_2_naming_it(
    tmp_path_factory: pytest.TempPathFactory, template: tuple[str, ...], field: str, value: str
) -> None:
    argv = [value if part == "V" else part for part in template]
    home = str(tmp_path_factory.getbasetemp() / "cli-home")
    if "--home" not in argv:
        argv = ["--home", home, *argv]
    assert_refused(argv, field)


@pytest.mark.parametrize("template", [t for t, f in TEXT_SLOTS if f in ("task", "session")])
@given(value=BAD_ID)
@FACE
def test_an_id_that_names_nothing_possible_exits_2(
    tmp_path_factory: pytest.TempPathFactory, template: tuple[str, ...], value: str
) -> None:
    argv = [value if part == "V" else part for part in template]
    home = str(tmp_path_factory.getbasetemp() / "cli-home")
    assert_refused(["--home", home, *argv], None)


@pytest.mark.parametrize(
    "argv", [["logs"], ["nosuchverb"], ["exec", "--nope"], ["status", "t_x", "--from"], []]
)
def test_argparse_errors_are_a_typed_usage_error_exiting_2(argv: list[str]) -> None:
    payload = assert_refused(argv, None)
    assert payload["error"] == "UsageError"


# -- the HTTP service: every route, in process through ASGI -------------------------------------

TOKEN = "grammar-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The app over a home of its own; its lifespan (the Runtime pool, the warm launcher and
    the recoverer) ends when the module's tests do. These tests create nothing."""
    home = tmp_path_factory.mktemp("http-home")
    app = create_app(str(home), TokenTable([(TOKEN, FULL_ACCESS)]))
    with TestClient(app, raise_server_exceptions=False, headers=AUTH) as client:
        yield client


def assert_typed(response: httpx.Response, field: str | None, statuses: set[int]) -> None:
    assert response.status_code in statuses, (response.status_code, response.text)
    body = response.json()
    assert set(body) >= {"error", "message"} and body["error"] != "InternalError", body
    if field is not None:
        assert body.get("field") == field, body


def encoded(text: str) -> str:
    """A path segment or query value as a client sends it: UTF-8, surrogates passed through."""
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


QUERY_SLOTS = [
    ("/v1/sessions/s_x/output?from=", "from", BAD_CURSOR),
    ("/v1/sessions/s_x/output?max=", "max", BAD_CURSOR),
    ("/v1/sessions/s_x/events?from=", "from", BAD_CURSOR),
    ("/v1/sessions/s_x?wait=", "wait", BAD_SECONDS),
]


@pytest.mark.parametrize(("url", "field", "values"), QUERY_SLOTS, ids=lambda v: str(v))
@given(data=st.data())
@FACE
def test_a_query_number_outside_its_grammar_is_400_naming_it(
    http: TestClient, url: str, field: str, values: st.SearchStrategy[str], data: st.DataObject
) -> None:
    value = data.draw(values)
    assert_typed(http.get(url + encoded(value)), field, {400})


def _a_header_value(text: str) -> bool:
    """Printable latin-1 without surrounding whitespace: what survives as a header value."""
    return text.isprintable() and text.strip() == text != "" and max(map(ord, text)) < 256


@given(value=NOT_DIGITS.filter(_a_header_value))
@FACE
def test_a_last_event_id_outside_its_grammar_is_400(http: TestClient, value: str) -> None:
    headers = {**AUTH, "Last-Event-ID": value.encode("latin-1")}
    response = http.get("/v1/sessions/s_x/events", headers=headers)  # type: ignore[dict-item]
    assert_typed(response, "Last-Event-ID", {400})


PATHS = [
    "/v1/tasks/{}",
    "/v1/tasks/{}/explain",
    "/v1/sessions/{}",
    "/v1/sessions/{}/output",
    "/v1/sessions/{}/events",
]


@pytest.mark.parametrize("template", PATHS)
@given(value=BAD_ID)
@FACE
def test_an_id_in_a_path_that_names_nothing_possible_is_400_or_404_never_500(
    http: TestClient, template: str, value: str
) -> None:
    response = http.get(template.format(encoded(value)))
    # "." is a dot segment the client removes, and a "/" (%2F) is decoded by the server: either
    # way the request names another route (GET /v1/tasks), which answers 405, typed too
    other_route = value == "." or "/" in value
    assert_typed(response, None, {400, 404, 405} if other_route else {400, 404})


JSON_BAD = st.one_of(
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not 0 <= f <= 10**7),
    st.integers(min_value=10**7, max_value=10**30),
    st.integers(max_value=-1),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
JSON_TEXT_BAD = st.one_of(UNREPRESENTABLE, st.integers(), st.booleans(), st.lists(st.text()))
NOT_A_BOOL = st.one_of(st.integers(), st.text(), st.floats(), st.lists(st.booleans(), max_size=2))
NOT_PATHS = st.one_of(
    st.text(),
    st.integers(),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    st.lists(st.one_of(UNREPRESENTABLE, st.integers(), st.just("relative/path")), min_size=1),
)
NOT_AN_OBJECT = st.one_of(st.text(), st.integers(), st.lists(st.text(), max_size=2))
NOT_ARGV = st.one_of(
    st.just([]),
    st.just([""]),
    st.text(),
    st.integers(),
    st.lists(st.one_of(UNREPRESENTABLE, st.integers(), st.none()), min_size=1, max_size=3),
)
NOT_MEMORY = st.one_of(
    st.booleans(), st.floats(), st.text(max_size=8), st.integers(max_value=(4 << 20) - 1),
    st.integers(min_value=(1 << 50) + 1, max_value=1 << 60),
)  # fmt: skip
NOT_PIDS = st.one_of(
    st.booleans(), st.floats(), st.text(max_size=8), st.integers(max_value=0),
    st.integers(min_value=4194305, max_value=1 << 40),
)  # fmt: skip
NOT_CPUS = st.one_of(
    st.booleans(), st.text(max_size=8), st.integers(max_value=0),
    st.integers(min_value=1025, max_value=1 << 40),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not 0.01 <= f <= 1024),
)  # fmt: skip
SESSION = ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"})
BODY_SLOTS = [
    *[
        (*SESSION, field, bad)
        for field, bad in (
            ("memory", NOT_MEMORY),
            ("pids", NOT_PIDS),
            ("cpus", NOT_CPUS),
            ("readable", NOT_PATHS),
            ("network", JSON_TEXT_BAD),
        )
    ],
    *[
        ("/v1/tasks", {}, field, bad)
        for field, bad in (
            ("memory", NOT_MEMORY),
            ("pids", NOT_PIDS),
            ("cpus", NOT_CPUS),
            ("writable", NOT_PATHS),
            ("readable", NOT_PATHS),
        )
    ],
    ("/v1/tasks", {}, "workspace", JSON_TEXT_BAD),
    ("/v1/tasks", {}, "key", JSON_TEXT_BAD),
    ("/v1/tasks", {}, "user", JSON_TEXT_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "timeout", JSON_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "grace", JSON_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "cwd", JSON_TEXT_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "user", JSON_TEXT_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k"}, "shell", JSON_TEXT_BAD),
    ("/v1/tasks/t_x/sessions", {"shell": "true"}, "key", JSON_TEXT_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "boundary", JSON_TEXT_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "isolation", JSON_TEXT_BAD),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "service", NOT_A_BOOL),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "writable", NOT_PATHS),
    ("/v1/tasks/t_x/sessions", {"key": "k", "shell": "true"}, "env", NOT_AN_OBJECT),
    ("/v1/tasks/t_x/sessions", {"key": "k"}, "argv", NOT_ARGV),
    ("/v1/tasks/t_x/close", {}, "deadline", JSON_BAD),
    ("/v1/tasks/t_x/close", {}, "final", JSON_TEXT_BAD),
    ("/v1/sessions/s_x/signal", {"signal": "TERM"}, "reason", JSON_TEXT_BAD),
    ("/v1/sessions/s_x/signal", {}, "signal", JSON_TEXT_BAD),
    ("/v1/recover", {}, "task", JSON_TEXT_BAD),
]


def post_json(http: TestClient, url: str, body: dict[str, object]) -> httpx.Response:
    """JSON as any client may write it: surrogates as ``\\ud800`` escapes, NaN as NaN."""
    content = json.dumps(body, allow_nan=True).encode()
    return http.post(url, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("url", "base", "field", "values"), BODY_SLOTS, ids=lambda v: str(v))
@given(data=st.data())
@FACE
def test_a_body_field_outside_its_grammar_is_400_naming_it_before_anything_is_looked_up(
    http: TestClient,
    url: str,
    base: dict[str, object],
    field: str,
    values: st.SearchStrategy[object],
    data: st.DataObject,
) -> None:
    value = data.draw(values)
    response = post_json(http, url, {**base, field: value})
    assert response.status_code in (400, 413), response.text
    body = response.json()
    assert body["error"] in {"BadNumber", "BadText", "TooLarge", "BadValue", "BadInput"}, body
    if body["error"] != "BadInput":
        assert body["field"].startswith(field) or body["field"] == "body", body


@given(
    argv=st.lists(st.one_of(st.text(max_size=4), UNREPRESENTABLE), min_size=1, max_size=4),
    env=st.dictionaries(st.one_of(st.text(max_size=4), UNREPRESENTABLE), UNREPRESENTABLE),
)
@FACE
def test_argv_and_env_that_cannot_be_represented_are_400_naming_the_item(
    http: TestClient, argv: list[str], env: dict[str, str]
) -> None:
    assume(env or not all(_storable(a) for a in argv))
    response = post_json(http, "/v1/tasks/t_x/sessions", {"key": "k", "argv": argv, "env": env})
    assert response.status_code in (400, 404), response.text  # 404: it was all valid
    if response.status_code == 400:
        assert response.json()["field"].startswith(("argv", "env")), response.text


def _storable(text: str) -> bool:
    try:
        grammar.check_text("x", text, grammar.MAX_ARG_BYTES)
    except grammar.BadValue:
        return False
    return True


@pytest.mark.parametrize(
    "content", [b"{NaN}", b'{"deadline": NaN}', b'{"deadline": Infinity}', b"[" * 50_000, b"\xff"]
)
def test_json_that_is_not_json_numbers_or_not_utf8_is_400(http: TestClient, content: bytes) -> None:
    response = http.post("/v1/tasks/t_x/close", content=content)
    assert_typed(response, None, {400})


def test_a_body_over_the_limit_is_413_from_its_declared_length_or_as_it_is_read(
    http: TestClient,
) -> None:
    declared = http.post(
        "/v1/tasks", content=b"{}", headers={"Content-Length": str(bodies.MAX_BODY_BYTES + 1)}
    )
    assert declared.status_code in (400, 413)  # a lying Content-Length: never a 500
    streamed = http.post("/v1/tasks", content=iter([b" " * (1 << 16)] * 17 + [b"{}"]))
    assert_typed(streamed, "body", {413})
    too_long = post_json(http, "/v1/tasks", {"key": "k" * (grammar.MAX_KEY_BYTES + 1)})
    assert_typed(too_long, "key", {413})


# -- the library and the faces over a real task: refused before anything is recorded ---------


def _sessions(rt: Runtime) -> list[object]:
    return list(rt.store._db.execute("SELECT session FROM sessions").fetchall())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"argv": ["echo", "\ud800"]}, "argv[1]"),
        ({"argv": ["echo", "caf\udce9"]}, "argv[1]"),  # a non-UTF-8 byte via surrogateescape
        ({"shell": "echo a\0b"}, "shell"),
        ({"shell": "true", "cwd": "sub\0dir"}, "cwd"),
        ({"shell": "true", "env": {"A": "\udfff"}}, "env A"),
        ({"shell": "true", "env": ["A\0=1"]}, "env"),
        ({"shell": "true", "writable": ["/tmp\0"]}, "writable"),
        ({"shell": "true", "key": "k\n"}, "key"),
        ({"shell": "true", "grace": 1e300}, "grace"),
        ({"shell": "true", "timeout": math.inf}, "timeout"),
        ({"shell": "true", "timeout": True}, "timeout"),
        ({"shell": "true", "user": "\ud800"}, "user"),
    ],
)
def test_the_runtime_refuses_what_it_cannot_record_naming_the_field_and_records_nothing(
    rt: Runtime, task: TaskRecord, kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(grammar.BadValue) as caught:
        rt.exec(task.task, **kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert _sessions(rt) == []


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda rt, t: rt.close_task(t, deadline=1e300), "deadline"),
        (lambda rt, t: rt.close_task(t, final="\ud800"), "final"),
        (lambda rt, t: rt.new_task("/tmp\0x"), "workspace"),
        (lambda rt, t: rt.new_task(None, key="\ud800"), "key"),
        (lambda rt, t: rt.task_status("t_\ud800"), "task"),
        (lambda rt, t: rt.session_status("s_\0"), "session"),
        (lambda rt, t: rt.read("s_x", "../x"), "stream"),
        (lambda rt, t: rt.read("s_x", "stdout", -1), "start"),
        (lambda rt, t: rt.wait("s_x", math.nan), "timeout"),
        (lambda rt, t: rt.view("s_x", "stdout", 1 << 30), "budget"),
        (lambda rt, t: rt.restore(t, "/tmp/\0"), "dest"),
        (lambda rt, t: rt.cancel("s_x", "r" * 5000), "reason"),
    ],
)
def test_every_runtime_verb_checks_its_arguments_for_a_library_caller(
    rt: Runtime, task: TaskRecord, call: Callable[[Runtime, str], object], field: str
) -> None:
    with pytest.raises(grammar.BadValue) as caught:
        call(rt, task.task)
    assert caught.value.field == field
    assert rt.task_status(task.task)["state"] == "open"


def test_the_cli_refuses_a_non_utf8_argument_naming_it_and_records_nothing(
    rt: Runtime, task: TaskRecord
) -> None:
    argv = ["--home", rt.home, "exec", "--task", task.task, "--", "printf", os.fsdecode(b"\xff")]
    payload = assert_refused(argv, "argv[1]")
    assert "UTF-8" in str(payload["message"])
    assert _sessions(rt) == []


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("read_output", {"session": "s_x", "cursor": "5"}),
        ("read_output", {"session": "s_x", "cursor": True}),
        ("read_output", {"session": "s_x", "cursor": 1.0}),
        ("read_output", {"session": "s_x", "cursor": 1 << 63}),
        ("read_output", {"session": "s_x", "budget": (1 << 20) + 1}),
        ("wait", {"session": "s_x", "timeout": "1"}),
        ("wait", {"session": "s_x", "timeout": 601}),
        ("finish", {"task": "t_x", "deadline": math.inf}),
        ("run", {"task": "t_x", "command": "true", "timeout": 1e300}),
        ("run", {"task": "t_x", "command": ["echo", "\ud800"]}),
        ("run", {"task": "t_\0", "command": "true"}),
        ("new_task", {"workspace": "/tmp\0"}),
    ],
)
def test_mcp_tool_arguments_outside_the_grammar_are_tool_errors(
    tmp_path: Path, tool: str, arguments: dict[str, object]
) -> None:
    runtimes = Runtimes(str(tmp_path / "home"))
    try:
        server = build_server(runtimes)
        with pytest.raises(ToolError) as caught:
            anyio.run(server.call_tool, tool, arguments)
        assert "Traceback" not in str(caught.value)
    finally:
        runtimes.close()
