"""-X importtime of a live `settled logs S --follow` and of `settled run -- sleep 0.3`.

    git archive 60bcbee src | tar -x -C /tmp/main-src     # the tree before this branch
    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python bench/results/drain_profile/importtime.py \
        [/tmp/main-src/src]

With a source directory, that tree runs (PYTHONPATH, its bytecode under /tmp/pycache-before);
without one, the installed settled. Prints the median over 7 runs of the summed top-level
cumulative import times, the cumulative time of `ctypes`, and whether `ctypes.util` or
`inotify_simple` were loaded.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

env = dict(os.environ)
env.pop("PYTHONDONTWRITEBYTECODE", None)
if len(sys.argv) > 1:
    env["PYTHONPATH"] = sys.argv[1]
    env["PYTHONPYCACHEPREFIX"] = "/tmp/pycache-before"
home = tempfile.mkdtemp(prefix="importtime-", dir="/tmp")
workspace = tempfile.mkdtemp(prefix="importtime-ws-", dir="/tmp")
env["SETTLED_HOME"] = home


def cli(*args: str, importtime: bool = False) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "settled"]
    return subprocess.run([*argv, *args], env=env, capture_output=True, timeout=120)


def parse(err: bytes) -> tuple[float, dict[str, int]]:
    total, modules = 0.0, {}
    for line in err.decode().splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            modules[m[4]] = int(m[2])
            total += int(m[2]) if m[3] == "" else 0
    return total / 1000, modules


task = json.loads(cli("task", "new", "--workspace", workspace, "--json").stdout)["task"]
totals: dict[str, list[float]] = {"logs --follow": [], "run": []}
ctypes_ms, heavy = [], set()
for _ in range(7):
    admitted = cli("exec", "--task", task, "--json", "--", "sh", "-c", "sleep 0.4; echo hi")
    session = json.loads(admitted.stdout)["session"]
    done = cli("logs", session, "--stream", "stdout", "--follow", importtime=True)
    assert done.stdout == b"hi\n", done
    total, modules = parse(done.stderr)
    totals["logs --follow"].append(total)
    ctypes_ms.append(modules.get("ctypes", 0) / 1000)
    heavy |= {m for m in ("ctypes.util", "inotify_simple") if m in modules}
    total, modules = parse(cli("run", "--task", task, "--", "sleep", "0.3", importtime=True).stderr)
    totals["run"].append(total)
    heavy |= {m for m in ("ctypes.util", "inotify_simple") if m in modules}
medians = {k: round(statistics.median(v), 1) for k, v in totals.items()}
print(medians, "ctypes ms", round(statistics.median(ctypes_ms), 2), "heavy:", sorted(heavy))
cli("close", task, "--json")
