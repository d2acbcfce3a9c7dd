"""Where `settled exec` + `settled wait` spend their time around a drain: wall time of each
process and its top-level imports (-X importtime), 5 runs of `head -c 64M /dev/zero`.

    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python bench/results/drain_profile/cli_overhead.py
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

home = tempfile.mkdtemp(prefix="cli-overhead-", dir="/tmp")
workspace = tempfile.mkdtemp(prefix="cli-overhead-ws-", dir="/tmp")
env = {**os.environ, "SETTLED_HOME": home}
env.pop("PYTHONDONTWRITEBYTECODE", None)
settled = [sys.executable, "-X", "importtime", "-m", "settled"]


def run(*args: str) -> tuple[float, bytes, dict[str, float]]:
    started = time.perf_counter()
    done = subprocess.run([*settled, *args], env=env, capture_output=True, timeout=120)
    wall = time.perf_counter() - started
    tops = {}
    for line in done.stderr.decode().splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S+)$", line)
        if m:
            tops[m[2]] = int(m[1]) / 1000
    return wall, done.stdout, tops


task = json.loads(run("task", "new", "--workspace", workspace, "--json")[1])["task"]
walls: dict[str, list[float]] = {"exec": [], "wait": []}
imports: dict[str, list[float]] = {"exec": [], "wait": []}
top: dict[str, dict[str, float]] = {}
for _ in range(5):
    wall, out, tops = run("exec", "--task", task, "--json", "--", "head", "-c", "64M", "/dev/zero")
    walls["exec"].append(wall)
    imports["exec"].append(sum(tops.values()))
    top["exec"] = tops
    session = json.loads(out)["session"]
    wall, _, tops = run("wait", session, "--json")
    walls["wait"].append(wall)
    imports["wait"].append(sum(tops.values()))
    top["wait"] = tops
for verb in ("exec", "wait"):
    largest = sorted(top[verb].items(), key=lambda x: -x[1])[:6]
    print(
        f"{verb}: wall median {statistics.median(walls[verb]) * 1e3:.0f} ms, top-level imports "
        f"median {statistics.median(imports[verb]):.0f} ms; largest:",
        ", ".join(f"{m} {t:.1f}" for m, t in largest),
    )
run("close", task, "--json")
