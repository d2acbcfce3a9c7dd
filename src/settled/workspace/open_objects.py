"""The one place that chooses a home's object store implementation, from its binding.

Kept apart from the checkpoint code so that an owner (which seals logs) and recovery can open
the object store without importing the workspace service: this module, the protocol and its
implementations form their own layer (tests/test_layers.py, "objects").
"""

from __future__ import annotations

from settled.backends import bound_backends
from settled.workspace.objectstore import ObjectStore


def open_object_store(home: str) -> ObjectStore:
    """The object store the home is bound to (by default the directory ``<home>/objects``)."""
    url = bound_backends(home).objects
    if url.startswith("s3://"):
        from settled.workspace.s3objects import open_s3  # boto3 loads at its first request

        return open_s3(url)
    from settled.workspace.objects import LocalObjectStore  # behind the seam

    return LocalObjectStore(url.removeprefix("file://"))
