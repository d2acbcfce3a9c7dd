"""journal_memory: resident memory of the home's one journal daemon as tasks and directories grow.

Starts a daemon on a fresh run directory under /tmp and adds tasks to it the way `task new` does
(`ensure_watching`, one request each), reading the daemon's VmRSS from /proc after each step:
no task, 1 task, 100 tasks (each a workspace of 11 directories), 300 tasks, then one more task
whose workspace holds 10,000 directories. Per task and per directory costs are the differences.
Every step is measured after a barrier, so each walk has finished. The daemon is stopped at the
end, the trees removed.

    .venv/bin/python bench/journal_memory.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from settled.workspace.journal import lifecycle, wire


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _tree(root: str, directories: int) -> None:
    os.makedirs(root)
    for index in range(directories):
        os.makedirs(os.path.join(root, f"d{index // 100}", f"e{index}"), exist_ok=True)


def main() -> int:
    base = tempfile.mkdtemp(prefix="settled-journal-memory-")
    run_dir = os.path.join(base, "run")
    socket_path = lifecycle.ensure_running(run_dir)
    info = wire.ping(socket_path)
    assert info is not None
    pid = int(info["pid"])
    steps: list[dict[str, Any]] = []

    def measure(label: str) -> None:
        now = wire.ping(socket_path)
        assert now is not None
        steps.append(
            {
                "step": label,
                "tasks": now["tasks"],
                "directories": now["directories"],
                "rss_kib": _rss_kib(pid),
            }
        )
        print(json.dumps(steps[-1]), flush=True)

    try:
        measure("no task")
        count = 0
        for target in (1, 100, 300):
            while count < target:
                root = os.path.join(base, "ws", str(count))
                _tree(root, 9)  # 11 directories: the root, d0 and nine below it
                lifecycle.ensure_watching(f"t_{count}", root, run_dir)
                count += 1
            measure(f"{target} tasks")
        big = os.path.join(base, "ws", "big")
        _tree(big, 10_000)
        lifecycle.ensure_watching("t_big", big, run_dir)
        measure("one more task of 10,000 directories")
    finally:
        lifecycle.stop(socket_path)
        shutil.rmtree(base, ignore_errors=True)
    by = {step["step"]: step for step in steps}
    one, hundred = by["1 tasks"], by["100 tasks"]
    per_task = (hundred["rss_kib"] - one["rss_kib"]) / 99
    dirs_per_task = (hundred["directories"] - one["directories"]) / 99
    last, big_step = by["300 tasks"], by["one more task of 10,000 directories"]
    per_dir = (big_step["rss_kib"] - last["rss_kib"]) / (
        big_step["directories"] - last["directories"]
    )
    print(
        json.dumps(
            {
                "per_task_kib": round(per_task, 1),
                "directories_per_task": dirs_per_task,
                "per_directory_kib": round(per_dir, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
