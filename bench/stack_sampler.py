"""A sampler of a process's thread stacks, for the service benchmark (no profiler to install).

Started inside `settled serve` by bench/service_load.py when SETTLED_BENCH_SAMPLE names a file:
a daemon thread looks at every thread's stack (``sys._current_frames``) every ``EVERY_S`` and
counts, for the main thread (the event loop), the innermost frames of each sample, and for every
other thread whether it runs or waits; at exit the counts are written to the file as JSON.
"""

from __future__ import annotations

import atexit
import collections
import json
import sys
import threading
import time

EVERY_S = 0.005
WAITING = ("wait", "get", "select", "poll", "_worker", "acquire", "sleep", "notifies")


def _where(frame: object, depth: int) -> str:
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code  # type: ignore[attr-defined]
        parts.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}")
        frame = frame.f_back  # type: ignore[attr-defined]
    return " < ".join(parts)


def start(path: str) -> None:
    main = threading.main_thread().ident
    loop_top: collections.Counter[str] = collections.Counter()
    others: collections.Counter[str] = collections.Counter()
    samples = [0]

    def sample() -> None:
        while True:
            time.sleep(EVERY_S)
            samples[0] += 1
            me = threading.get_ident()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident == main:
                    loop_top[_where(frame, 4)] += 1
                else:
                    name = frame.f_code.co_name
                    state = "waits" if name in WAITING else "runs " + _where(frame, 3)
                    others[state] += 1

    def dump() -> None:
        with open(path, "w") as handle:
            json.dump({"samples": samples[0], "loop": loop_top.most_common(40),
                       "threads": others.most_common(40)}, handle, indent=1)  # fmt: skip

    threading.Thread(target=sample, name="bench-sampler", daemon=True).start()
    atexit.register(dump)
