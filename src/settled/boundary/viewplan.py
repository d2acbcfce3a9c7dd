"""The command's view of the filesystem, chosen: an allow-list, in the order it is built.

Owns the choice of what exists for a session's command, as a list of entries
`{path, kind, mode, source?}` (the receipt's `isolation.view`), sorted outermost first so a
path bound inside another lands on top of it:

- `system` (read-only): the distribution's roots (`/usr`, `/bin`, `/sbin`, `/lib*`, `/etc`), each
  only if the host has it, a root that is a symlink on the host (merged /usr) as the same
  symlink (`mode: symlink`, `source` its target); `/run` as an empty directory; the target of a
  symlinked `/etc/resolv.conf` when it lies outside the view (systemd-resolved's `/run/...`);
- `workspace` (read-write), the grants `writable` (read-write) and `readable` (read-only), each
  at its own path; a grant inside the home or another task's workspace, or at or under `/proc`,
  `/dev` or `/sys` (whose contents the view makes itself), is dropped; one inside a grant of the
  same mode adds nothing and is dropped too;
- `pod` (read-write): the task's own `/tmp`, `/var/tmp`, `/dev/shm` and `$HOME` (poddirs.py);
  `$HOME` is not bound when it is `/`, the workspace or inside it, a path a grant or a system
  root already gives, or a path inside one that the host lacks (no mount point can be made);
- `proc` (a new procfs of the PID namespace, its knobs read-only), `dev` (a minimal tmpfs),
  `sys` (the host's, read-only, the cgroup hierarchies with it);
- `protected` (read-only): settled's own code and interpreter where the workspace or a writable
  grant holds them;
- `cover` (read-only): what settled knows must stay hidden and yet lies inside one of those
  roots: the home, other tasks' workspaces (empty directories), the hidden files (`/dev/null`),
  and the /proc files that leak kernel memory or keys. Normally the home and every workspace lie
  outside every root and there is nothing to cover: they do not exist for the command.

Also the pins: each directory between a cover and the read-write root that holds it, bound onto
itself so the command cannot rename it (and so move the cover away from what it hides).

Nothing of the host that is not listed exists for the command. Never mounts anything
(mountview.py builds the list) and decides nothing about privileges (isolation.py does).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # imported with isolation.py, on the owner's launch path
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from typing import Final

    Entry = dict[str, str]

SYSTEM_ROOTS: Final = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
RESOLV_CONF: Final = "/etc/resolv.conf"
POD_TARGETS: Final = (("tmp", "/tmp"), ("var-tmp", "/var/tmp"), ("shm", "/dev/shm"))
MADE_BY_THE_VIEW: Final = ("/proc", "/dev", "/sys")
PROC_READ_ONLY: Final = ("sys", "sysrq-trigger", "irq", "bus", "fs")
PROC_MASKED: Final = ("kcore", "keys", "timer_list", "sched_debug", "acpi")
IDENTITY_KINDS: Final = frozenset(("system", "workspace", "writable", "readable"))
READ_WRITE_KINDS: Final = frozenset(("workspace", "writable", "pod"))
_RANK: Final = {"protected": 1, "cover": 2}  # at one path: a bind, then protected, then cover


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def inside_any(path: str, roots: set[str]) -> bool:
    """`is_within(path, root)` for some root of `roots` (normalized: no trailing "/"), by
    looking up `path` and each directory above it: one look per ancestor, where a scan of
    every root per path made a plan quadratic in its home's tasks (500 workspaces: 17 ms)."""
    return _innermost(path, roots) is not None


def _innermost(path: str, roots: Mapping[str, object] | set[str]) -> str | None:
    """The deepest of `roots` that holds `path`, or None."""
    current = path.rstrip("/") or "/"
    while current not in roots:
        if current == "/":
            return None
        cut = current.rfind("/")  # os.path.dirname, without its cost on thousands of paths
        current = current[:cut] or "/"
    return current


def ancestors(path: str) -> list[str]:
    """Every directory above `path`, outermost first, "/" excluded."""
    found: list[str] = []
    parent = os.path.dirname(path)
    while parent not in ("/", ""):
        found.append(parent)
        parent = os.path.dirname(parent)
    return found[::-1]


def depth(path: str) -> int:
    return 0 if path == "/" else path.count("/")


def entry(path: str, kind: str, mode: str, source: str | None = None) -> Entry:
    made = {"path": path, "kind": kind, "mode": mode}
    if source is not None:
        made["source"] = source
    return made


def _normal(path: str) -> str:
    return os.path.normpath(path) if path.startswith("/") else path


