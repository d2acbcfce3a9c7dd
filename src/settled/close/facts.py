"""Reading a task's close facts from the store: what the close join decides from, and what
``explain`` and ``status`` show without running (or importing) the join.

Must never: write, decide, or touch the workspace.
"""

from __future__ import annotations

from settled.close.decide import CloseFacts
from settled.store import Store


def read_close_facts(store: Store, task: str) -> CloseFacts:
    """The task, its sessions, its recorded close steps and its logs' recorded seals, as the
    store has them now."""
    return CloseFacts(
        task=store.get_task(task),
        sessions=store.list_sessions(task),
        steps=store.close_steps(task),
        seals=store.log_seals(task),
    )
