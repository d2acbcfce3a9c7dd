"""drain strategies without settled around them: what splice and fsync-behind buy on this disk.

A small drainer process reads `head -c SIZE /dev/zero` from a pipe enlarged to 1 MiB into a
file on the same filesystem as the baseline, BLAKE3 over every byte, fsync before it reports:
- `inline`: select, readv into a 1 MiB buffer, write (O_APPEND), hash; one fsync at the end
  (the owner's drain before this branch, without its index and lease);
- `behind`: the same, with an fsync every 8 MiB from a second thread (the owner's drain now);
- `splice`: `os.splice` pipe -> file (no O_APPEND: splice refuses it), the hash read back from
  the page cache (pread) and the fsync, both in the second thread every 8 MiB.
Each against `head | cat > FILE && sync FILE`, interleaved. Used by drain.py (part four).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any

DRAINER = r"""
import json, os, selectors, subprocess, sys, threading, time
from blake3 import blake3
kind, size, path = sys.argv[1], sys.argv[2], sys.argv[3]
EVERY = 8 << 20
r, w = os.pipe2(os.O_CLOEXEC)
try:
    import fcntl
    fcntl.fcntl(r, 1031, 1 << 20)
except OSError:
    pass
started = time.perf_counter()
head = subprocess.Popen(["head", "-c", size, "/dev/zero"], stdout=w)
os.close(w)
flags = os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
flags |= os.O_WRONLY | os.O_APPEND if kind != "splice" else os.O_RDWR
fd = os.open(path, flags, 0o600)
os.set_blocking(r, False)
sel = selectors.DefaultSelector()
sel.register(r, selectors.EVENT_READ)
buf = bytearray(1 << 20)
view = memoryview(buf)
hasher = blake3()
state = {"cursor": 0, "hashed": 0, "done": False}
poked = threading.Event()
def behind():
    back = bytearray(1 << 20)
    while True:
        poked.wait()
        poked.clear()
        finishing = state["done"]  # read before the cursor: this round then reaches the end
        end = state["cursor"]
        while kind == "splice" and state["hashed"] < end:
            want = min(len(back), end - state["hashed"])
            n = os.preadv(fd, [memoryview(back)[:want]], state["hashed"])
            hasher.update(memoryview(back)[:n])
            state["hashed"] += n
        os.fsync(fd)
        if finishing:
            return
thread = threading.Thread(target=behind)
if kind != "inline":
    thread.start()
reads, last = 0, 0
while True:
    sel.select()
    try:
        if kind == "splice":
            n = os.splice(r, fd, 1 << 20)
        else:
            n = os.readv(r, [buf])
    except BlockingIOError:
        continue
    if n == 0:
        break
    if kind != "splice":
        chunk = view[:n]
        written = 0
        while written < n:
            written += os.write(fd, chunk[written:])
        hasher.update(chunk)
    reads += 1
    state["cursor"] += n
    if kind != "inline" and state["cursor"] - last >= EVERY:
        last = state["cursor"]
        poked.set()
state["done"] = True
if kind == "inline":
    os.fsync(fd)
else:
    poked.set()
    thread.join()
elapsed = time.perf_counter() - started
head.wait()
times = os.times()
print(json.dumps({"s": elapsed, "cpu_s": times[0] + times[1], "bytes": state["cursor"],
                  "reads": reads, "digest": hasher.hexdigest()}))
"""

KINDS = ("inline", "behind", "splice")


def drain_once(kind: str, size: str, path: str) -> dict[str, Any]:
    """One drainer process; its JSON report. The file is removed after."""
    os.sync()
    done = subprocess.run(
        [sys.executable, "-c", DRAINER, kind, size, path],
        capture_output=True,
        check=False,
        timeout=600,
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    if done.returncode != 0:
        raise RuntimeError(f"drainer {kind}: {done.stderr.decode(errors='replace')}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report
