"""Profile one session owner draining `head -c 2G /dev/zero` (py-spy per thread, perf).

    .venv/bin/pip install py-spy   # not a dependency of settled
    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python bench/results/drain_profile/profile_owner.py OUT

writes OUT.raw (py-spy, --threads --nonblocking, 500 Hz) and OUT.perf.data (perf -g, 999 Hz);
sampling slows the owner, so its times are not the benchmark's.
"""

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, BENCH)
from common import end_process, settled_rig  # noqa: E402

out = sys.argv[1]
spy_bin = os.path.join(os.path.dirname(sys.executable), "py-spy")
with settled_rig("drainprof") as rig:
    os.sync()
    a = rig.exec(argv=["sh", "-c", "sleep 0.5; head -c 2G /dev/zero"], boundary="auto")
    pid = str(a.owner_pid)
    spy = subprocess.Popen(
        [spy_bin, "record", "--pid", pid, "--threads", "--nonblocking", "--rate", "500",
         "--format", "raw", "--output", out + ".raw"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    perf = subprocess.Popen(
        ["perf", "record", "-F", "999", "-g", "-p", pid, "-o", out + ".perf.data"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    view = rig.runtime.wait(a.session, timeout=600)
    spy.wait(timeout=60)
    perf.wait(timeout=60)
    receipt = view["receipt"]
    print("owner cpu", receipt["owner"]["cpu_s"], "timings", receipt["timings"])
    end_process(receipt["owner"]["pid"], "owner")
    rig.forget_logs(a.session)
