"""What a scan refuses, and its entries budget: the errors ``scan`` raises, each naming the path.

Owns ``ScanError`` and its kinds: ``TornRead`` (a file that kept changing while it was read),
``WorkspaceUnreadable`` (the kernel refused a read), ``HolesOverBudget`` (a sparse file whose
holes would pass the holes budget, ``sparse.holes_budget``) and ``EntriesOverBudget`` (the entry
that would pass ``entries_budget``, ``SETTLED_MAX_ENTRIES``). Must never: do I/O beyond reading
that one variable, or word a refusal without the path it is about.
"""

from __future__ import annotations

from typing import Final

from settled.errors import SettledError
from settled.workspace.sparse import HOLES_BUDGET_ENV, budget_from_env


class ScanError(SettledError):
    """The workspace could not be scanned as asked."""


class TornRead(ScanError):
    def __init__(self, path: str, attempts: int) -> None:
        super().__init__(
            f"{path!r} changed while it was read, {attempts} times in a row; "
            "no digest recorded. Scan again once nothing writes to it."
        )
        self.path, self.attempts = path, attempts


class WorkspaceUnreadable(ScanError):
    def __init__(self, path: str, error: OSError) -> None:
        super().__init__(f"cannot read {path!r} in the workspace: {error.strerror or error}")
        self.path = path


class HolesOverBudget(ScanError):
    """A file whose holes would pass the scan's budget (``sparse.holes_budget``): hashing them
    costs ~1 s of two cores per 17 GiB, and making them costs nothing."""

    def __init__(self, path: str, size: int, holes: int, left: int, budget: int) -> None:
        super().__init__(
            f"{path!r} is {_amount(size)} with {_amount(size - holes)} on disk: hashing its "
            f"{_amount(holes)} of holes would pass this scan's budget of {_amount(budget)} of "
            f"holes ({_amount(left)} left; {HOLES_BUDGET_ENV} sets it). No digest recorded; "
            "remove or shrink the file, or raise the budget"
        )
        self.path, self.size, self.holes, self.budget = path, size, holes, budget


class EntriesOverBudget(ScanError):
    """A workspace whose entries would pass the scan's budget (``entries_budget``): every entry
    costs a close ~30 us of CPU here (and each distinct file a digest held until the close is
    done), and making one costs a command ~10 us, so a budget stops a tree that would keep a
    close busy for minutes at the entry that would pass it, by name, before anything past it
    is read."""

    def __init__(self, path: str, budget: int) -> None:
        super().__init__(
            f"{path!r} would be entry {budget + 1:,} of this workspace, past the scan's budget of "
            f"{budget:,} entries ({ENTRIES_BUDGET_ENV} sets it). Nothing recorded; remove "
            "entries (or leave them out with --ignore), or raise the budget"
        )
        self.path, self.budget = path, budget


ENTRIES_BUDGET_ENV: Final = "SETTLED_MAX_ENTRIES"
DEFAULT_ENTRIES_BUDGET: Final = 4_000_000  # a close of ~2 min here


def entries_budget() -> int:
    """Entries one scan may record: ``SETTLED_MAX_ENTRIES`` if set, else the default."""
    return budget_from_env(ENTRIES_BUDGET_ENV, DEFAULT_ENTRIES_BUDGET, 1, "entries")


def _amount(count: int) -> str:
    """Bytes in the largest binary unit that leaves at least 1 (1.5 TiB, 4.0 KiB, 12 bytes)."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    return f"{count} bytes"
