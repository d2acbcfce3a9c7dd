"""settled.workspace: the workspace clock — journal, scanner, object store, manifests, restore.

Owns the proof that a workspace's files are in a verified checkpoint: a content-addressed object
store (its contract ``objectstore``, its local backend ``objects``) and the publishing of many
objects at once (``publish``), a scanner (``scan``) with a stat cache kept per directory
(``index``), tree objects and manifests (``manifest``), restore into an empty directory
(``restore``), the digest vocabulary (``hashing``), and the mutation journal and checkpoint
service (``journal``, ``checkpoint``).

Must never: follow a symlink inside a workspace, read or write outside the workspace or the
store, or treat a watcher event as proof of the tree's contents (only a scan is).
"""
