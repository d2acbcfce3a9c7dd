"""The one error the journal raises on purpose.

Its own module so the Journal, the daemon and the start-up logic share it without importing each
other. The client never raises it (it imports only the standard library): a journal that does not
answer is a None there, and the caller falls back to a full scan.
"""

from __future__ import annotations

from settled.errors import SettledError


class JournalUnavailable(SettledError):
    """The journal cannot be started or reached; the consumer must fall back to a full scan."""
