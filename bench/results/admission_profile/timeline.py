import re, sys

lines = open(sys.argv[1]).read().splitlines()


def ts(l):
    m = re.match(r"(\d+)\s+(\d+):(\d+):([\d.]+)", l)
    return int(m.group(1)), (int(m.group(2)) * 3600 + int(m.group(3)) * 60 + float(m.group(4)))


t0 = ts(lines[0])[1]
owner = init = command = None
for l in lines:
    pid, _ = ts(l)
    body = l.split(None, 2)[2]
    if body.startswith("execve(") and ".venv/bin/python" in body:
        owner = pid
    if body.startswith("execve(") and "/usr/bin/true" in body:
        command = pid
for l in lines:
    pid, _ = ts(l)
    body = l.split(None, 2)[2]
    if pid not in (owner, command) and owner and body.startswith("unshare(CLONE_NEWNS"):
        init = pid


def role(pid):
    return {owner: "owner", init: "init", command: "command"}.get(pid, "runtime")


out = []
imports = {}
for l in lines:
    pid, t = ts(l)
    d = (t - t0) * 1e3
    body = l.split(None, 2)[2]
    r = role(pid)
    if "openat" in body and ".pyc" in body:
        m = re.search(r"__pycache__/([\w.]+)\.cpython", body)
        p = re.search(r'"([^"]+)/__pycache__', body)
        name = (p.group(1).split("/")[-1] + "/" if p else "") + (m.group(1) if m else "?")
        imports.setdefault(r, []).append((d, name))
        continue
    keep = (
        any(k in body for k in ("execve(", "clone3(", "fdatasync", "fsync(", "unshare(", "MARKER"))
        or (body.startswith('mount("proc"'))
        or ("mkdir(" in body and "cgroup" in body)
        or ("write(" in body and ("owner_pid" in body or '"running"' in body))
        or ("read(" in body and ('"running"' in body or "owner_pid" in body))
        or ("openat" in body and ("last_words" in body or "stdout.log" in body))
    )
    if keep:
        out.append(f"{d:8.2f} ms  {r:8s} {body[:112]}")
print(
    'One fresh `Runtime.exec(argv=["true"])` (boundary cgroup2+pidns) under `strace -f -tt`: times'
)
print("are inflated by strace (every system call stops the process), so read the order and the")
print("share of each step, not the totals. runtime = the caller (its threads), owner = the")
print("posix_spawned owner, init = its PID namespace init (clone3), command = `true`.")
print()
for o in out:
    print(o)
print()
for r, items in imports.items():
    print(
        f"{r}: {len(items)} .pyc files, from {items[0][0]:.2f} to {items[-1][0]:.2f} ms: "
        + ", ".join(n for _, n in items)
    )
