"""Resource walls: where memory, pids and cpu can be limited on this host, the host's defaults,
a session's limits, writing them, reading back what the kernel saw, and removing the cgroups.

Where (`controllers()`, probed once per process). Per controller: the cgroup v2 hierarchy when
its unified tree offers it and settled can hand it down to a session's cgroup (`+ctl` in the
`cgroup.subtree_control` of the owner's own cgroup, then of `settled/` and of each task's
directory: by the no-internal-process rule a cgroup that holds processes, as the owner's own
does unless it is the root, can hand no controller down, so there it must be delegated
already); else the v1 hierarchy mounted for it; else missing, with why. On this kind of hybrid
host memory, pids and cpu are v1 (the unified tree offers only hugetlb).

Layout, per hierarchy: one `settled` cgroup under the owner's own cgroup, the ceiling of every
command together. A session's v2 cgroup is its boundary's (`settled/<task>/<session>`); its v1
cgroups are `settled/owner-<pid>-<start>`, named for the owner process (one owner serves one
session), so the placer can join them before the owner knows its session (a zygote's spare),
recovery finds them from the session's recorded owner, and `sweep` removes those of owners
that are gone. `settled` itself is removed with its last session, as cgroup2.py does.

Host defaults (the receipt names each limit's source: explicit, task or host):
- memory: all commands together at most 3/4 of min(MemTotal, the owner's own cgroup limit), so
  the quarter left keeps the owners, the launchers, the journal and the host's own processes
  running; one session by default at most half of that ceiling, so a single hog meets its own
  session's OOM killer before it can press on every other session. Swap counts within the
  limit (v1 memsw where the host swaps, v2 swap.max 0): a command cannot page its way past it.
- pids: all commands together at most half of min(pid_max, threads-max) (here 16384 of 32768),
  so a fork storm can never take the pids the host, the owners and their threads need; one
  session by default at most min(4096, a quarter of that), so four storms at once still leave
  room under the ceiling. A session's count includes its namespace's init.
- cpu: no quota by default (a build may use every CPU), but every session is a cgroup of its
  own under `settled`: under contention the scheduler weighs a session's processes together as
  one group against each owner, so a storm of busy loops cannot starve the owner that enforces
  its deadline. A quota (`cpus`) is cpu.cfs_quota_us (v1) or cpu.max (v2) over 100 ms periods.

Must never: place an owner (or any settled process) in a session's cgroup, or remove a cgroup
that still holds a process of a live session. Imported on the owner's launch path: os and
errno only (no typing, json or dataclasses at run time).
"""

from __future__ import annotations

import errno
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CONTROLLERS = ("memory", "pids", "cpu")
LIMITS = ("memory", "pids", "cpus")  # the names the faces and the receipt use
CONTROLLER_OF = {"memory": "memory", "pids": "pids", "cpus": "cpu"}
ROOT_DIR_NAME = "settled"
OWNER_PREFIX = "owner-"
CPU_PERIOD_US = 100_000
MIN_MEMORY = 4 << 20  # below this not even a shell starts; the grammar's floor
MIN_CPUS = 0.01  # 1 ms of every 100 ms period: the kernel's smallest quota
MIN_PIDS = 2  # the namespace's init and the command (the placer, reaped first, counted at clone)
V2_FILES = {"memory": "memory.max", "pids": "pids.max", "cpu": "cpu.max"}

_FOUND: list[dict[str, dict[str, str | None]]] = []  # once per process (a zygote's: its forks')
WALLS_ENV = "SETTLED_OWNER_WALLS"  # a fresh owner's: its launcher's answers, so it probes none


def controllers() -> dict[str, dict[str, str | None]]:
    """{controller: {"version": "v2" | "v1" | None, "root": the `settled` directory or None,
    "why": why missing or None, "v2_why": why not v2, for one in v1}}, probed once per
    process (a fresh owner takes its launcher's, from WALLS_ENV: same host, same cgroups)."""
    if not _FOUND:
        given = os.environ.get(WALLS_ENV)
        _FOUND.append(_adopted(given) if given else _probe())
    return _FOUND[0]


