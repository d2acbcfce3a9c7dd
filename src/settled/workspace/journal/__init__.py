"""The mutation journal of a home's task workspaces: inotify feeding monotonic mutation sequences.

A task's journal watches every directory under its workspace root, advances a sequence for every
reported change, and remembers the directories changed since the consumer's last checkpoint. One
daemon per home (detached, reached over one Unix socket, one inotify instance) keeps the journals
of every open task and serves barriers to every session owner; each request names its task. It
is a hint, never the proof: the final scan after death evidence is what a checkpoint covers. It
must never be silently wrong: a queue overflow, a watch or an instance the kernel refused, a
restart gap or a journal that is not running is reported (`trustworthy` False with the reasons,
or no answer at all) so that the consumer falls back to a full scan.

Cost (bench/journal_memory.py): the daemon is ~14.7 MiB resident with no task; each task adds
its journal (~1 KiB) and each watched directory ~0.4 KiB in the daemon, plus the kernel's watch.
The instance and its event queue (fs.inotify.max_queued_events) are shared: a task that floods
it overflows every task's journal, which then says so.

Must never: follow a symlink, read file contents, or decide what a checkpoint covers.

One duty per module, and this file imports nothing, so a caller loads only the half it uses:
- `client`: the wire protocol a caller speaks (`watch`, `barrier`, `terminal_mutation`, `reset`,
  `ping`, `release`, `send_stop`) and the `Watermark` a reply parses into. Standard library only:
  a session owner started with `-I -S` asks for a barrier without settled's other modules or
  inotify_simple.
- `inotify`: the shared `Watcher` (one instance, events routed by watch descriptor) and the
  in-process `Journal` of one task (watches, sequence, dirty directories).
- `daemon`: the socket server around every task's `Journal`, their state files, its entry point.
- `lifecycle`: `ensure_watching` (a task added; the daemon started once, under a start lock),
  `release` and `stop`.
- `errors`: `JournalUnavailable`, shared by the three above.

Why a barrier is sound. fsnotify is synchronous with the syscall: `write`, `truncate`, `rename`,
`unlink`, `mkdir`, `chmod`... call the fsnotify hook before they return, and the hook appends the
event to this instance's queue under its lock (or, when the queue is full, appends one
IN_Q_OVERFLOW). IN_CLOSE_WRITE comes from `__fput`, which runs as task work before close(2)
returns to user space, and in `do_exit` before the exiting process is reported to its parent. So
once a writer's syscall has returned (or its parent has reaped it), its event is in the kernel
queue. `barrier()` reads the queue (FIONREAD, then read) only after the request arrived, so it
consumes every event of every change that completed before the request: a change completed
before barrier B1 returned is in seq <= B1.seq, and any change completed after it advances a
later barrier past B1.seq (the drained queue has no tail event it could coalesce into).

What is NOT caught (and why the final scan exists): writes through a shared mmap (no event;
IN_CLOSE_WRITE only when the fd opened for writing is closed, nothing for later stores); writes
through a hard link whose name lies outside the workspace; changes on network filesystems made by
other hosts; changes while the journal is down (reported as a restart gap); repeated identical
events coalesce (seq counts events, not writes).
"""
