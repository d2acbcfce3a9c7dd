"""settled.workspace: the workspace clock — journal, scanner, manifests, restore.

Owns the proof that a workspace's files are in a verified checkpoint, over the content-addressed
object store (``settled.objects``, a layer of its own below this one): the publishing of many
objects at once (``publish``), a scanner (``scan``) with a stat cache kept per directory
(``index``), tree objects and manifests (``manifest``), restore into an empty directory
(``restore``), and the mutation journal and checkpoint service (``journal``, ``checkpoint``).

Must never: follow a symlink inside a workspace, read or write outside the workspace or the
store, or treat a watcher event as proof of the tree's contents (only a scan is).
"""