def exported() -> str:
    """This process's answers (controllers and defaults) for a fresh owner's WALLS_ENV."""
    lines = [
        "\t".join((name, w["version"] or "", w["root"] or "", (w["why"] or "").replace("\t", " ")))
        for name, w in controllers().items()
    ]
    found = defaults()
    lines += [
        "\t".join((kind, *("" if found[kind][n] is None else repr(found[kind][n]) for n in LIMITS)))
        for kind in ("ceiling", "session")
    ]
    return "\n".join(lines)


def _adopted(text: str) -> dict[str, dict[str, str | None]]:
    found: dict[str, dict[str, str | None]] = {}
    for line in text.split("\n"):
        name, *fields = line.split("\t")
        if name in CONTROLLERS:
            version, root, why = fields
            found[name] = {"version": version or None, "root": root or None, "why": why or None}
        elif name in ("ceiling", "session") and not _DEFAULTS:
            _GIVEN[name] = {n: _number_of(v) for n, v in zip(LIMITS, fields, strict=True)}
    if len(_GIVEN) == 2:
        _DEFAULTS.append(dict(_GIVEN))
    return found


_GIVEN: dict[str, dict[str, Any]] = {}


def _number_of(text: str) -> int | float | None:
    if not text:
        return None
    return float(text) if "." in text else int(text)


def forget() -> None:
    """Probe again at the next ask (tests, after they changed the hierarchy)."""
    _FOUND.clear()
    _DEFAULTS.clear()
    _GIVEN.clear()


def _probe() -> dict[str, dict[str, str | None]]:
    found: dict[str, dict[str, str | None]] = {}
    v2 = _v2_base()
    v1 = _v1_dirs()
    for name in CONTROLLERS:
        why_not_v2 = _v2_refuses(v2, name)
        if why_not_v2 is None:
            assert v2 is not None
            found[name] = {"version": "v2", "root": os.path.join(v2, ROOT_DIR_NAME), "why": None}
        elif name in v1 and os.access(v1[name], os.W_OK):
            found[name] = {
                "version": "v1",
                "root": os.path.join(v1[name], ROOT_DIR_NAME),
                "why": None,
                "v2_why": why_not_v2,
            }
        else:
            v1_why = (
                f"its v1 hierarchy at {v1[name]} is not writable by this process"
                if name in v1
                else "no v1 hierarchy is mounted for it"
            )
            found[name] = {"version": None, "root": None, "why": f"{why_not_v2}; {v1_why}"}
    return found


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _v2_base() -> str | None:
    """The owner's own cgroup in the v2 hierarchy (SETTLED_CGROUP_ROOT overrides, as for the
    boundary), or None."""
    override = os.environ.get("SETTLED_CGROUP_ROOT")
    if override:
        return override
    from settled.boundary.cgroup2 import _cgroup2_mounts, _own_cgroup

    own = _own_cgroup()
    if own is None:
        return None
    for mount in _cgroup2_mounts():
        base = os.path.join(mount, own.lstrip("/"))
        if os.path.exists(os.path.join(base, "cgroup.controllers")):
            return base
    return None


def _v2_refuses(base: str | None, name: str) -> str | None:
    """Why the v2 hierarchy cannot limit `name` for a session, or None when it can."""
    if base is None:
        return "no cgroup v2 hierarchy holds this process"
    try:
        offered = _read(os.path.join(base, "cgroup.controllers")).split()
        delegated = _read(os.path.join(base, "cgroup.subtree_control")).split()
    except OSError as exc:
        return f"cgroup v2 at {base}: {exc.strerror}"
    if name not in offered:
        return f"the cgroup v2 hierarchy offers no {name} controller at {base}"
    if name in delegated:
        return None
    try:  # the root cgroup, or one with no process of its own, may hand it down
        with open(os.path.join(base, "cgroup.subtree_control"), "w") as handle:
            handle.write(f"+{name}")
    except OSError as exc:
        return (
            f"cgroup v2 at {base} cannot hand {name} down to settled's cgroups "
            f"({exc.strerror}: it holds processes of its own)"
        )
    return None


def _v1_dirs() -> dict[str, str]:
    """{controller: this process's own cgroup directory in the v1 hierarchy mounted for it}."""
    mounts: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            kind, _source, options = [*right.split(), "", ""][:3]
            if kind != "cgroup":
                continue
            fields = left.split()
            for option in options.split(","):
                if option in CONTROLLERS and option not in mounts:
                    mounts[option] = (fields[4], fields[3])  # mount point, its root
    dirs: dict[str, str] = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _number, names, own = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                if name in mounts and name not in dirs:
                    point, root = mounts[name]
                    relative = os.path.relpath(own, root) if own.startswith(root) else None
                    if relative is not None:
                        dirs[name] = os.path.normpath(os.path.join(point, relative))
    return dirs


