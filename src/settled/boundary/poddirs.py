"""A task's pod directories: its private `/tmp`, `/var/tmp`, `/dev/shm` and `$HOME`.

Owns `<home>/pods/<task>/{tmp,var-tmp,shm,home}`: creating what is missing before a session of
the task is planned (`ensure`, called by the launcher), saying what they hold (`describe`, for
the close receipt) and removing them with the task (`remove`). The command's view
(`mountview`) binds them read-write at `/tmp`, `/var/tmp`, `/dev/shm` and the command's `$HOME`,
so they persist across the task's sessions (a `pip install --user` or a cache survives from one
tool call to the next) and no other task sees them.

`tmp`, `var-tmp` and `shm` are 1777 as the host's are (any uid a command runs as may create
files, only their owner may remove them); `home` is 0700, owned by the uid and gid the command
runs as. `<home>/pods` and each task's directory are 0700 like every other directory of the
home: the command reaches its pod directories only through the binds its init made as root.

Their contents are the command's and so are hostile: nothing here follows a symlink found
inside them (the walk of `describe` lstat's, `remove` is `shutil.rmtree`, which never follows
one), and nothing here is on the owner's launch path. Never mounts anything (mountview does)
and never decides which of them a session gets (isolation.py does).
"""

from __future__ import annotations

import os
import shutil
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

PODS_DIR: Final = "pods"
POD_DIRS: Final = (("tmp", 0o1777), ("var-tmp", 0o1777), ("shm", 0o1777), ("home", 0o700))
NAMES_SHOWN: Final = 5  # describe: the first few names of what a directory holds


def pod_path(home: str, task: str) -> str:
    """`<home>/pods/<task>`; refuses a task id that is not one path component."""
    if not task or task in (".", "..") or "/" in task or "\0" in task:
        raise ValueError(f"task id {task!r} cannot name a pod directory")
    return os.path.join(home, PODS_DIR, task)


def ensure(home: str, task: str, uid: int, gid: int) -> dict[str, str]:
    """Create what is missing of the task's pod directories; their paths by name (tmp,
    var-tmp, shm, home). An existing `home` owned by another uid or gid than the command's is
    handed to it (the directory itself only: what it holds stays whose it is). Raises OSError
    when one exists as something other than a directory (never the case but by hand)."""
    root = pod_path(home, task)
    paths = {name: os.path.join(root, name) for name, _mode in POD_DIRS}
    found = {name: _lstat(path) for name, path in paths.items()}
    if all(info is not None and stat.S_ISDIR(info.st_mode) for info in found.values()):
        info = found["home"]  # the common case: a later session of the task, four looks
        if info is not None and (info.st_uid, info.st_gid) != (uid, gid):
            os.chown(paths["home"], uid, gid)
        return paths
    for directory in (os.path.join(home, PODS_DIR), root):
        _make(directory, 0o700)
    for name, mode in POD_DIRS:
        made = _make(paths[name], mode)
        if name == "home" and (made or _owner(paths[name]) != (uid, gid)):
            os.chown(paths[name], uid, gid)
    return paths


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _make(path: str, mode: int) -> bool:
    """mkdir with exactly `mode` (the umask and mkdir's own cut of the sticky bit undone);
    False when it was there already as a directory."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(20, f"{path} is not a directory") from None
        return False
    os.chmod(path, mode)
    return True


def _owner(path: str) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_uid, info.st_gid


def describe(home: str, task: str) -> dict[str, dict[str, Any]]:
    """What each pod directory holds: `entries` (every file, directory and link below it),
    `bytes` (the sizes of its regular files) and `names` (its first few names, sorted). A
    directory not made yet holds nothing. Never follows a symlink."""
    root = pod_path(home, task)
    found: dict[str, dict[str, Any]] = {}
    for name, _mode in POD_DIRS:
        entries, size = 0, 0
        path = os.path.join(root, name)
        try:
            names = sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            names = []
        pending = [path] if names else []
        while pending:
            directory = pending.pop()
            try:
                listing = list(os.scandir(directory))
            except OSError:  # gone meanwhile, or not a directory any more
                continue
            for entry in listing:
                entries += 1
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    pending.append(entry.path)
                elif stat.S_ISREG(info.st_mode):
                    size += info.st_size
        found[name] = {"entries": entries, "bytes": size, "names": names[:NAMES_SHOWN]}
    return found


def remove(home: str, task: str) -> None:
    """Remove the task's pod directories and everything in them (nothing if none was made)."""
    root = pod_path(home, task)
    if os.path.lexists(root):
        shutil.rmtree(root)
