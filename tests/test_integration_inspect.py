"""A real Inspect AI eval (mock model) whose sandbox is "settled": the solver's exec, write_file
and read_file run through settled (text and bytes kept exactly, a missing file is
FileNotFoundError, a timeout is TimeoutError), exec gets Inspect's local environment rule, and
the sample's cleanup closes its task with a checkpoint receipt whose digest, with the task id,
is in the sample's record in the .eval log; file reads and writes are not counted as commands."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("inspect_ai", reason="inspect_ai not installed (extra: inspect)")

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.log import read_eval_log
from inspect_ai.scorer import Score, Target, accuracy, scorer
from inspect_ai.solver import Generate, TaskState, solver
from inspect_ai.util import OutputLimitExceededError, SandboxEnvironmentSpec, sandbox

from settled.integrations.inspect_ai import SettledSandboxConfig, SettledSandboxEnvironment
from settled.runtime import Runtime

pytestmark = pytest.mark.timeout(240)


async def _raises(call: Any, kind: type[BaseException]) -> bool:
    try:
        await call
    except kind:
        return True
    return False


@solver
def use_the_sandbox() -> Any:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        box = sandbox()
        await box.write_file("sub/a.txt", "hello\r\n")
        await box.write_file("b.bin", b"\x00\xff\n")
        ran = await box.exec(["sh", "-c", "cat sub/a.txt; echo err >&2; exit 5"])
        piped = await box.exec(["cat"], input="fed")
        probe = 'command -v python3; echo "$INSPECT_PROBE $EXEC_PROBE ${SETTLED_PROBE:-withheld}"'
        environment = await box.exec(["sh", "-c", probe], env={"EXEC_PROBE": "given"})
        state.metadata.update(
            code=ran.returncode,
            stdout=ran.stdout,
            stderr=ran.stderr,
            piped=piped.stdout,
            environment=environment.stdout,
            text=await box.read_file("sub/a.txt"),
            data=list(await box.read_file("b.bin", text=False)),
            missing=await _raises(box.read_file("nope.txt"), FileNotFoundError),
            flooded=await _raises(
                box.exec(["head", "-c", "2000000", "/dev/zero"]), OutputLimitExceededError
            ),
            timed_out=await _raises(
                box.exec(["sleep", "30"], timeout=1, timeout_retry=False), TimeoutError
            ),
        )
        return state

    return solve


@scorer(metrics=[accuracy()])
def wrote_it() -> Any:
    async def score(state: TaskState, target: Target) -> Score:
        box = sandbox().as_type(SettledSandboxEnvironment)
        text = await box.read_file("sub/a.txt")
        return Score(value="C" if text == target.text else "I", metadata={"task": box.task})

    return score


def test_an_eval_runs_through_settled_and_cleanup_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", "1000000")
    bindir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("INSPECT_PROBE", "seen")
    monkeypatch.setenv("SETTLED_PROBE", "leaked")
    home, workspaces = tmp_path / "home", tmp_path / "workspaces"
    workspaces.mkdir()
    config = SettledSandboxConfig(home=str(home), workspaces=str(workspaces))
    task = Task(
        dataset=[Sample(input="write", target="hello\r\n")],
        solver=use_the_sandbox(),
        scorer=wrote_it(),
        sandbox=SandboxEnvironmentSpec("settled", config),
    )
    (run,) = eval(task, model="mockllm/model", log_dir=str(tmp_path / "logs"), display="none")
    log = read_eval_log(run.location)  # what the .eval file on disk says
    assert log.status == "success", log.error
    assert log.samples is not None
    (sample,) = log.samples
    facts = sample.metadata
    assert (facts["code"], facts["stdout"], facts["stderr"]) == (5, "hello\r\n", "err\n")
    assert facts["piped"] == "fed"
    python3 = os.path.join(bindir, "python3")  # Inspect's local rule: os.environ | exec env
    assert facts["environment"] == f"{python3}\nseen given withheld\n"
    assert facts["text"] == "hello\r\n" and facts["data"] == [0, 255, 10]
    assert facts["missing"] is True and facts["timed_out"] is True
    assert facts["flooded"] is True  # INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE, set to 1 MB here
    assert sample.scores is not None
    (score,) = sample.scores.values()
    assert score.value == "C"
    assert score.metadata is not None
    record = sample.store["settled"]
    assert record["task"] == score.metadata["task"]
    with Runtime(str(home)) as runtime:
        assert runtime.task_status(record["task"])["complete"] is True  # closed by cleanup
        closed = runtime.close_task(record["task"])  # complete: the same receipt, read back
    assert closed.complete and closed.receipt is not None
    assert record["close_receipt"] == closed.receipt["digest"]
    assert record["checkpoint"] == closed.receipt["checkpoint"]["digest"]
    assert closed.receipt["checkpoint"]["digest"].startswith("sha256:")
    # the exec commands by outcome; the 6 file reads and writes (the missing one included)
    # apart, none of them failed, and the receipt's own outcome keys them apart
    assert record["commands"] == {"succeeded": 3, "failed": 1, "timed_out": 1}
    assert record["file_io"] == {"succeeded": 6}
    failed = closed.receipt["outcome"]["commands"]["failed"]
    assert len(failed) == 1 and "(inspect-exec-" in failed[0]
    (event,) = [e for e in sample.events if e.event == "info" and e.source == "settled"]
    assert event.data == record
    assert list(workspaces.iterdir()) == []  # the sample's workspace went with its cleanup


def test_sandbox_settled_is_found_through_the_installed_entry_point() -> None:
    """A user's eval names `sandbox="settled"` and never imports settled: Inspect finds it by
    the `inspect_ai` entry point the package installs."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from inspect_ai.util._sandbox.registry import registry_find_sandboxenv\n"
        "found = registry_find_sandboxenv('settled')\n"
        "print(found.__module__, found.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["settled.integrations.inspect_ai", "SettledSandboxEnvironment"]