def choose_grants(
    workspace: str, writable: Iterable[str], readable: Iterable[str], forbidden: set[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The grants that add something, each at its real path (a grant through a symlink shows
    what it names, where it is, so what lies inside it is found): existing directories, none
    inside a `forbidden` one (the home, other tasks' workspaces) or at or under /proc, /dev,
    /sys, none equal to the workspace; a path granted both ways is writable, and a grant inside
    a grant (or the workspace, for `writable`) of the same mode is dropped."""
    made = set(MADE_BY_THE_VIEW)
    chosen: dict[str, str] = {workspace: "rw"}
    for mode, paths in (("rw", writable), ("ro", readable)):
        real = {os.path.realpath(p) for p in paths if p.startswith("/")}
        for path in sorted(real, key=depth):
            if path in chosen:
                continue
            if inside_any(path, forbidden) or inside_any(path, made) or not os.path.isdir(path):
                continue
            chosen[path] = mode
    kept: dict[str, str] = {}
    for path in sorted(chosen, key=depth):
        holder = _innermost(path, kept) if path != "/" else None
        if path != workspace and holder is not None and kept[holder] == chosen[path]:
            continue
        kept[path] = chosen[path]
    del kept[workspace]
    return (
        tuple(p for p, m in kept.items() if m == "rw"),
        tuple(p for p, m in kept.items() if m == "ro"),
    )


def system_entries(granted: set[str]) -> list[Entry]:
    """The distribution's roots the host has and no grant gives, and an empty /run."""
    found: list[Entry] = []
    for root in SYSTEM_ROOTS:
        if inside_any(root, granted):
            continue
        try:
            target = os.readlink(root)
        except FileNotFoundError:
            continue
        except OSError:  # not a symlink: a directory (anything else is not bound)
            if os.path.isdir(root):
                found.append(entry(root, "system", "ro", root))
        else:
            found.append(entry(root, "system", "symlink", target))
    if not inside_any("/run", granted):
        found.append(entry("/run", "system", "ro"))
    return found


def resolv_entry(regions: Mapping[str, Entry]) -> Entry | None:
    """The file a symlinked /etc/resolv.conf names, bound read-only at its own path when the
    view would not hold it otherwise (systemd-resolved keeps it under /run): DNS works."""
    if "/etc" not in regions or not os.path.islink(RESOLV_CONF):
        return None
    target = os.path.realpath(RESOLV_CONF)
    if _innermost(target, regions) is not None or not os.path.isfile(target):
        return None
    if inside_any(target, set(MADE_BY_THE_VIEW)):
        return None
    return entry(target, "system", "ro", target)


def home_entry(
    command_home: str | None, workspace: str, pod_home: str, taken: Mapping[str, Entry]
) -> Entry | None:
    """The pod's home at the command's $HOME, or None where it is not bound (see above)."""
    if not command_home or not command_home.startswith("/"):
        return None
    path = _normal(command_home)
    if path == "/" or is_within(path, workspace) or path in taken:
        return None
    if inside_any(path, set(MADE_BY_THE_VIEW)):
        return None
    holder = _innermost(path, taken)
    inside = taken[holder] if holder is not None else {"kind": "root"}
    in_host = inside["kind"] in IDENTITY_KINDS
    if in_host and (inside["mode"] == "symlink" or not os.path.isdir(path)):
        return None  # a mount point inside a host directory: only where it exists
    return entry(path, "pod", "rw", pod_home)


def proc_entries() -> list[Entry]:
    """A new procfs; its knobs read-only and what leaks kernel memory or keys covered: only
    those this kernel has (the host's /proc is the same kernel's)."""
    found = [entry("/proc", "proc", "rw")]
    for name in PROC_READ_ONLY:
        if os.path.exists(f"/proc/{name}"):
            found.append(entry(f"/proc/{name}", "proc", "ro"))
    for name in PROC_MASKED:
        path = f"/proc/{name}"
        if os.path.isdir(path):
            found.append(entry(path, "cover", "ro"))
        elif os.path.exists(path):
            found.append(entry(path, "cover", "ro", os.devnull))
    return found


def choose_covers(
    workspace: str,
    home: str,
    others: Iterable[str],
    files: Iterable[str],
    regions: Mapping[str, Entry],
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What settled hides that lies inside a root of the view (`regions`, by path): the home
    and other workspaces (outermost only; never the workspace or an ancestor of it but the
    home, so overlapping workspaces see each other), then the files not already inside a
    covered directory. Whatever lies outside every root is not looked at: it does not exist
    for the command, and a home of thousands of tasks costs no stat per workspace."""
    dirs: list[str] = []
    covered: set[str] = set()
    for path in sorted({home, *others}, key=len):
        if path == workspace or (is_within(workspace, path) and path != home):
            continue
        if _innermost(path, regions) is None or inside_any(path, covered):
            continue
        if path != home and not os.path.isdir(path):
            continue  # a task whose workspace is gone has nothing left to hide
        dirs.append(path)
        covered.add(path.rstrip("/") or "/")
    kept_files = sorted(
        f
        for f in set(files)
        if _innermost(f, regions) is not None and not inside_any(f, covered) and os.path.isfile(f)
    )
    return tuple(dirs), tuple(kept_files)


def pins_of(covers: Iterable[str], regions: Mapping[str, Entry]) -> tuple[str, ...]:
    """Each directory between a cover and the read-write root holding it: bound onto itself, a
    mount point, which cannot be renamed (a read-only root refuses the rename anyway)."""
    pins: set[str] = set()
    for path in covers:
        holder = _innermost(path, regions)
        if holder is None or regions[holder]["mode"] != "rw":
            continue
        pins.update(a for a in ancestors(path) if len(a) > len(holder) and is_within(a, holder))
    return tuple(sorted(pins, key=lambda p: (depth(p), p)))


def build_order(entries: Iterable[Entry]) -> tuple[Entry, ...]:
    """Outermost first; at one path a bind, then what protects or covers it."""
    return tuple(
        sorted(entries, key=lambda e: (depth(e["path"]), _RANK.get(e["kind"], 0), e["path"]))
    )


def choose_protected(writable: Iterable[str], runtime: Iterable[str]) -> tuple[str, ...]:
    """The outermost of settled's runtime paths that a read-write root would otherwise expose:
    the next owner would run whatever a command wrote there."""
    writable = tuple(writable)
    kept: list[str] = []
    for path in sorted(set(runtime), key=len):
        if any(is_within(path, outer) for outer in kept):
            continue
        if any(is_within(path, w) for w in writable) and os.path.isdir(path):
            kept.append(path)
    return tuple(kept)


class ViewChoice:
    """What `plan_view` chose: the view in build order and what the receipt names apart."""

    __slots__ = ("hide_dirs", "hide_files", "pins", "protect", "readable", "view", "writable")

    def __init__(
        self,
        view: tuple[Entry, ...],
        pins: tuple[str, ...],
        writable: tuple[str, ...],
        readable: tuple[str, ...],
        protect: tuple[str, ...],
        hide_dirs: tuple[str, ...],
        hide_files: tuple[str, ...],
    ) -> None:
        self.view, self.pins, self.writable, self.readable = view, pins, writable, readable
        self.protect, self.hide_dirs, self.hide_files = protect, hide_dirs, hide_files


def plan_view(
    *,
    workspace: str,
    home: str,
    others: Iterable[str],
    hidden_files: Iterable[str],
    writable: Iterable[str],
    readable: Iterable[str],
    pod_dirs: Mapping[str, str] | None,
    command_home: str | None,
    runtime: Iterable[str],
    workspace_identity: tuple[int, int] | None = None,
) -> ViewChoice:
    """The command's view (see the module's docstring), from facts of the host checked here.
    `workspace_identity`: the workspace's (dev, ino) recorded at `task new`, carried in its
    entry as "identity" ("dev:ino") for mountview to check the directory it binds."""
    others = [o.rstrip("/") or "/" for o in others]
    forbidden = {home.rstrip("/") or "/", *others}
    granted_rw, granted_ro = choose_grants(workspace, writable, readable, forbidden)
    taken: dict[str, Entry] = {}
    bound = entry(workspace, "workspace", "rw", workspace)
    if workspace_identity is not None:
        bound["identity"] = f"{workspace_identity[0]}:{workspace_identity[1]}"
    for made in (
        bound,
        *(entry(p, "writable", "rw", p) for p in granted_rw),
        *(entry(p, "readable", "ro", p) for p in granted_ro),
    ):
        taken.setdefault(made["path"], made)
    if pod_dirs is not None:
        for name, target in POD_TARGETS[:2]:
            taken.setdefault(target, entry(target, "pod", "rw", pod_dirs[name]))
    for made in system_entries({*granted_rw, *granted_ro}):
        taken.setdefault(made["path"], made)
    regions = {
        path: made
        for path, made in taken.items()
        if made["kind"] in IDENTITY_KINDS and made["mode"] != "symlink" and "source" in made
    }
    resolv = resolv_entry(regions)
    if resolv is not None:
        taken[resolv["path"]] = regions[resolv["path"]] = resolv
    if pod_dirs is not None:
        home_bind = home_entry(command_home, workspace, pod_dirs["home"], taken)
        if home_bind is not None:
            taken[home_bind["path"]] = home_bind
    shm = (
        entry("/dev/shm", "pod", "rw", pod_dirs["shm"])
        if pod_dirs is not None
        else entry("/dev/shm", "dev", "rw")
    )
    view = [*taken.values(), *proc_entries(), entry("/dev", "dev", "rw"), shm]
    view.append(entry("/sys", "sys", "ro", "/sys"))
    dirs, files = choose_covers(workspace, home, others, hidden_files, regions)
    view += [entry(d, "cover", "ro") for d in dirs]
    view += [entry(f, "cover", "ro", os.devnull) for f in files]
    protect = choose_protected((workspace, *granted_rw), runtime)
    view += [entry(p, "protected", "ro", p) for p in protect]
    return ViewChoice(
        build_order(view),
        pins_of((*dirs, *files), regions),
        granted_rw,
        granted_ro,
        protect,
        dirs,
        files,
    )
