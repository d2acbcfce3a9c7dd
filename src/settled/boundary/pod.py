"""A task's pod as its close sees it: what it held once every session had settled, then its end.

A task is a pod: its sessions share its own `/tmp`, `/var/tmp`, `/dev/shm` and `$HOME`
(poddirs.py) and its own IPC, UTS, network and user namespaces and keyring (podhost.py). None
of that is the workspace, so none of it is in the checkpoint: the close receipt says so, names
what each held (files and bytes of each directory, its first few names; message queues, shared
memory, semaphores and keys of the namespaces), and the pod is then released (its namespaces
unmounted from the pods namespace, its directories removed). Nothing of a closed task can run
any more (admission is sealed and every session has its death evidence), so nothing it held
could be used again: it is discarded, and said so, rather than kept unaccounted for.

What a command left is hostile: the walk of the directories is bounded (`WALK_BUDGET` entries;
past it the counts are lower bounds, marked `complete: false`, so a hundred million empty files
in `/tmp` cannot hold the close), and every name is shown as text a receipt can carry (bytes that
are not UTF-8 escaped), never as markup or a path to follow.

Never decides when a pod ends (the close join and `task destroy` do) and never runs on the
owner's launch path.
"""

from __future__ import annotations

import contextlib
import os
import stat

from settled.boundary import poddirs, podhost

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

WALK_BUDGET: Final = 100_000  # entries of the pod's directories a close counts, at most
FATE: Final = (
    "discarded: the task's /tmp, /var/tmp, /dev/shm and HOME and its IPC, UTS, network and "
    "user namespaces are outside its workspace and its checkpoint; they were removed when the "
    "task closed"
)
SHOWN_AS: Final = {"tmp": "/tmp", "var-tmp": "/var/tmp", "shm": "/dev/shm", "home": "HOME"}


class LocalPods:
    """The pods of one home's tasks on this host (the close's `Pod`)."""

    def __init__(self, home: str) -> None:
        self.home = home

    def held(self, task: str) -> dict[str, Any] | None:
        """What the task's pod holds now, or None when it never had one (its commands ran
        without isolation, or inside a sandbox of another provider)."""
        directories = _directories(self.home, task)
        try:
            namespaces = podhost.describe(self.home, task)
        except OSError as exc:  # a pod that cannot be looked into is said so, not hidden
            namespaces = {"error": f"{type(exc).__name__}: {exc}"}
        if directories is None and namespaces is None:
            return None
        return {
            "covered_by_checkpoint": False,
            "fate": FATE,
            "directories": directories,
            "namespaces": _text(namespaces),
        }

    def release(self, task: str) -> None:
        """End the task's pod: its namespaces unmounted from the pods namespace, its
        directories removed. Idempotent, and free once done (no helper process is started
        for a pod that is released and whose directories are gone)."""
        if podhost.find(self.home, task) is not None:
            podhost.release(self.home, task)
            podhost.release_home_if_idle(self.home)  # no mount outlives the home's last pod
        poddirs.remove(self.home, task)

    def release_namespaces(self, task: str) -> None:
        """End the pod's namespaces only (`task destroy`: its processes are dead, but the task
        and its files stay until it is closed)."""
        podhost.release(self.home, task)
        podhost.release_home_if_idle(self.home)


def _directories(home: str, task: str) -> dict[str, Any] | None:
    root = poddirs.pod_path(home, task)
    if not os.path.isdir(root):
        return None
    budget = [WALK_BUDGET]
    return {
        SHOWN_AS[name]: _walk(os.path.join(root, name), budget) for name, _mode in poddirs.POD_DIRS
    }


def _walk(path: str, budget: list[int]) -> dict[str, Any]:
    """Entries (files, directories, links: everything below `path`), the bytes of its regular
    files and its first names, counting at most `budget[0]` entries (shared by the pod's
    directories); never follows a symlink."""
    entries = size = 0
    complete = True
    try:
        names = sorted(os.listdir(os.fsencode(path)))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    pending = [os.fsencode(path)] if names else []
    while pending:
        directory = pending.pop()
        with contextlib.suppress(OSError), os.scandir(directory) as listing:
            for entry in listing:
                if budget[0] <= 0:
                    complete, pending = False, []
                    break
                budget[0] -= 1
                entries += 1
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode):
                        pending.append(entry.path)
                    elif stat.S_ISREG(info.st_mode):
                        size += info.st_size
    shown = [_name(n) for n in names[: poddirs.NAMES_SHOWN]]
    return {"entries": entries, "bytes": size, "names": shown, "complete": complete}


def _name(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _text(value: Any) -> Any:
    """`value` with every string made text a receipt can carry (undecodable bytes escaped)."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {_text(k): _text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_text(v) for v in value]
    return value
