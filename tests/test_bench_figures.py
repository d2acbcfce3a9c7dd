"""The benchmarks' figures (issue 16): each distribution is drawn as SVG with matplotlib from the
benchmark's own JSON by `bench/run.py NAME --figures`, its markdown shows it, and the README
shows the committed ones."""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FIGURES = ("close_latency", "admission", "drain")  # exit -> verified close, admission, drain


@pytest.mark.timeout(300)
def test_each_figure_is_redrawn_as_svg_from_its_benchmarks_json(tmp_path: Path) -> None:
    for name in FIGURES:
        for suffix in (".json", ".md"):
            shutil.copy(RESULTS / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
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
        assert f"]({name}.svg)" in (tmp_path / f"{name}.md").read_text(), name


def test_the_readme_shows_every_committed_figure() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in FIGURES:
        assert (RESULTS / f"{name}.svg").is_file(), name
        assert f"](bench/results/{name}.svg)" in readme, name
