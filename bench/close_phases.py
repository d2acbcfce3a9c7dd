"""close_phases: where one close's time goes, by instrumented function, and an A/B of two trees.

Not part of ``bench/run.py``: a tool for whoever works on the close. ``close_phases.py N
[VARIANT]`` runs N closes of ``close_latency``'s workload (a fresh 1,000-file task, the command
rewriting 10 files, ``wait``, ``close_task``) in one process, one of its variants (default
``warm``), with ``time.perf_counter`` around the functions below, and prints the medians of the
close's parts (from the receipt's timings and the close steps' ``recorded_at``, as
``close_latency`` splits them) and each function's time per close. ``CLOSE_PHASES_JSON=FILE``
appends every close's parts to FILE (one JSON object a line), which is how two trees were
compared, interleaved, on a shared machine: run this script from each tree's own virtualenv in
turn, a few closes at a time, alternating which goes first, and compare the medians.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import close_latency as cl
from common import scratch

TARGETS = (
    ("settled.workspace.checkpoint", "WorkspaceService.final_scan"),
    ("settled.workspace.checkpoint", "WorkspaceService.checkpoint"),
    ("settled.workspace.checkpoint", "WorkspaceService._write_manifest"),
    ("settled.workspace.checkpoint", "WorkspaceService._read_back"),
    ("settled.workspace.checkpoint", "WorkspaceService.release"),
    ("settled.workspace.scan", "_Scanner.record"),
    ("settled.workspace.scan", "_Scanner.finish"),
    ("settled.workspace.scan", "_Scanner.publish"),
    ("settled.workspace.walk", "ReadAhead.fetch"),
    ("settled.workspace.verified", "VerifiedRecord.record"),
    ("settled.workspace.verified", "VerifiedRecord.known"),
    ("settled.store.sqlite", "SQLiteStore.record_close_step"),
    ("settled.store.sqlite", "SQLiteStore.record_checkpoint"),
    ("settled.store.sqlite", "SQLiteStore.get_task"),
)
PARTS = (
    "exit_to_complete",
    "evidence_after_exit",
    "exit_to_settled_at",
    "settled_at_to_wait",
    *(f"step_{name}" for name in cl.STEP_LABELS),
    "close_return",
)


def instrument(acc: dict[str, list[float]]) -> None:
    """Wrap each target (a method, found by its qualified name) with a timer into ``acc``."""
    for module_name, qualified in TARGETS:
        owner: Any = importlib.import_module(module_name)
        *path, name = qualified.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            print(f"not found, not timed: {module_name}.{qualified}", file=sys.stderr)
            continue
        setattr(owner, name, _timed(getattr(owner, name), qualified, acc))


def _timed(fn: Callable[..., Any], label: str, acc: dict[str, list[float]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc.setdefault(label, []).append(time.perf_counter() - started)

    return timed


def main(argv: list[str]) -> int:
    closes = int(argv[0]) if argv else 12
    variant = argv[1] if len(argv) > 1 else "warm"
    acc: dict[str, list[float]] = {}
    instrument(acc)
    rows = []
    with scratch("close-phases") as root:
        runner = cl.Variant(variant, root)
        try:
            runner.once(root, cl.QUICK, -1)  # untimed: the warm zygote, caches
            acc.clear()
            rows = [runner.once(root, cl.QUICK, i)["ms"] for i in range(closes)]
        finally:
            runner.close()
    for part in PARTS:
        print(f"{part:28s} p50 {statistics.median(r[part] for r in rows):8.2f} ms")
    for label, times in acc.items():
        per_close = sum(times) / closes * 1000
        print(f"  {label:40s} {len(times) / closes:6.1f} calls {per_close:8.2f} ms per close")
    out = os.environ.get("CLOSE_PHASES_JSON")
    if out:
        with open(out, "a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
