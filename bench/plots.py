"""SVG figures of the benchmarks' distributions, drawn with matplotlib into the results directory.

Each `*_svg(out, data)` is a benchmark's ARTIFACTS entry in run.py: it writes `<name>.svg` from
the benchmark's own JSON (every individual run, never a summary) and returns the markdown line
that shows it. SVG, so the figure reads at any size in the README and diffs as text; fonts are
converted to paths so it looks the same everywhere. Without matplotlib (it is in the dev
extras) the figure is skipped and the line says so.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

SKIPPED = "Figure skipped: matplotlib is not installed (`pip install matplotlib`)."
BASELINE = "#7f7f7f"
SERIES = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend, text as paths; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "path"
    matplotlib.rcParams["svg.hashsalt"] = "settled"  # the same figure, the same bytes
    import matplotlib.pyplot as plt

    return plt


def cdf(ax: Any, values: Sequence[float], label: str, **style: Any) -> None:
    """The empirical CDF of `values` as a step line: what fraction of runs took <= x."""
    xs = sorted(values)
    ys = [(k + 1) / len(xs) for k in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, **style)


def median(values: Sequence[float]) -> float:
    xs = sorted(values)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def save(plt: Any, fig: Any, out: str, name: str, caption: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.svg")
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return f"![{caption}]({name}.svg)"


def admission_svg(out: str, data: dict[str, Any]) -> str:
    """admission.svg: the CDF of exec -> returned and exec -> receipt per launcher, beside
    posix_spawn + waitpid of the same `true` and a bare `python -I -S -c pass`."""
    plt = pyplot()
    if plt is None:
        return SKIPPED
    runs = data["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), layout="constrained", sharey=True)
    for ax, key, title in (
        (axes[0], "exec_return_s", "Runtime.exec(true) until it returns (command running)"),
        (axes[1], "exec_to_receipt_s", "Runtime.exec(true) until its process receipt"),
    ):
        for color, (variant, columns) in zip(SERIES, runs["settled"].items(), strict=False):
            ms = [v * 1e3 for v in columns[key]]
            cdf(ax, ms, f"settled, {variant} owner (p50 {median(ms):.1f} ms)", color=color, lw=2)
        for values, label, ls in (
            (runs["posix_spawn_wait_s"], "posix_spawn + waitpid of true", "-"),
            (runs["python_pass_s"], "python -I -S -c pass", "--"),
        ):
            ms = [v * 1e3 for v in values]
            cdf(ax, ms, f"{label} (p50 {median(ms):.1f} ms)", color=BASELINE, lw=1.5, ls=ls)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("fraction of runs with latency <= x")
    return save(plt, fig, out, "admission", "admission: CDF of exec to running and to receipt")


def drain_svg(out: str, data: dict[str, Any]) -> str:
    """drain.svg: throughput of every run, settled (in process and through the CLI) beside the
    `head | cat > FILE && sync` baseline of the same round, and each round's ratio."""
    plt = pyplot()
    if plt is None:
        return SKIPPED
    runs, size = data["runs"], data["params"]["bytes"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    rounds = [r["run"] for r in runs]
    width = 0.27
    for offset, key, label, color in (
        (-width, "baseline_s", "baseline: head | cat > FILE && sync", BASELINE),
        (0.0, "exec_to_receipt_s", "settled in process: exec until the receipt", SERIES[0]),
        (width, "cli_s", "settled CLI: exec, then wait", SERIES[1]),
    ):
        gbs = [size / r[key] / 1e9 if r.get(key) else 0.0 for r in runs]
        ax.bar([x + offset for x in rounds], gbs, width, label=label, color=color)
    ax.set_xlabel("round (interleaved)")
    ax.set_ylabel("GB/s, fsynced to disk")
    ax.set_title(f"{size / 2**30:.0f} GiB of zeros, drained and fsynced", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    for key, label, color in (
        ("ratio", "in process / baseline", SERIES[0]),
        ("cli_ratio", "CLI / baseline", SERIES[1]),
    ):
        values = [r[key] for r in runs if r.get(key)]
        bx.plot(rounds[: len(values)], values, "o-", color=color,
                label=f"{label} (median {median(values):.2f})")  # fmt: skip
    target = data["summary"].get("ratio_target")
    if target:
        bx.axhline(target, color="#d62728", ls="--", lw=1, label=f"target <= {target:g}")
    bx.axhline(1.0, color=BASELINE, lw=1)
    bx.set_xlabel("round")
    bx.set_ylabel("time / baseline time (lower is faster)")
    bx.set_title("each round's ratio", fontsize=10)
    bx.legend(fontsize=8)
    bx.grid(True, alpha=0.3)
    return save(plt, fig, out, "drain", "drain: throughput per round and its ratio")
