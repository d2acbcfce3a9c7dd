"""Wiping a secret out of this process's original environment block.

`os.environ.pop` only unsets the C library's pointer: the bytes the kernel copied onto the stack
at exec stay there, and `/proc/<pid>/environ` reads exactly those bytes, so the server's token
would stay readable by anything allowed to read that file. This overwrites the value in place
through `/proc/self/mem` (a process may always write its own memory), leaving the name and a row
of `*` of the same length, so the block keeps its layout.

Defence in depth: a session's command cannot name the server's process in the first place (its
own PID namespace) or read another root process's environ without CAP_SYS_PTRACE (dropped from
its bounding set); this covers a command started with `--isolation none`.
"""

from __future__ import annotations

import os

_ENV_START_FIELD = 47  # env_start, field 50 of /proc/self/stat, counted after the comm field


def _environ_block() -> tuple[int, int]:
    with open("/proc/self/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return int(fields[_ENV_START_FIELD]), int(fields[_ENV_START_FIELD + 1])


def scrub_environ(name: str) -> bool:
    """Overwrite the value of `name` in the original environment block; True if it was there."""
    start, end = _environ_block()
    prefix = os.fsencode(name) + b"="
    found = False
    with open("/proc/self/mem", "r+b", buffering=0) as memory:
        memory.seek(start)
        block = memory.read(end - start)
        offset = 0
        for entry in block.split(b"\0"):
            if entry.startswith(prefix):
                memory.seek(start + offset + len(prefix))
                memory.write(b"*" * (len(entry) - len(prefix)))
                found = True
            offset += len(entry) + 1
    return found