# -- the host's defaults and a session's limits ---------------------------------------------


def host_facts() -> dict[str, int]:
    """What the defaults are made from: MemTotal, the owner's own memory cgroup limit (its
    smallest along the path up), pid_max, threads-max and the CPUs this process may use."""
    mem_total = 0
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
                break
    pid_max = int(_read("/proc/sys/kernel/pid_max"))
    threads_max = int(_read("/proc/sys/kernel/threads-max"))
    return {
        "mem_total": mem_total,
        "mem_limit": _own_memory_limit() or mem_total,
        "pid_max": pid_max,
        "threads_max": threads_max,
        "cpus": len(os.sched_getaffinity(0)),
    }


def _own_memory_limit() -> int | None:
    found = controllers()["memory"]
    if found["root"] is None:
        return None
    limits = []
    here = os.path.dirname(found["root"])
    name = "memory.max" if found["version"] == "v2" else "memory.limit_in_bytes"
    while os.path.exists(os.path.join(here, name)):
        text = _read(os.path.join(here, name)).strip()
        if text.isdigit():
            limits.append(int(text))
        here = os.path.dirname(here)
    return min(limits) if limits else None


def host_defaults(facts: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """{"ceiling": every command together, "session": one session's default}, by limit name.
    Pure given `facts` (host_facts() when None)."""
    facts = facts if facts is not None else host_facts()
    memory_room = min(facts["mem_total"], facts["mem_limit"])
    memory_ceiling = memory_room * 3 // 4
    pids_ceiling = min(facts["pid_max"], facts["threads_max"]) // 2
    return {
        "ceiling": {"memory": memory_ceiling, "pids": pids_ceiling, "cpus": None},
        "session": {
            "memory": memory_ceiling // 2,
            "pids": min(4096, pids_ceiling // 4),
            "cpus": None,
        },
    }


_DEFAULTS: list[dict[str, dict[str, Any]]] = []


def defaults() -> dict[str, dict[str, Any]]:
    """host_defaults() of this host, once per process."""
    controllers()  # a fresh owner takes its launcher's defaults with its controllers
    if not _DEFAULTS:
        _DEFAULTS.append(host_defaults())
    return _DEFAULTS[0]


def effective(
    explicit: dict[str, Any], host: dict[str, Any], task: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """Each limit's value and where it came from: `explicit` (the exec's), else `task` (the
    task's default), else `host` (host_defaults()["session"]). Pure."""
    chosen: dict[str, dict[str, Any]] = {}
    for name in LIMITS:
        for source, given in (("explicit", explicit), ("task", task or {}), ("host", host)):
            if given.get(name) is not None or source == "host":
                chosen[name] = {"value": given.get(name), "source": source}
                break
    return chosen


def refusal(explicit: dict[str, Any]) -> str | None:
    """Why limits asked for explicitly cannot be enforced here (one line), or None: a value
    out of range, or a controller this host lacks. Admission refuses on it."""
    for name in LIMITS:
        value = explicit.get(name)
        if value is None:
            continue
        floor = {"memory": MIN_MEMORY, "pids": MIN_PIDS, "cpus": MIN_CPUS}[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < floor:
            return f"{name} must be a number of at least {floor}, got {value!r}"
        found = controllers()[CONTROLLER_OF[name]]
        if found["version"] is None:
            return f"--{name} cannot be enforced on this host: {found['why']}"
    return None


# -- a session's cgroups ----------------------------------------------------------------------


def owner_dir(pid: int, start: int | None) -> str:
    return f"{OWNER_PREFIX}{pid}-{start}"


def v1_paths(name: str) -> dict[str, str]:
    """{controller: the session's v1 cgroup named `name`} for every controller found in v1."""
    return {
        c: os.path.join(str(w["root"]), name)
        for c, w in controllers().items()
        if w["version"] == "v1"
    }


def make(paths: dict[str, str], *, ceiling: bool = True) -> list[str]:
    """Create each session cgroup (and its `settled` parent, with the host's ceiling when
    `ceiling`, if this makes it); returns what it created. A session cgroup that exists already
    is refused (EEXIST): it is never shared. On failure removes what it made, raises OSError."""
    made: list[str] = []
    try:
        for controller, path in paths.items():
            for _attempt in range(100):  # an owner may remove an empty `settled` under us
                _ensure_root(os.path.dirname(path), controller, ceiling)
                try:
                    os.mkdir(path)
                except FileNotFoundError:
                    continue
                made.append(path)
                break
            else:
                raise OSError(errno.ENOENT, f"could not create {path}")
    except BaseException:
        remove(made)
        raise
    return made


def _ensure_root(root: str, controller: str, ceiling: bool) -> None:
    try:
        os.mkdir(root)
    except FileExistsError:
        return
    if ceiling:
        version = "v2" if os.path.exists(os.path.join(root, "cgroup.controllers")) else "v1"
        write(root, controller, version, defaults()["ceiling"].get(_LIMIT_OF[controller]))


def join(paths: list[str]) -> None:
    """Move this single-threaded process into each v1 cgroup. Through `tasks`, not
    `cgroup.procs`: the kernel moves the writing thread alone without the global threadgroup
    lock, whose writer waits for an RCU grace period (~8 ms when no migration happened lately);
    a process of one thread is wholly moved. The placer pays even that ahead."""
    for path in paths:
        with open(os.path.join(path, "tasks"), "w") as handle:
            handle.write("0")


def _put(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def write(path: str, controller: str, version: str, value: int | float | None) -> None:
    """Set one controller's limit on the cgroup at `path`; None leaves it unlimited."""
    if value is None:
        return
    if controller == "memory":
        if version == "v2":
            _put(os.path.join(path, "memory.max"), str(int(value)))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _put(os.path.join(path, "memory.swap.max"), "0")
        else:
            _put(os.path.join(path, "memory.limit_in_bytes"), str(int(value)))
            memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
            if _has_swap() and os.path.exists(memsw):
                _put(memsw, str(int(value)))
    elif controller == "pids":
        _put(os.path.join(path, "pids.max"), str(int(value)))
    elif controller == "cpu":
        quota = max(1000, round(float(value) * CPU_PERIOD_US))
        if version == "v2":
            _put(os.path.join(path, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
        else:
            _put(os.path.join(path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            _put(os.path.join(path, "cpu.cfs_quota_us"), str(quota))


_SWAP: list[bool] = []


def _has_swap() -> bool:
    """Whether the host swaps at all (a v1 memsw limit is written only then: without swap it
    is the memory limit again, and the kernel then counts the limit's hits in neither)."""
    if not _SWAP:
        with open("/proc/meminfo") as handle:
            total = next((line.split()[1] for line in handle if line.startswith("SwapTotal:")), "0")
        _SWAP.append(total != "0")
    return _SWAP[0]


def write_all(paths: dict[str, str], version: str, limits: dict[str, Any]) -> None:
    """Each controller's limit (by limit name in `limits`) on its cgroup in `paths`."""
    for controller, path in paths.items():
        write(path, controller, version, limits.get(_LIMIT_OF[controller]))


_LIMIT_OF = {"memory": "memory", "pids": "pids", "cpu": "cpus"}


def enable_v2(task_dir: str, ceiling: dict[str, Any]) -> list[str]:
    """Hand the v2 controllers down to a task's session cgroups: `+ctl` in the subtree_control
    of `settled/` (with the ceiling, once) and of the task's directory, which hold no process.
    Returns the controllers enabled (those controllers() put in v2)."""
    names = [c for c, w in controllers().items() if w["version"] == "v2"]
    if not names:
        return []
    root = os.path.dirname(task_dir)
    text = " ".join(f"+{n}" for n in names)
    current = _read(os.path.join(root, "cgroup.subtree_control")).split()
    if any(n not in current for n in names):
        _put(os.path.join(root, "cgroup.subtree_control"), text)
        for name in names:
            write(root, name, "v2", ceiling.get(_LIMIT_OF[name]))
    _put(os.path.join(task_dir, "cgroup.subtree_control"), text)
    return names


# -- what the kernel saw, and the end -------------------------------------------------------


def _fields(path: str) -> dict[str, int]:
    try:
        return {
            key: int(value)
            for key, value in (line.split() for line in _read(path).splitlines() if line.strip())
        }
    except (OSError, ValueError):
        return {}


def _number(path: str) -> int | None:
    try:
        text = _read(path).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def evidence(path: str, controller: str, version: str) -> dict[str, Any]:
    """What the kernel counted for one controller of a session's cgroup: read after death
    evidence, before the cgroup is removed (its counters go with it)."""
    if controller == "memory":
        if version == "v2":
            events = _fields(os.path.join(path, "memory.events"))
            return {
                "peak": _number(os.path.join(path, "memory.peak")),
                "oom_kill": events.get("oom_kill", 0),
                "hit_limit": events.get("max", 0),
            }
        control = _fields(os.path.join(path, "memory.oom_control"))
        hits = [_number(os.path.join(path, f"memory.{c}failcnt")) or 0 for c in ("", "memsw.")]
        return {
            "peak": _number(os.path.join(path, "memory.max_usage_in_bytes")),
            "oom_kill": control.get("oom_kill", 0),
            "hit_limit": max(hits),
        }
    if controller == "pids":
        return {
            "peak": _number(os.path.join(path, "pids.peak")),
            "refused": _fields(os.path.join(path, "pids.events")).get("max", 0),
        }
    stat = _fields(os.path.join(path, "cpu.stat"))
    if version == "v2":
        return {
            "nr_throttled": stat.get("nr_throttled", 0),
            "throttled_s": round(stat.get("throttled_usec", 0) / 1e6, 6),
            "usage_s": round(stat.get("usage_usec", 0) / 1e6, 6),
        }
    return {
        "nr_throttled": stat.get("nr_throttled", 0),
        "throttled_s": round(stat.get("throttled_time", 0) / 1e9, 6),
    }


def members(path: str) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
    except OSError:
        return []


def remove(paths: list[str], *, kill: bool = False, timeout: float = 5.0) -> list[str]:
    """Remove each cgroup, then its `settled` parent if that is empty; `kill`: SIGKILL what is
    still listed in it (v1 has no cgroup.kill) and retry until `timeout`, for a session whose
    processes are proven dead or must be; without it, a populated cgroup is left as it is.
    Returns the cgroups that could not be removed."""
    import time

    left = []
    for path in paths:
        give_up = time.monotonic() + (timeout if kill else 0.0)
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > give_up:
                    left.append(path)
                    break
            if kill:
                for pid in members(path):
                    try:  # noqa: SIM105 - contextlib stays off the owner's launch path
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
            time.sleep(0.001)
        try:  # noqa: SIM105
            os.rmdir(os.path.dirname(path))  # the last session of the host takes `settled`
        except OSError:
            pass
    return left


def owner_paths(pid: int, start: int | None) -> list[str]:
    """Every v1 cgroup the owner (pid, start) would have made, existing or not."""
    return list(v1_paths(owner_dir(pid, start)).values())


def _runs(pid: int, start: int | None) -> bool:
    from settled.boundary import procfs

    seen = procfs.start_and_state(pid)
    return seen is not None and seen[0] == start and seen[1] != "Z"


def sweep(alive: Any = None) -> list[str]:
    """Remove the empty v1 cgroups of owners that no longer run: a spare that was killed, an
    owner that died before or after its claim, a session recovered while an orphan of a
    boundary without evidence still ran in it. Kills nothing: what still runs there is a
    session's, for its recovery or its task's destroy. `alive(pid, start)`: whether that owner
    still runs (default: its start time in /proc, and not a zombie). Returns what was
    removed."""
    if alive is None:
        alive = _runs
    removed = []
    for found in controllers().values():
        if found["version"] != "v1" or found["root"] is None:
            continue
        try:
            names = os.listdir(str(found["root"]))
        except OSError:
            continue
        for name in names:
            if not name.startswith(OWNER_PREFIX):
                continue
            pid_text, _, start_text = name[len(OWNER_PREFIX) :].partition("-")
            if not pid_text.isdigit():
                continue
            start = int(start_text) if start_text.isdigit() else None
            if alive(int(pid_text), start):
                continue
            path = os.path.join(str(found["root"]), name)
            if not remove([path]):
                removed.append(path)
    return removed
