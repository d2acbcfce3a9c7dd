"""Turn `strace -f -tt` of one fresh exec (between MARKER_BEGIN and MARKER_END) into the
timeline of its steps: python3 timeline.py ONE_EXEC_TRACE > one_exec_strace_timeline.txt"""

import re
import sys

LINE = re.compile(r"(\d+)\s+(\d+):(\d+):([\d.]+)")


def stamp(line: str) -> tuple[int, float]:
    found = LINE.match(line)
    assert found is not None, line
    hours, minutes, seconds = int(found[2]), int(found[3]), float(found[4])
    return int(found[1]), hours * 3600 + minutes * 60 + seconds


def roles(lines: list[str]) -> dict[int, str]:
    named: dict[int, str] = {}
    owner = None
    for line in lines:
        pid, _ = stamp(line)
        body = line.split(None, 2)[2]
        if body.startswith("execve(") and ".venv/bin/python" in body:
            owner = named[pid] = "owner"
        elif body.startswith("execve(") and "/usr/bin/true" in body:
            named[pid] = "command"
        elif owner and pid not in named and body.startswith("unshare(CLONE_NEWNS"):
            named[pid] = "init"
    return named


def kept(body: str) -> bool:
    marks = ("execve(", "clone3(", "fdatasync", "fsync(", "unshare(", "MARKER")
    return (
        any(mark in body for mark in marks)
        or body.startswith('mount("proc"')
        or ("mkdir(" in body and "cgroup" in body)
        or ("write(" in body and ("owner_pid" in body or '"running"' in body))
        or ("read(" in body and ('"running"' in body or "owner_pid" in body))
        or ("openat" in body and ("last_words" in body or "stdout.log" in body))
    )


def main(path: str) -> None:
    with open(path) as handle:
        lines = handle.read().splitlines()
    start = stamp(lines[0])[1]
    named = roles(lines)
    imports: dict[str, list[tuple[float, str]]] = {}
    print('One fresh `Runtime.exec(argv=["true"])` (boundary cgroup2+pidns) under `strace -f')
    print("-tt`: times are inflated by strace (every system call stops the process), so read the")
    print("order and the share of each step, not the totals. runtime = the caller (its threads),")
    print(
        "owner = the posix_spawned owner, init = its PID namespace init (clone3), command = true."
    )
    print()
    for line in lines:
        pid, at = stamp(line)
        body = line.split(None, 2)[2]
        role = named.get(pid, "runtime")
        ms = (at - start) * 1e3
        if "openat" in body and ".pyc" in body:
            module = re.search(r"/([\w.]+)/__pycache__/([\w.]+)\.cpython", body)
            name = f"{module[1]}/{module[2]}" if module else "?"
            imports.setdefault(role, []).append((ms, name))
        elif kept(body):
            print(f"{ms:8.2f} ms  {role:8s} {body[:112]}")
    print()
    for role, items in imports.items():
        names = ", ".join(name for _, name in items)
        print(
            f"{role}: {len(items)} .pyc files, {items[0][0]:.2f} to {items[-1][0]:.2f} ms: {names}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
