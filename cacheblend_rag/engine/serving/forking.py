"""An engine that a process forks with (gunicorn `--preload`, `multiprocessing` with "fork"): the child serves too.

A forked child keeps only the thread that called `fork`. The engine's workers (the scheduler's thread, the deferred
fills' thread, the tiered store's write-back) do not exist there, and a lock one of them held at that moment would
stay held for good; the child's first request would then wait forever. So every engine registers here, and
`os.register_at_fork` runs its three steps around each fork:
- before: take the engine's lock (the step in progress, a prefill or a decode step, finishes first) and let the
  store's write-back finish, so that no worker is inside a torch call or a store write when the process forks;
- in the parent, after: give the lock back; nothing else changes;
- in the child, after: fresh locks, no worker threads (the next request starts them), nothing queued (the requests
  and chunks the parent had in hand are the parent's to answer and store). A CUDA engine cannot go on in a child,
  whose CUDA context cannot be used after a fork: it refuses every call with an error saying to build the engine
  after forking.
Stores reached over the network reconnect by themselves (redis-py opens new connections in a process of another
pid), and the disk tier's index opens its own reader thread per process.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from ...errors import EngineClosedError
from ...store import ChunkStore, TieredStore


class Resettable(Protocol):
    """A worker of the engine that starts afresh in a forked child: new locks, no thread, nothing queued."""

    def after_fork_in_child(self) -> None: ...


class ForkSteps:
    """One engine's steps around a fork: its lock, its workers, its store (while it has background writes), and
    whether it may go on in a child (not on CUDA)."""

    def __init__(
        self,
        lock: threading.RLock,
        workers: tuple[Resettable, ...],
        store: Callable[[], ChunkStore],
        on_cuda: bool,
    ) -> None:
        self._lock = lock
        self._workers = workers
        self._store = store  # the engine's store now (it can be replaced)
        self._on_cuda = on_cuda
        self.refusal: EngineClosedError | None = None  # set in a child that cannot use this engine

    def check(self) -> None:
        """Raise the refusal of an engine that cannot serve in this (forked) process."""
        if self.refusal is not None:
            raise self.refusal

    def _write_back(self) -> TieredStore | None:
        """The store, when it writes its lower tiers on a thread of its own."""
        store = self._store()
        return store if isinstance(store, TieredStore) and store.writes_back else None

    def before_fork(self) -> None:
        self._lock.acquire()  # the step in progress finishes first
        store = self._write_back()
        if store is not None:
            store.flush()

    def after_fork_in_parent(self) -> None:
        self._lock.release()

    def after_fork_in_child(self) -> None:
        self._lock.release()  # held by this thread, the one that forked, which is the child's only thread
        for worker in self._workers:
            worker.after_fork_in_child()
        store = self._write_back()
        if store is not None:
            store.after_fork_in_child()
        if self._on_cuda:
            self.refusal = EngineClosedError(
                "this engine was built before the process forked and runs on CUDA, which a forked child cannot use; "
                "build the engine after forking (gunicorn: without --preload, or in a post_fork hook; "
                "multiprocessing: the 'spawn' start method)"
            )


_engines: weakref.WeakSet[ForkSteps] = weakref.WeakSet()
_guard = threading.Lock()
_hooked = False
_held: list[ForkSteps] = []  # the engines `before_fork` ran for, in the forking thread


def prepare_for_forks(engine: ForkSteps) -> None:
    """Have `engine`'s fork steps run around every fork of this process (while `engine` exists)."""
    global _hooked
    with _guard:
        _engines.add(engine)
        if not _hooked:
            os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)
            _hooked = True


def _before() -> None:
    with _guard:
        engines = list(_engines)
    for engine in engines:
        engine.before_fork()
        _held.append(engine)


def _in_parent() -> None:
    while _held:
        _held.pop().after_fork_in_parent()


def _in_child() -> None:
    global _guard
    _guard = threading.Lock()  # a thread of the parent may have held it
    while _held:
        _held.pop().after_fork_in_child()
