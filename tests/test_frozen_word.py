"""A task `recover --host` froze is shown `frozen`, never `open` (issue 39, item 9).

Two homes on one shared SQLite store and object directory stand for two hosts, driven through
the CLI as a person would: host B declares host A vanished, and `status`, `ls` (text and JSON)
and the /ui's view (``Runtime.clocks``) all say `frozen`, from either host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from settled.runtime import Runtime
from settled.status import TASK_FROZEN, task_state_word


def _cli(tmp_path: Path, home: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")},
        "SETTLED_STORE": f"sqlite://{tmp_path}/shared/store.db",
        "SETTLED_OBJECTS": f"file://{tmp_path}/shared/objects",
    }
    return subprocess.run(
        [sys.executable, "-m", "settled", "--home", str(tmp_path / home), *argv],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def test_status_and_ls_say_frozen_after_recover_host(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    made = _cli(tmp_path, "A", "task", "new", "--workspace", str(tmp_path / "w"), "--json")
    assert made.returncode == 0, made.stderr
    task = json.loads(made.stdout)["task"]
    status = _cli(tmp_path, "A", "status", task)
    assert f"[{'open'}]" in status.stdout
    hosts = json.loads(_cli(tmp_path, "A", "hosts", "--json").stdout)["hosts"]
    host_a = next(h["host"] for h in hosts if h["home"] == str(tmp_path / "A"))
    _cli(tmp_path, "B", "hosts")  # B becomes a host of the store
    recovered = _cli(tmp_path, "B", "recover", "--host", host_a)
    assert recovered.returncode == 0, recovered.stderr

    for home in ("A", "B"):
        text = _cli(tmp_path, home, "status", task)
        assert text.returncode == 0, text.stderr
        assert f"task {task} [frozen]" in text.stdout and "[open]" not in text.stdout
        view = json.loads(_cli(tmp_path, home, "status", task, "--json").stdout)
        assert view["state"] == TASK_FROZEN and view["frozen"].startswith(f"host {host_a}")
        listed = _cli(tmp_path, home, "ls")
        row = next(line for line in listed.stdout.splitlines() if line.startswith(task))
        assert " frozen " in row and " open " not in row
        rows = json.loads(_cli(tmp_path, home, "ls", "--json").stdout)["tasks"]
        assert [r["state"] for r in rows if r["task"] == task] == [TASK_FROZEN]

    explained = _cli(tmp_path, "B", "explain", task)
    assert f"task {task} is frozen (host {host_a}" in explained.stdout, explained.stderr
    assert json.loads(_cli(tmp_path, "B", "explain", task, "--json").stdout)["state"] == "frozen"

    env = {"SETTLED_STORE": f"sqlite://{tmp_path}/shared/store.db",
           "SETTLED_OBJECTS": f"file://{tmp_path}/shared/objects"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with Runtime(str(tmp_path / "B")) as rt:  # what /ui's task view is made of
            clocks = rt.clocks(task)
            assert clocks["state"] == TASK_FROZEN and clocks["frozen"]
            assert task_state_word(rt.store.get_task(task)) == TASK_FROZEN
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
