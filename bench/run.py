"""Run settled's benchmarks: python bench/run.py [NAME|all] [--quick] [--out DIR].

Each benchmark writes `<name>.json` (every run), `<name>.md` (its page: the command, the commit,
the machine, its tables) and its figure if it has one into the output directory, and
regenerates `README.md` there with every table. The output directory is outside the repository
(default `$TMPDIR/settled-bench`, `.../quick` with `--quick`; or SETTLED_BENCH_OUT): a
benchmark's committed page in bench/results/ is updated by copying its `<name>.md` (and figure)
there. Nothing is asserted about speed: results are ratios against baselines measured in the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import admission
import checkpoint
import close_latency
import drain
import home_age
import http_bench
import isolation
import kill
import limits
import load
import netproxy
import objects_s3
import owner_cost
import peers
import plots
import podnet
import pods
import proof_cost
import receipt
import remote
import service_load
import soak
import startup
import store_ops
import ui_feed
from common import RESULTS_DIR, log, page_head, write_markdown, write_results

BENCHMARKS = {
    "drain": drain.run,
    "admission": admission.run,
    "startup": startup.run,
    "kill": kill.run,
    "checkpoint": checkpoint.run,
    "close_latency": close_latency.run,
    "load": load.run,
    "http": http_bench.run,
    "receipt": receipt.run,
    "home_age": home_age.run,
    "isolation": isolation.run,
    "pods": pods.run,
    "proof_cost": proof_cost.run,
    "podnet": podnet.run,
    "netproxy": netproxy.run,
    "limits": limits.run,
    "remote": remote.run,
    "objects_s3": objects_s3.run,
    "owner_cost": owner_cost.run,
    "peers": peers.run,
    "store_ops": store_ops.run,
    "soak": soak.run,
    "ui_feed": ui_feed.run,
    "service_load": service_load.run,
}
# Benchmarks that also write a file beside their results (a plot): called with (out_dir, data),
# they return a markdown line to append to the benchmark's section.
ARTIFACTS = {
    "close_latency": close_latency.plot,
    "admission": plots.admission_svg,
    "drain": plots.drain_svg,
    "owner_cost": owner_cost.plot,
}


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM/SIGHUP unwind like Ctrl-C, so every cleanup (processes, cgroups, temp) runs."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", default="all", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--quick", action="store_true", help="small sizes: a CI smoke run")
    parser.add_argument("--out", help=f"results directory (default {RESULTS_DIR}[/quick])")
    parser.add_argument(
        "--figures", action="store_true",
        help="only redraw the figures of results already in the directory (no run)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    out = args.out or (os.path.join(RESULTS_DIR, "quick") if args.quick else RESULTS_DIR)
    if args.figures:
        return redraw(out, list(ARTIFACTS) if args.which == "all" else [args.which])
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    started = time.monotonic()
    for name in names:
        log(f"== {name}{' (quick)' if args.quick else ''}")
        t0 = time.monotonic()
        data, markdown = BENCHMARKS[name](args.quick)
        data["duration_s"] = time.monotonic() - t0
        artifact = ARTIFACTS.get(name)
        if artifact is not None:
            markdown = markdown.rstrip() + "\n\n" + artifact(out, data)
        title, _, body = markdown.partition("\n")
        markdown = f"{title}\n\n{page_head(name, data)}\n{body}"
        write_results(out, name, data, markdown)
        print(markdown + "\n", flush=True)
        log(f"== {name} done in {data['duration_s']:.1f} s -> {out}/{name}.json, {name}.md")
    log(f"all done in {time.monotonic() - started:.1f} s; tables in {out}/README.md")
    return 0


def redraw(out: str, names: list[str]) -> int:
    """Each figure again from its benchmark's JSON, and its line in the benchmark's markdown."""
    for name in names:
        artifact = ARTIFACTS.get(name)
        source = os.path.join(out, f"{name}.json")
        if artifact is None or not os.path.exists(source):
            log(f"{name}: no figure, or no {source} to draw it from")
            continue
        with open(source) as handle:
            data = json.load(handle)
        with open(os.path.join(out, f"{name}.md")) as handle:
            kept = [line for line in handle.read().rstrip().split("\n\n") if "![" not in line]
        write_markdown(out, name, "\n\n".join([*kept, artifact(out, data)]))
        log(f"{name}: figure redrawn in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
