"""Storing the chunks a cold request was answered without, after the call returns (the miss policy's fill).

A cold request is answered with a full prefill. The missing chunks whose entries that prefill computed are
stored from it (`ChunkCache.capture`); the others are prefilled (after their context, when they have one) and
stored after the answer, so that the next request that retrieves them is fast. That work
belongs to no one's answer: `DeferredFills` runs it on one background thread, one chunk per turn of the engine's
lock, so requests keep their turns between chunks. A request that needs a chunk still queued waits for it
(`wait_for`) rather than computing it twice; `wait()` waits for everything (before a process exits).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from ..store import ChunkKV
from .metrics import RequestMetrics

logger = logging.getLogger(__name__)

# (prefix ids, chunk ids, its captured entry or None): store that chunk's KV (prefilling it when None)
Fill = Callable[[Sequence[int], Sequence[int], ChunkKV | None], None]
Item = tuple[tuple[int, ...], tuple[tuple[int, ...], ...], RequestMetrics, Mapping[tuple[int, ...], ChunkKV]]


class DeferredFills:
    """One worker thread that stores queued chunks; started on first use, a daemon (pending fills are only cache
    entries: a process that exits without `wait()` loses nothing but them)."""

    def __init__(self, fill: Fill, lock: threading.RLock) -> None:
        self._fill = fill
        self._lock = lock  # the engine's: one forward at a time
        self._queue: queue.Queue[Item] = queue.Queue()
        self._pending: dict[tuple[int, ...], int] = {}  # chunk ids -> queued count
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(
        self,
        prefix_ids: Sequence[int],
        chunks: Iterable[Sequence[int]],
        metrics: RequestMetrics,
        captured: Mapping[tuple[int, ...], ChunkKV] | None = None,
    ) -> None:
        """Queue `chunks` (after `prefix_ids`) to be stored, from their `captured` entry where there is one;
        `metrics.deferred_fill_s` adds the time the others took to prefill and store."""
        chunks = tuple(tuple(c) for c in chunks)
        if not chunks:
            return
        with self._cond:
            for c in chunks:
                self._pending[c] = self._pending.get(c, 0) + 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cacheblend-deferred-fills", daemon=True)
                self._thread.start()
        self._queue.put((tuple(prefix_ids), chunks, metrics, dict(captured or {})))

    def wait_for(self, chunks: Iterable[Sequence[int]], timeout: float | None = None) -> bool:
        """Wait until none of `chunks` is queued or being stored. Never call it holding the engine's lock."""
        wanted = {tuple(c) for c in chunks}
        with self._cond:
            return self._cond.wait_for(lambda: not wanted & self._pending.keys(), timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is stored. -> False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    @property
    def pending(self) -> int:
        """How many chunks are queued or being stored."""
        with self._cond:
            return sum(self._pending.values())

    def _run(self) -> None:
        while True:
            prefix_ids, chunks, metrics, captured = self._queue.get()
            for c in chunks:
                t, prefilled = time.perf_counter(), c not in captured
                try:
                    with self._lock:
                        self._fill(prefix_ids, c, captured.pop(c, None))  # dropped once stored
                except Exception as exc:  # a fill is an optimisation: report it and go on
                    logger.warning("storing a chunk after a cold request failed (%s: %s); the next request that "
                                   "retrieves it computes it", type(exc).__name__, exc)  # fmt: skip
                finally:
                    if prefilled:  # a captured entry only costs its store's write
                        metrics.deferred_fill_s += time.perf_counter() - t  # before the waiters are told
                    with self._cond:
                        self._pending[c] -= 1
                        if not self._pending[c]:
                            del self._pending[c]
                        self._cond.notify_all()
