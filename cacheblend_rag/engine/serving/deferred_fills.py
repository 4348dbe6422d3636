"""Storing the chunks a cold request was answered without, after the call returns (the miss policy's fill).

A cold request is answered with a full prefill. The missing chunks whose entries that prefill computed are
stored from it (`ChunkCache.capture`); the others are prefilled (after their context, when they have one) and
stored after the answer, so that the next request that retrieves them is fast. That work belongs to no one's
answer, and it runs one chunk at a time in one of two places:
- while the scheduler serves requests, on the scheduler's own thread, between its turns (it is the *host*:
  `host`, `run_next`), so a chunk being prefilled can let the requests decoding take steps between its layers
  (`ServingConfig.max_token_gap_s`) like any prefill, instead of holding the engine's lock for the whole chunk;
- otherwise on a background thread of its own, one chunk per turn of the engine's lock.
A request that needs a chunk still queued waits for it (`wait_for`) rather than computing it twice; on the host's
thread, waiting means storing the queued chunks there. `wait()` waits for everything (before a process exits);
at exit without it, what is still queued is dropped (`stop`, called by `shutdown`). What the fills did is counted in
`stats` (`engine.fill_stats`), never written into a request's metrics after its call returned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...fusion import LayerEvents
from ...store import ChunkKV
from .shutdown import joined, stop_at_exit

logger = logging.getLogger(__name__)

# (prefix ids, chunk ids, its captured entry or None, what watches the layers of its prefill): store that chunk's KV
# (prefilling it when there is no captured entry)
Fill = Callable[[Sequence[int], Sequence[int], ChunkKV | None, LayerEvents | None], None]
IDLE_S = 5.0  # the background thread ends after this long with nothing queued

Item = tuple[tuple[int, ...], tuple[int, ...], ChunkKV | None]


@dataclass(frozen=True)
class FillStats:
    """What the fills have done since the engine was made (`engine.fill_stats`)."""

    prefilled: int  # chunks prefilled and stored after the answers that skipped them
    captured: int  # entries stored from the full prefill that computed them (a write, no compute)
    failed: int  # fills that raised (logged; the next request that needs the chunk computes it)
    prefill_s: float  # seconds spent prefilling and storing, other requests' decode steps in between excluded
    pending: int  # chunks queued or being stored now


class DeferredFills:
    """The queue of chunks to store, its background thread (started on first use, a daemon: pending fills are only
    cache entries, so a process that exits without `wait()` loses nothing but them) and the host's turns."""

    def __init__(self, fill: Fill, lock: threading.RLock) -> None:
        self._fill = fill
        self._lock = lock  # the engine's: one forward at a time
        self._items: deque[Item] = deque()
        self._pending: dict[tuple[int, ...], int] = {}  # chunk ids -> queued or being stored
        self._cond = threading.Condition()
        self._host: int | None = None  # the thread that runs the queue while it serves requests
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._prefilled = self._captured = self._failed = 0
        self._prefill_s = 0.0
        stop_at_exit(self)

    def submit(
        self,
        prefix_ids: Sequence[int],
        chunks: Iterable[Sequence[int]],
        captured: Mapping[tuple[int, ...], ChunkKV] | None = None,
    ) -> None:
        """Queue `chunks` (after `prefix_ids`) to be stored, from their `captured` entry where there is one, else
        prefilled."""
        chunks = tuple(tuple(c) for c in chunks)
        if not chunks:
            return
        captured = captured or {}
        with self._cond:
            if self._stopped:
                return  # the process is exiting: a cache entry is not worth holding it up
            for c in chunks:
                self._pending[c] = self._pending.get(c, 0) + 1
                self._items.append((tuple(prefix_ids), c, captured.get(c)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cacheblend-deferred-fills", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def host(self, active: bool) -> None:
        """The calling thread starts (`True`) or stops running the queue in its own turns (`run_next`); while it
        does, the background thread leaves the queue to it."""
        me = threading.get_ident()
        with self._cond:
            if active:
                self._host = me
            elif self._host == me:
                self._host = None
            self._cond.notify_all()

    def run_next(self, events: LayerEvents | None = None) -> bool:
        """Store the next queued chunk on this thread, `events` told of the layers of its prefill (the scheduler's
        decode steps for the requests answering). -> False when nothing was queued."""
        with self._cond:
            if not self._items:
                return False
            item = self._items.popleft()
        self._store(item, events)
        return True

    def wait_for(self, chunks: Iterable[Sequence[int]], timeout: float | None = None) -> bool:
        """Wait until none of `chunks` is queued or being stored (`timeout` 0: only look). On the host's thread,
        the queue is run here until they are. Never call it holding the engine's lock."""
        wanted = {tuple(c) for c in chunks}
        if timeout != 0 and threading.get_ident() == self._host:
            while self._has_pending(wanted) and self.run_next():
                pass  # whatever is left is being stored on the background thread: wait for it below
        with self._cond:
            return self._cond.wait_for(lambda: not wanted & self._pending.keys(), timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is stored. -> False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def stop(self, timeout: float | None = None) -> bool:
        """Drop the queued chunks (they are only cache entries) and end the background thread once the chunk being
        stored is; -> False if it was still storing after `timeout` seconds. Later submissions are ignored."""
        with self._cond:
            self._stopped = True
            while self._items:  # nothing queued will be stored: no one may wait for it
                self._done(self._items.popleft()[1])
            self._cond.notify_all()
            thread = self._thread
        return joined(thread, timeout)

    def after_fork_in_child(self) -> None:
        """In a forked child (`forking`): what the parent queued is the parent's to store; start empty, with no
        thread and a fresh lock."""
        self._cond = threading.Condition()
        self._items = deque()
        self._pending = {}
        self._host = self._thread = None

    @property
    def pending(self) -> int:
        """How many chunks are queued or being stored."""
        with self._cond:
            return sum(self._pending.values())

    @property
    def stats(self) -> FillStats:
        """What the fills have done so far, and how many chunks are still queued."""
        with self._cond:
            pending = sum(self._pending.values())
            return FillStats(self._prefilled, self._captured, self._failed, self._prefill_s, pending)

    def _has_pending(self, wanted: set[tuple[int, ...]]) -> bool:
        with self._cond:
            return bool(wanted & self._pending.keys())

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._stopped or (self._items and self._host is None), IDLE_S):
                    if self._items:
                        continue  # the scheduler hosts them
                    self._thread = None  # idle: the next submission starts a new one
                    return
                if self._stopped:
                    return
                item = self._items.popleft()
            self._store(item, None)

    def _store(self, item: Item, events: LayerEvents | None) -> None:
        prefix_ids, chunk, kv = item
        spent = 0.0 if events is None else events.spent_s  # time in the events (others' decode steps): not the fill's
        t = time.perf_counter()
        failed = False
        try:
            with self._lock:
                self._fill(prefix_ids, chunk, kv, events)
        except Exception as exc:  # a fill is an optimisation: report it and go on
            failed = True
            logger.warning("storing a chunk after a cold request failed (%s: %s); the next request that "
                           "retrieves it computes it", type(exc).__name__, exc)  # fmt: skip
        finally:
            with self._cond:  # counted before the waiters are told
                if failed:
                    self._failed += 1
                elif kv is None:
                    self._prefilled += 1
                    hosted = 0.0 if events is None else events.spent_s - spent
                    self._prefill_s += time.perf_counter() - t - hosted
                else:
                    self._captured += 1
                self._done(chunk)
                self._cond.notify_all()

    def _done(self, chunk: tuple[int, ...]) -> None:
        """One queued item of `chunk` is stored or dropped (under the condition's lock)."""
        self._pending[chunk] -= 1
        if not self._pending[chunk]:
            del self._pending[chunk]
