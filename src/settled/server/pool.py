"""Where the HTTP service's Runtime calls run: worker threads, each with its own Runtime.

Owns: a fixed pool of worker threads, one ``Runtime`` per thread (a Runtime holds one SQLite
connection and is used from its thread only), the one warm launcher those Runtimes share for
the whole process, a dedicated thread for each call that may block for long (the close join),
and the background thread that runs ``Runtime.recover()`` every ``RECOVER_EVERY_S`` seconds.

Must never: run a Runtime call on the event loop, share a Runtime between threads, hold a worker
thread for an unbounded wait (waits and follows poll from the event loop instead), or outlive
``close()``: it ends the threads, closes every Runtime it made and then the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from settled.runtime import Runtime, open_launcher

if TYPE_CHECKING:
    from settled.runtime import Launcher


P = ParamSpec("P")
T = TypeVar("T")

WORKER_THREADS = 32
AHEAD_BY = 10  # the service's threads (and session's group) run this much ahead of its owners
AUTOGROUP = "/proc/self/autogroup"
RECOVER_EVERY_S = float(os.environ.get("SETTLED_RECOVER_EVERY_S") or 10.0)  # tests lengthen it
log = logging.getLogger("settled.server")


class RuntimePool:
    """``await pool.call(fn, *args)`` runs ``fn(runtime, *args)`` on a worker thread.

    Each worker makes its Runtime on first use and closes it itself when the pool closes (a
    SQLite connection may only be closed by the thread that opened it).
    """

    def __init__(self, home: str, threads: int = WORKER_THREADS) -> None:
        self.home = home
        base = run_ahead()
        launcher = open_launcher("warm")
        self.launcher = launcher if base is None else LaunchAtBase(launcher, base)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._long: set[threading.Thread] = set()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"settled-rt-{n}", daemon=True)
            for n in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    def _work(self) -> None:
        runtime: Runtime | None = None
        try:
            while (job := self._jobs.get()) is not None:
                if not job.future.set_running_or_notify_cancel():
                    continue  # its waiter went away before it started: nothing was done
                try:
                    if job.with_runtime and runtime is None:
                        runtime = Runtime(self.home, shared_launcher=self.launcher)
                    args = (runtime, *job.args) if job.with_runtime else job.args
                    result = job.fn(*args, **job.kwargs)
                except BaseException as exc:
                    job.future.set_exception(exc)
                else:
                    job.future.set_result(result)
        finally:
            if runtime is not None:
                runtime.close()

    def _submit(self, job: _Job) -> asyncio.Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the service is shutting down")
            self._jobs.put(job)
        return asyncio.wrap_future(job.future)

    async def call(
        self, fn: Callable[Concatenate[Runtime, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run a short Runtime call (bounded by the store's busy timeout) on a worker."""
        result: T = await self._submit(_Job(fn, args, kwargs, True))
        return result

    async def io(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a short file operation (a pread, an fstat) on a worker; no Runtime involved."""
        result: T = await self._submit(_Job(fn, args, kwargs, False))
        return result

    async def call_long(
        self, fn: Callable[Concatenate[Runtime, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run a call that may block for minutes (a close waiting on its sessions) on a thread
        of its own with a Runtime of its own, so the workers stay free. If the client goes
        away the call still finishes: a close is resumable and a repeated close answers the
        same."""
        done: Future[T] = Future()

        def body() -> None:
            waited = done.set_running_or_notify_cancel()  # a waiter cancelled later cannot stop it
            try:
                with Runtime(self.home, shared_launcher=self.launcher) as runtime:
                    result = fn(runtime, *args, **kwargs)
            except BaseException as exc:
                if waited:
                    done.set_exception(exc)
            else:
                if waited:
                    done.set_result(result)
            finally:
                with self._lock:
                    self._long.discard(threading.current_thread())

        thread = threading.Thread(target=body, name="settled-long", daemon=True)
        with self._lock:
            if self._closed:
                raise RuntimeError("the service is shutting down")
            self._long.add(thread)
        thread.start()
        return await asyncio.wrap_future(done)

    def close(self, long_wait_s: float = 5.0) -> None:
        """End the workers (each closes its own Runtime), then the shared launcher."""
        with self._lock:
            self._closed = True
            long_calls = list(self._long)
            for _ in self._workers:
                self._jobs.put(None)
        for worker in self._workers:
            worker.join(timeout=30.0)
        for thread in long_calls:
            thread.join(timeout=long_wait_s)
        self.launcher.close()


def run_ahead() -> int | None:
    """Put every thread of this process (and so every thread it starts later) ``AHEAD_BY``
    ahead of the priority it started with, and so its session's scheduling group where the
    kernel groups by session (autogroup: each owner is a session of its own, and a thread's
    priority counts only within its group); the base priority, or None where the system does
    not permit it (no CAP_SYS_NICE): then nothing changed.

    Why: the owners this server launches (and their commands) may keep every core busy; the
    event loop then waits for a core behind them (seconds per minute on 2 cores with 200
    clients), and a thread of the service descheduled while it holds the GIL holds it up
    too. Linux keeps a priority per thread, so each is set by its id."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        for tid in sorted(map(int, os.listdir("/proc/self/task"))):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.setpriority(os.PRIO_PROCESS, tid, base - AHEAD_BY)
    except (PermissionError, FileNotFoundError):
        for tid in map(int, os.listdir("/proc/self/task")):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, base)
        return None
    _group_ahead()
    return base


def _group_ahead() -> None:
    """The session's scheduling group ``AHEAD_BY`` ahead too, where the kernel has one."""
    try:
        with open(AUTOGROUP) as handle:
            group_nice = int(handle.read().split()[-1])
        with open(AUTOGROUP, "w") as handle:
            handle.write(str(max(-20, group_nice - AHEAD_BY)))
    except (OSError, ValueError, IndexError):  # no autogroup here, or not permitted
        return


class LaunchAtBase:
    """The shared launcher, called at the priority the service started with: the zygote it
    forks (and so every owner and command) runs at that priority, never ahead with the
    service's threads. A launch changes its own thread's priority only (Linux: per thread)."""

    def __init__(self, launcher: Launcher, base: int) -> None:
        self.launcher, self.base = launcher, base

    def launch(self, home: str, session: str, store: Any) -> dict[str, Any]:  # the caller's

        ahead = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, self.base)
        try:
            return self.launcher.launch(home, session, store)
        finally:
            os.setpriority(os.PRIO_PROCESS, 0, ahead)

    def close(self) -> None:
        self.launcher.close()


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    with_runtime: bool
    future: Future[Any] = field(default_factory=Future)


class Recoverer:
    """Runs ``Runtime.recover()`` now and then every ``interval`` seconds on its own thread,
    so a session whose owner died is inspected (and settled on evidence) without a request."""

    def __init__(self, home: str, launcher: Launcher, interval: float = RECOVER_EVERY_S):
        self.home, self.launcher, self.interval = home, launcher, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="settled-recover", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        with Runtime(self.home, shared_launcher=self.launcher) as runtime:
            while not self._stop.wait(self.interval):
                recover_once(runtime)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)


def recover_once(runtime: Runtime) -> list[dict[str, Any]]:
    """One recovery pass; a failure is logged, never fatal to the service."""
    try:
        results = runtime.recover()
    except Exception:
        log.exception("recovery pass failed; the next one runs in %.0f s", RECOVER_EVERY_S)
        return []
    for result in results:
        log.info("recovery: %s -> %s", result.get("session"), result.get("state"))
    return results
