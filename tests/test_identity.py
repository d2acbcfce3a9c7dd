"""Behaviours of settled.identity: what a command's digest covers, and what admission refuses.

A session is (task, invocation_key); the digest decides whether a retry with the same key is the
same command (reuse) or another one (KeyConflict). So every field that defines the run must move
the digest, nothing else may, and bad input is refused before anything is recorded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from settled.errors import BadInput
from settled.identity import (
    BOUNDARY_POLICIES,
    DEFAULT_GRACE_S,
    SPEC_VERSION,
    CommandSpec,
    normalize_env,
    resolve_cwd,
)

ARGV_SPEC = CommandSpec(argv=("echo", "hi"))
SHELL_SPEC = CommandSpec(shell="echo hi")
FULL_SPEC = CommandSpec(
    argv=("python3", "-c", "print('ünï')", ""),
    cwd="sub/dir",
    env=(("A", "1"), ("B", "x=y"), ("EMPTY", "")),
    stdin_digest="sha256:" + "ab" * 32,
    timeout=12.5,
    grace=0.25,
    boundary="pidns",
    service=True,
)


def _through_storage(data: dict[str, Any]) -> dict[str, Any]:
    """What comes back from the store: the spec as JSON text, parsed again."""
    loaded: dict[str, Any] = json.loads(json.dumps(data))
    return loaded


# --- what the digest covers ---------------------------------------------------------------

ONE_FIELD_CHANGES = [
    pytest.param(ARGV_SPEC, {"argv": ("echo", "ho")}, id="argv"),
    pytest.param(ARGV_SPEC, {"argv": ("echo", "hi", "")}, id="argv-extra-empty-arg"),
    pytest.param(SHELL_SPEC, {"shell": "echo ho"}, id="shell"),
    pytest.param(ARGV_SPEC, {"cwd": "sub"}, id="cwd"),
    pytest.param(ARGV_SPEC, {"env": (("A", "1"),)}, id="env-added"),
    pytest.param(FULL_SPEC, {"env": (("A", "2"), ("B", "x=y"), ("EMPTY", ""))}, id="env-value"),
    pytest.param(FULL_SPEC, {"env": (("A", "1"), ("B", "x=y"))}, id="env-removed"),
    pytest.param(ARGV_SPEC, {"stdin_digest": "sha256:" + "00" * 32}, id="stdin-added"),
    pytest.param(FULL_SPEC, {"stdin_digest": "sha256:" + "cd" * 32}, id="stdin-other"),
    pytest.param(ARGV_SPEC, {"timeout": 5.0}, id="timeout-added"),
    pytest.param(FULL_SPEC, {"timeout": 12.0}, id="timeout-other"),
    pytest.param(ARGV_SPEC, {"grace": 1.0}, id="grace"),
    pytest.param(ARGV_SPEC, {"boundary": "cgroup2"}, id="boundary"),
    pytest.param(ARGV_SPEC, {"service": True}, id="service"),
]


@pytest.mark.parametrize(("base", "change"), ONE_FIELD_CHANGES)
def test_changing_any_one_field_changes_the_digest(
    base: CommandSpec, change: dict[str, Any]
) -> None:
    changed = base.replace(**change)
    assert changed.digest != base.digest


def test_the_digest_is_a_pure_function_of_the_spec() -> None:
    again = CommandSpec(argv=("echo", "hi"))
    assert again.digest == ARGV_SPEC.digest
    assert ARGV_SPEC.digest.startswith("sha256:")
    assert len(ARGV_SPEC.digest) == len("sha256:") + 64


def test_the_digest_is_sha256_over_the_documented_canonical_form() -> None:
    # Pinned by hand: a change here changes every stored digest, so a retry made across an
    # upgrade would conflict with its own first attempt.
    canonical = (
        '{"argv":["echo","hi"],"boundary":"auto","cwd":".","env":[],"grace":5.0,'
        '"service":false,"shell":null,"stdin":null,"timeout":null,"v":"settled.command/v1"}'
    )
    expected = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    assert ARGV_SPEC.digest == expected


def test_argv_of_one_string_and_the_same_shell_string_differ() -> None:
    as_argv = CommandSpec(argv=("a b",))
    as_shell = CommandSpec(shell="a b")
    assert as_argv.digest != as_shell.digest
    assert as_argv.exec_argv == ["a b"]
    assert as_shell.exec_argv == ["/bin/sh", "-c", "a b"]


def test_argv_is_not_joined_before_hashing() -> None:
    assert CommandSpec(argv=("a", "b")).digest != CommandSpec(argv=("a b",)).digest


def test_env_order_does_not_change_the_digest() -> None:
    forward = normalize_env(["A=1", "B=2", "C=3"])
    backward = normalize_env(["C=3", "B=2", "A=1"])
    assert forward == backward == (("A", "1"), ("B", "2"), ("C", "3"))
    assert CommandSpec(argv=("env",), env=forward).digest == (
        CommandSpec(argv=("env",), env=backward).digest
    )


def test_env_from_a_mapping_equals_env_from_pairs() -> None:
    assert normalize_env({"B": "2", "A": "1"}) == normalize_env(["B=2", "A=1"])


def test_env_value_keeps_everything_after_the_first_equals_sign() -> None:
    assert normalize_env(["A=b=c", "E="]) == (("A", "b=c"), ("E", ""))


# --- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", [ARGV_SPEC, SHELL_SPEC, FULL_SPEC], ids=["argv", "shell", "every-field"]
)
def test_from_json_of_to_json_is_the_same_spec_with_the_same_digest(spec: CommandSpec) -> None:
    back = CommandSpec.from_json(_through_storage(spec.to_json()))
    assert back == spec
    assert back.digest == spec.digest
    assert back.to_json() == spec.to_json()


def test_to_json_names_the_spec_version() -> None:
    assert ARGV_SPEC.to_json()["v"] == SPEC_VERSION


def test_from_json_of_another_version_is_refused_naming_it() -> None:
    data = {**ARGV_SPEC.to_json(), "v": "settled.command/v0"}
    with pytest.raises(BadInput, match=r"settled\.command/v0"):
        CommandSpec.from_json(data)


def test_defaults_are_what_the_contract_says() -> None:
    assert ARGV_SPEC.cwd == "."
    assert ARGV_SPEC.grace == DEFAULT_GRACE_S
    assert ARGV_SPEC.timeout is None
    assert ARGV_SPEC.boundary == "auto"
    assert ARGV_SPEC.service is False
    assert set(BOUNDARY_POLICIES) == {
        "auto",
        "cgroup2+pidns",
        "cgroup2",
        "pidns",
        "subreaper",
        "pgroup",
    }


def test_round_trip_keeps_the_digest_of_an_integer_grace() -> None:
    spec = CommandSpec(argv=("true",), grace=5)
    back = CommandSpec.from_json(_through_storage(spec.to_json()))
    assert back == spec  # holds: 5 == 5.0
    assert back.digest == spec.digest  # fails: '"grace":5' vs '"grace":5.0'


def test_an_integer_and_the_equal_float_timeout_are_the_same_command() -> None:
    as_int = CommandSpec(argv=("true",), timeout=5)
    as_float = CommandSpec(argv=("true",), timeout=5.0)
    assert as_int == as_float  # holds
    assert as_int.digest == as_float.digest  # fails


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "named"),
    [(-1.0, "-1.0"), (-0.001, "-0.001"), (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")],
)
def test_a_negative_or_non_finite_timeout_is_refused_naming_it(value: float, named: str) -> None:
    with pytest.raises(BadInput) as caught:
        CommandSpec(argv=("true",), timeout=value)
    assert "timeout" in str(caught.value)
    assert named in str(caught.value)


def test_a_zero_timeout_is_accepted() -> None:
    assert CommandSpec(argv=("true",), timeout=0.0).timeout == 0.0


@pytest.mark.parametrize(("value", "named"), [(-0.5, "-0.5"), (math.nan, "nan"), (math.inf, "inf")])
def test_a_negative_or_non_finite_grace_is_refused_naming_it(value: float, named: str) -> None:
    with pytest.raises(BadInput) as caught:
        CommandSpec(argv=("true",), grace=value)
    assert "grace" in str(caught.value)
    assert named in str(caught.value)


def test_a_timeout_that_is_not_a_number_is_refused_as_bad_input() -> None:
    with pytest.raises(BadInput, match="'5'"):
        CommandSpec(argv=("true",), timeout="5")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["cgroup3", "", "AUTO", "pgroup "])
def test_an_unknown_boundary_is_refused_naming_it(value: str) -> None:
    with pytest.raises(BadInput) as caught:
        CommandSpec(argv=("true",), boundary=value)
    assert repr(value) in str(caught.value)


@pytest.mark.parametrize("argv", [(), ("",), ("", "x")], ids=["no-args", "empty-arg", "empty-prog"])
def test_an_empty_argv_is_refused_naming_it(argv: tuple[str, ...]) -> None:
    with pytest.raises(BadInput) as caught:
        CommandSpec(argv=argv)
    assert "argv" in str(caught.value)
    assert repr(list(argv)) in str(caught.value)


def test_both_argv_and_shell_is_refused() -> None:
    with pytest.raises(BadInput) as caught:
        CommandSpec(argv=("true",), shell="true")
    assert "argv" in str(caught.value)
    assert "shell" in str(caught.value)


def test_neither_argv_nor_shell_is_refused() -> None:
    with pytest.raises(BadInput) as caught:
        CommandSpec()
    assert "argv" in str(caught.value)
    assert "shell" in str(caught.value)


@pytest.mark.parametrize("pair", ["NOVALUE", "", "PATH"])
def test_an_env_entry_without_equals_is_refused_naming_it(pair: str) -> None:
    with pytest.raises(BadInput) as caught:
        normalize_env(["OK=1", pair])
    assert repr(pair) in str(caught.value)


@pytest.mark.parametrize(
    "name", ["A=B", "=", "", "NUL\0"], ids=["equals", "only-eq", "empty", "nul"]
)
def test_an_env_name_with_equals_or_empty_is_refused_naming_it(name: str) -> None:
    with pytest.raises(BadInput) as caught:
        CommandSpec(argv=("env",), env=((name, "v"),))
    assert repr(name) in str(caught.value)


def test_an_env_name_with_equals_from_a_mapping_is_refused_at_the_spec() -> None:
    env = normalize_env({"A=B": "v"})
    with pytest.raises(BadInput, match=r"'A=B'"):
        CommandSpec(argv=("env",), env=env)


def test_an_env_entry_starting_with_equals_has_an_empty_name_and_is_refused() -> None:
    env = normalize_env(["=x"])
    with pytest.raises(BadInput, match=r"''"):
        CommandSpec(argv=("env",), env=env)


# --- resolve_cwd --------------------------------------------------------------------------


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "file.txt").write_text("not a directory")
    return root


def test_cwd_dot_is_the_workspace(workspace: Path) -> None:
    assert resolve_cwd(str(workspace), ".") == "."


def test_cwd_empty_is_the_workspace(workspace: Path) -> None:
    assert resolve_cwd(str(workspace), "") == "."


def test_cwd_subdir_is_kept_relative(workspace: Path) -> None:
    assert resolve_cwd(str(workspace), "sub") == "sub"
    assert resolve_cwd(str(workspace), "sub/deeper") == os.path.join("sub", "deeper")


def test_cwd_is_normalised_so_spellings_of_one_dir_agree(workspace: Path) -> None:
    assert resolve_cwd(str(workspace), "./sub/../sub/") == "sub"
    assert resolve_cwd(str(workspace), "sub/..") == "."


def test_cwd_absolute_inside_the_workspace_becomes_relative(workspace: Path) -> None:
    assert resolve_cwd(str(workspace), str(workspace / "sub")) == "sub"


def test_cwd_dotdot_is_refused_naming_it(workspace: Path) -> None:
    with pytest.raises(BadInput) as caught:
        resolve_cwd(str(workspace), "..")
    assert "'..'" in str(caught.value)
    assert "leaves the workspace" in str(caught.value)


def test_cwd_dotdot_through_a_subdir_is_refused_naming_it(workspace: Path) -> None:
    with pytest.raises(BadInput, match=r"'sub/\.\./\.\.'"):
        resolve_cwd(str(workspace), "sub/../..")


def test_cwd_absolute_outside_is_refused_naming_it(workspace: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(BadInput) as caught:
        resolve_cwd(str(workspace), str(outside))
    assert repr(str(outside)) in str(caught.value)
    assert "leaves the workspace" in str(caught.value)


def test_cwd_sibling_sharing_the_name_prefix_is_refused(workspace: Path, tmp_path: Path) -> None:
    sibling = tmp_path / "ws-evil"  # starts with the workspace path, is not inside it
    sibling.mkdir()
    with pytest.raises(BadInput, match=r"'\.\./ws-evil'"):
        resolve_cwd(str(workspace), "../ws-evil")


def test_cwd_symlink_inside_pointing_outside_is_refused_naming_it(
    workspace: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (workspace / "escape").symlink_to(outside)
    with pytest.raises(BadInput) as caught:
        resolve_cwd(str(workspace), "escape")
    assert "'escape'" in str(caught.value)
    assert "leaves the workspace" in str(caught.value)


def test_cwd_symlink_chain_leaving_the_workspace_is_refused(
    workspace: Path, tmp_path: Path
) -> None:
    (workspace / "hop").symlink_to(workspace / "sub")
    (workspace / "sub" / "out").symlink_to(tmp_path)
    with pytest.raises(BadInput, match=r"'hop/out'"):
        resolve_cwd(str(workspace), "hop/out")


def test_cwd_symlink_inside_pointing_inside_resolves_to_its_target(workspace: Path) -> None:
    (workspace / "alias").symlink_to(workspace / "sub" / "deeper")
    assert resolve_cwd(str(workspace), "alias") == os.path.join("sub", "deeper")


def test_cwd_nonexistent_is_refused_naming_it(workspace: Path) -> None:
    with pytest.raises(BadInput) as caught:
        resolve_cwd(str(workspace), "no/such/dir")
    assert "'no/such/dir'" in str(caught.value)
    assert "not a directory" in str(caught.value)


def test_cwd_a_regular_file_is_refused_naming_it(workspace: Path) -> None:
    with pytest.raises(BadInput, match=r"'file\.txt'"):
        resolve_cwd(str(workspace), "file.txt")


def test_cwd_dangling_symlink_is_refused(workspace: Path) -> None:
    (workspace / "dangling").symlink_to(workspace / "gone")
    with pytest.raises(BadInput, match=r"'dangling'"):
        resolve_cwd(str(workspace), "dangling")


def test_a_workspace_reached_through_a_symlink_is_resolved(workspace: Path, tmp_path: Path) -> None:
    link = tmp_path / "ws-link"
    link.symlink_to(workspace)
    assert resolve_cwd(str(link), "sub") == "sub"
    with pytest.raises(BadInput):
        resolve_cwd(str(link), "..")


def test_cwd_subdir_of_a_root_workspace_is_accepted(tmp_path: Path) -> None:
    inside = os.path.realpath(tmp_path)
    assert resolve_cwd("/", inside) == inside.lstrip("/")
