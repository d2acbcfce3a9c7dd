"""schemathesis, with all its checks, against a live ``settled serve`` and its OpenAPI document.

The document must say what the server accepts and answers: every status code, media type,
header and body schema, and the bounds of every parameter (settled.grammar). The server runs in
a subprocess over a home under the test's tmp_path; the phases are examples, coverage and
fuzzing, bounded by ``--max-examples`` so the run takes well under two minutes on two cores.

Commands hypothesis invents do run, so schemathesis holds a token scoped to one task created
beforehand: it cannot create tasks (403) nor loosen the sandbox (no ``isolation: none``, no
``writable`` host path, no other user: 403), so each command runs contained, writing only its
workspace and /tmp. The stateful phase is left out (it only chains more of the same). At the
end every live session is cancelled and waited for, the task's sandbox is destroyed, and no
session may be left live; conftest stops every journal under tmp_path.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from settled.runtime import Runtime
from settled.server.openapi import document

TOKEN = "schemathesis-full-token-0123456789abcdef"
SCOPED = "schemathesis-scoped-token-0123456789abcdef"
CONFIG = Path(__file__).parent / "schemathesis" / "schemathesis.toml"
# A deeper run by hand: SETTLED_SCHEMATHESIS_EXAMPLES=100 SETTLED_SCHEMATHESIS_SEED=99
MAX_EXAMPLES = int(os.environ.get("SETTLED_SCHEMATHESIS_EXAMPLES", "12"))
SEED = os.environ.get("SETTLED_SCHEMATHESIS_SEED", "12")
START_S = 30.0
RUN_S = 300.0


@pytest.fixture
def task(tmp_path: Path) -> str:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with Runtime(str(tmp_path / "home")) as rt:
        return rt.new_task(str(workspace)).task


@pytest.fixture
def server(tmp_path: Path, task: str) -> Iterator[str]:
    """`settled serve` on an ephemeral port; its URL. Stopped with SIGTERM (then SIGKILL)."""
    home, log = tmp_path / "home", tmp_path / "serve.log"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": SCOPED, "tasks": [task]}]}))
    env = {**os.environ, "SETTLED_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "settled", "serve", "--home", str(home), "--port", "0"]
    argv += ["--tokens", str(tokens)]
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink
        )
    try:
        yield _listening(process, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        _end_everything(home, task)


def _listening(process: subprocess.Popen[bytes], log: Path) -> str:
    give_up = time.monotonic() + START_S
    while time.monotonic() < give_up:
        for line in log.read_text(errors="replace").splitlines():
            if "listening on http://" in line:
                return line.split("listening on ")[1].split()[0]
        if process.poll() is not None:
            raise AssertionError(f"serve exited {process.returncode}: {log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"serve did not listen in {START_S} s: {log.read_text()}")


def _end_everything(home: Path, task: str) -> None:
    """Every command the run admitted is stopped and settled; the task's sandbox destroyed."""
    with Runtime(str(home)) as rt:
        sessions = [s.session for s in rt.store.list_sessions(task)]
        for session in sessions:
            if rt.session_record(session).live:
                rt.cancel(session, "test teardown")
        for session in sessions:
            with contextlib.suppress(Exception):
                rt.wait(session, timeout=30)
        rt.destroy_task(task)
        live = [s for s in sessions if rt.session_record(s).live]
        assert not live, f"sessions still live after the run: {live}"


@pytest.mark.timeout(RUN_S + 60)
def test_schemathesis_all_checks_pass_against_the_openapi_document(
    server: str, task: str, tmp_path: Path
) -> None:
    schema = tmp_path / "openapi.json"
    schema.write_text(json.dumps(document()))
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG.read_text() + f'\n[parameters]\ntask = "{task}"\n')
    argv = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
        "run", str(schema), "--url", server, "--checks", "all",
        "--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES),
        "--seed", SEED, "--workers", "1", "--request-timeout", "30",
        "--header", f"Authorization: Bearer {SCOPED}",
        "--report", "junit", "--report-dir", str(tmp_path / "report"),
    ]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=RUN_S, stdin=subprocess.DEVNULL, cwd=tmp_path
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-20000:]
