"""The exit code `settled run` ends with (settled.exitcodes): the shell's and timeout(1)'s
conventions over the process receipt, and RUN_UNKNOWN for anything that proves no outcome.

Most tests build sealed receipts with receipts.process_receipt (the shape the owner writes);
the last ones take the receipts of real sessions run by a real Runtime.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from settled.exitcodes import (
    RUN_CANCELLED,
    RUN_CANNOT_START,
    RUN_EXIT_CODES,
    RUN_SIGNAL_BASE,
    RUN_TIMEOUT,
    RUN_UNKNOWN,
    command_exit_code,
)
from settled.receipts import exit_fact, not_started_fact, process_receipt, seal
from settled.records import TaskRecord
from settled.runtime import Runtime


def receipt(exit: dict[str, Any], *, proven: bool = True) -> dict[str, Any]:
    return process_receipt(
        session="s-1",
        task="t-1",
        key="k",
        command_digest="sha256:00",
        generation=1,
        death={"boundary": "cgroup2", "proven": proven, "evidence": "empty", "source": "owner"},
        exit=exit,
        output={"stdout": {}, "stderr": {}, "drain": "complete"},
        stragglers=[],
        terminal_mutation={"seq": None, "source": "none"},
        owner={"pid": 1},
        timings={},
    )


def status_for_code(code: int) -> int:
    return code << 8


def status_for_signal(sig: int) -> int:
    return sig


def test_the_constants_are_the_documented_ones() -> None:
    assert (RUN_TIMEOUT, RUN_UNKNOWN, RUN_CANNOT_START, RUN_SIGNAL_BASE) == (124, 117, 127, 128)
    assert RUN_CANCELLED == 128 + signal.SIGTERM
    assert {"124", "117", "127"} <= set(RUN_EXIT_CODES)


@pytest.mark.parametrize("code", [0, 1, 3, 42, 255])
def test_an_exited_command_passes_its_own_code_through(code: int) -> None:
    fact = exit_fact(status_for_code(code), "exited", shell=False, elapsed_s=0.1)
    assert command_exit_code(receipt(fact)) == code


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV, signal.SIGINT])
def test_a_signalled_command_is_128_plus_the_signal(sig: int) -> None:
    fact = exit_fact(status_for_signal(sig), "exited", shell=False, elapsed_s=0.1)
    assert command_exit_code(receipt(fact)) == 128 + sig


def test_a_command_the_memory_limit_killed_is_137_as_a_shell_says() -> None:
    fact = exit_fact(status_for_signal(signal.SIGKILL), "exited", shell=False, elapsed_s=0.1)
    fact |= {"reason": "oom", "oom_kill": 1}  # as the owner names it (owner/session.py)
    assert command_exit_code(receipt(fact)) == 128 + signal.SIGKILL


@pytest.mark.parametrize(
    "status", [status_for_code(0), status_for_code(3), status_for_signal(signal.SIGKILL)]
)
def test_a_timeout_is_124_whatever_the_command_did_on_term(status: int) -> None:
    fact = exit_fact(status, "timeout", shell=False, elapsed_s=2.0)
    assert command_exit_code(receipt(fact)) == RUN_TIMEOUT


def test_a_command_that_never_started_is_127() -> None:
    fact = not_started_fact("exec", "No such file or directory: 'nope'")
    assert command_exit_code(receipt(fact)) == RUN_CANNOT_START


def test_a_cancel_never_reads_as_success() -> None:
    before = {**not_started_fact("admission", "cancelled"), "reason": "cancelled"}
    assert command_exit_code(receipt(before)) == RUN_CANCELLED
    clean = exit_fact(status_for_code(0), "cancelled", shell=False, elapsed_s=1.0)
    assert command_exit_code(receipt(clean)) == RUN_CANCELLED
    failed = exit_fact(status_for_code(5), "cancelled", shell=False, elapsed_s=1.0)
    assert command_exit_code(receipt(failed)) == 5
    killed = exit_fact(status_for_signal(signal.SIGTERM), "cancelled", shell=False, elapsed_s=1.0)
    assert command_exit_code(receipt(killed)) == 128 + signal.SIGTERM


def test_an_exit_status_without_death_evidence_is_unknown() -> None:
    fact = exit_fact(status_for_code(0), "exited", shell=False, elapsed_s=0.1)
    assert command_exit_code(receipt(fact, proven=False)) == RUN_UNKNOWN


def test_a_lost_owner_is_unknown() -> None:
    lost = {"code": None, "signal": None, "reason": "owner_lost", "note": "lost with the owner"}
    assert command_exit_code(receipt(lost)) == RUN_UNKNOWN


def test_no_receipt_is_unknown() -> None:
    assert command_exit_code(None) == RUN_UNKNOWN


def test_a_tampered_receipt_is_unknown_not_the_code_it_claims() -> None:
    failed = receipt(exit_fact(status_for_code(1), "exited", shell=False, elapsed_s=0.1))
    forged = {**failed, "exit": {**failed["exit"], "code": 0}}
    assert command_exit_code(failed) == 1
    assert command_exit_code(forged) == RUN_UNKNOWN


@pytest.mark.parametrize(
    "fact",
    [
        {"code": 0, "signal": "KILL", "reason": "exited"},  # both: no wait status is
        {"code": None, "signal": None, "reason": "exited"},
        {"code": 256, "signal": None, "reason": "exited"},
        {"code": -1, "signal": None, "reason": "exited"},
        {"code": True, "signal": None, "reason": "exited"},
        {"code": "0", "signal": None, "reason": "exited"},
        {"code": None, "signal": "NOSUCH", "reason": "exited"},
        {"code": 0, "signal": None, "reason": "finished"},  # a reason the owner never writes
        {"code": 0, "signal": None},
    ],
)
def test_a_shape_it_does_not_know_is_unknown(fact: dict[str, Any]) -> None:
    assert command_exit_code(receipt(fact)) == RUN_UNKNOWN


def test_a_receipt_of_another_kind_is_unknown() -> None:
    other = seal({"kind": "checkpoint", "exit": {"code": 0, "reason": "exited"}})
    assert command_exit_code(other) == RUN_UNKNOWN


# -- receipts of real sessions --------------------------------------------------------------


def _code_of(rt: Runtime, task: TaskRecord, **exec_args: Any) -> int:
    view = rt.wait(rt.exec(task.task, **exec_args).session, timeout=60)
    return command_exit_code(view.get("receipt"))


@pytest.mark.timeout(120)
def test_real_sessions_end_with_the_shells_codes(rt: Runtime, task: TaskRecord) -> None:
    assert _code_of(rt, task, shell="exit 0") == 0
    assert _code_of(rt, task, shell="exit 7") == 7
    assert _code_of(rt, task, shell="kill -KILL $$") == 128 + signal.SIGKILL
    assert _code_of(rt, task, shell="sleep 30", timeout=0.5, grace=0.5) == RUN_TIMEOUT
    assert _code_of(rt, task, argv=["/nonexistent/settled-test-binary"]) == RUN_CANNOT_START
