"""Where things are, computed with `os` alone: the home a command line names, its run
directory and the names its zygote answers on, and which install of settled is running.

Why a module of its own: the CLI's thin client (`cli/thin.py`) needs both before it decides
whether a warm process of the home can answer for it, and must not pay for `home.py`'s
imports (contextlib, errors, records) on a call that a warm process then answers. Must never
import anything but the standard library's `os` and `sys`, nor touch the home.
"""

from __future__ import annotations

import os
import sys

ROOT_HOME = "/var/lib/settled"  # root's home, as a system service keeps its state
LAUNCHER_SOCKET = "launcher.sock"  # in the run directory: the home's zygote (home_launcher.py)
LAUNCHER_LOG = "launcher.log"
VERB_REQUEST_MAGIC = b"settled-face/1\0"  # a CLI verb's request to that zygote (the bytes are
# the wire's, kept); an owner's request is JSON


def run_dir(home: str) -> str:
    """The home's run directory: its journal daemon's and its zygote's sockets, locks and logs."""
    return os.path.join(home, "run")


def resolve_home(explicit: str | None = None) -> str:
    """--home, else SETTLED_HOME, else the default home. Relative paths are made absolute
    from the current directory once, here."""
    return os.path.abspath(explicit or os.environ.get("SETTLED_HOME") or default_home())


def default_home(environ: dict[str, str] | None = None, uid: int | None = None) -> str:
    """One home per user wherever the shell stands, never inside a workspace: root's is
    /var/lib/settled; anyone else's is $XDG_STATE_HOME/settled, else ~/.local/state/settled
    (the XDG base directory rules: an unset or relative XDG_STATE_HOME is ignored)."""
    env = os.environ if environ is None else environ
    if (os.geteuid() if uid is None else uid) == 0:
        return ROOT_HOME
    state = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "settled")


_IDENTITY: list[str] = []  # this process's, once known: the code it loaded does not change


def install_identity() -> str:
    """What a warm process must share with its caller to act for it: the interpreter, this
    settled's version, where it is installed, and the newest change to any of its modules
    (a reinstall in place,
    or an edit of an editable install, changes it: ~0.5 ms for ~150 files). Computed once per
    process, near its start: a process's code is what it loaded, whatever the files say later,
    and a zygote's workers are its code (they skip the walk)."""
    if not _IDENTITY:
        import settled

        package = os.path.dirname(os.path.abspath(settled.__file__))
        # The environment, however invoked (python or python3 of one venv; sys.prefix is not
        # the venv's in a zygote started with -I -S):
        interpreter = f"{os.path.dirname(os.path.abspath(sys.executable))} {sys.hexversion:x}"
        found = f"{settled.__version__} {package} {newest_change(package)} {interpreter}"
        _IDENTITY.append(found)
    return _IDENTITY[0]


def newest_change(package: str) -> int:
    """The newest modification time (ns) of any .py or .so file under `package`."""
    newest, folders = 0, [package]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        folders.append(entry.path)
                elif entry.name.endswith((".py", ".so")):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime_ns)
    return newest


def mountinfo_path(field: str) -> str:
    """A path as /proc/<pid>/mountinfo writes it, unescaped: the kernel writes a space, tab,
    newline and backslash as octal escapes (and nothing else)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
