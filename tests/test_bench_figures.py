"""The benchmarks' figures (issue 16): each distribution is drawn as SVG with matplotlib from the
benchmark's own JSON by `bench/run.py NAME --figures`, its markdown shows it, and the README
shows the committed ones. The JSON here is made by the test (the shape each benchmark writes,
seeded values), so the suite depends on no committed result."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("close_latency", "admission", "drain")  # exit -> verified close, admission, drain
# close_latency's parts of one run (bench/close_latency.py: PLOT_GROUPS and its two halves)
CLOSE_STEPS = ("final_pending", "sealed", "sessions_settled", "receipts", "final_scan",
               "checkpoint", "fenced", "outcome")  # fmt: skip
CLOSE_PARTS = (
    "exit_to_complete", "exit_to_wait", "wait_to_complete", "exit_to_settled_at",
    "settled_at_to_wait", "close_return", *(f"step_{step}" for step in CLOSE_STEPS),
)  # fmt: skip
MACHINE = {"kernel": "6.0", "nproc": 2, "python": "3.11", "date": "2026-12-07T00:00:00+00:00"}


def _ms(rng: random.Random, n: int, around: float) -> list[float]:
    return [rng.lognormvariate(0, 0.3) * around for _ in range(n)]


def close_latency(rng: random.Random) -> dict[str, Any]:
    runs = {
        variant: [{"ms": {key: rng.uniform(0.1, 30.0) for key in CLOSE_PARTS}} for _ in range(30)]
        for variant in ("warm", "fresh", "warm, checkpoint before")
    }
    baseline = [
        {"git_exit_to_commit_ms": rng.uniform(20, 30), "load1": 1.0,
         "git_durable_exit_to_commit_ms": rng.uniform(30, 50)}
        for _ in range(30)
    ]  # fmt: skip
    params = {"files": 1000, "changed": 10, "runs": 30}
    return {"machine": MACHINE, "params": params, "runs": runs, "baseline": baseline}


def admission(rng: random.Random) -> dict[str, Any]:
    settled = {
        variant: {"exec_return_s": _ms(rng, 40, 0.02), "exec_to_receipt_s": _ms(rng, 40, 0.04)}
        for variant in ("fresh", "fresh-fork", "warm")
    }
    runs = {"settled": settled, "posix_spawn_wait_s": _ms(rng, 40, 0.001),
            "python_pass_s": _ms(rng, 40, 0.008)}  # fmt: skip
    return {"machine": MACHINE, "runs": runs}


def drain(rng: random.Random) -> dict[str, Any]:
    runs = []
    for n in range(1, 8):
        base, inside, cli = (rng.uniform(0.9, 1.2) for _ in range(3))
        runs.append({"run": n, "baseline_s": base, "exec_to_receipt_s": inside, "cli_s": cli,
                     "ratio": inside / base, "cli_ratio": cli / base})  # fmt: skip
    return {"machine": MACHINE, "params": {"bytes": 1 << 30}, "runs": runs,
            "summary": {"ratio_target": 1.1}}  # fmt: skip


@pytest.mark.timeout(300)
def test_each_figure_is_redrawn_as_svg_from_its_benchmarks_json(tmp_path: Path) -> None:
    rng = random.Random(16)
    for name, make in (("close_latency", close_latency), ("admission", admission),
                       ("drain", drain)):  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(make(rng)))
        (tmp_path / f"{name}.md").write_text(f"## {name}\n\nits tables\n")
    redraw = [sys.executable, str(ROOT / "bench" / "run.py"), "all", "--figures"]
    done = subprocess.run(
        [*redraw, "--out", str(tmp_path)], capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr
    for name in FIGURES:
        figure = tmp_path / f"{name}.svg"
        root = ElementTree.parse(figure).getroot()
        assert root.tag.endswith("svg"), name
        assert len(root.findall(".//{http://www.w3.org/2000/svg}path")) > 50, name  # drawn
        page = (tmp_path / f"{name}.md").read_text()
        assert f"]({name}.svg)" in page and "its tables" in page, name


def test_the_readme_shows_every_committed_figure() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in FIGURES:
        assert (ROOT / "bench" / "results" / f"{name}.svg").is_file(), name
        assert f"](bench/results/{name}.svg)" in readme, name
