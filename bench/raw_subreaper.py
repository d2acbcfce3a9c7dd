"""Raw subreaper baseline for bench/kill.py, run as its own process (so only it is a subreaper).

Usage: python -I raw_subreaper.py N TOKEN MARK_ENV. Becomes a child subreaper, starts the fork
storm (`sh` starting N `sleep 1000`), waits until all N are up, then times kill-to-evidence the
subreaper way: SIGKILL every descendant found under /proc/self/task/*/children, reap, repeat
until waitpid answers ECHILD and no descendant is left. Prints one JSON line. Bounded: gives up
(and kills everything it started) after 60 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
LIMIT_S = 60.0


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as handle:
                found.extend(int(p) for p in handle.read().split())
        except FileNotFoundError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    seen: list[int] = []
    frontier = children(pid)
    while frontier:
        seen.extend(frontier)
        frontier = [c for p in frontier for c in children(p)]
    return seen


def live_sleeps(pids: list[int]) -> int:
    count = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                stat = handle.read()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmd = handle.read()
        except OSError:
            continue
        if cmd == b"sleep\x001000\x00" and not stat[stat.rindex(b")") + 2 :].startswith(b"Z"):
            count += 1
    return count


def kill_and_reap(me: int) -> tuple[int, int, int]:
    """Kill and reap until ECHILD with no descendant: (rounds, killed, reaped)."""
    rounds = killed = reaped = 0
    while True:
        rounds += 1
        for pid in descendants(me):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        echild = False
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)  # every child here is ours: a blanket wait
            except ChildProcessError:
                echild = True
                break
            if pid == 0:
                break
            reaped += 1
        if echild and not descendants(me):
            return rounds, killed, reaped
        time.sleep(0.0005)


def main() -> int:
    n, token, mark = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(json.dumps({"error": f"prctl failed: {os.strerror(ctypes.get_errno())}"}))
        return 1
    me = os.getpid()
    storm = f"for i in $(seq {n}); do sleep 1000 & done; wait"
    env = {**os.environ, mark: token}
    devnull = os.open(os.devnull, os.O_RDWR)
    started = time.monotonic()
    os.posix_spawn(
        "/bin/sh",
        ["sh", "-c", storm],
        env,
        file_actions=[(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)],
    )
    up = None
    while time.monotonic() - started < LIMIT_S:
        if live_sleeps(descendants(me)) >= n:
            up = time.monotonic() - started
            break
        time.sleep(0.01)
    t0 = time.perf_counter()
    rounds, killed, reaped = kill_and_reap(me)
    elapsed = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "storm_up_s": up,
                "kill_to_empty_ms": elapsed * 1e3,
                "rounds": rounds,
                "killed": killed,
                "reaped": reaped,
            }
        )
    )
    return 0 if up is not None else 1


if __name__ == "__main__":
    sys.exit(main())
