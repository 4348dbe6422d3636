"""Stopping the engine's worker threads before the interpreter exits.

The scheduler and the queue of chunks to store run on daemon threads, so that a script never hangs at its end on
work nobody waits for. But a daemon thread still inside a torch call when Python finalizes is killed in the middle
of C++ code, and the process aborts ("terminate called without an active exception"), after every answer was
printed. So each worker registers here, and at exit (an `atexit` hook, which runs while threads still run
normally) every live worker is told to stop and joined: queued work is dropped, the step in progress finishes.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Protocol

EXIT_TIMEOUT_S = 30.0  # per worker: the longest one step in progress (a prefill, a decode step, a fill) may take


class Worker(Protocol):
    """Something that runs on a thread of its own and can be told to stop."""

    def stop(self, timeout: float | None = None) -> bool:
        """Drop what is queued, let the step in progress finish and end the thread; -> False if it was still
        running after `timeout` seconds. Later work is refused (the scheduler raises, the fills drop it)."""
        ...


_workers: weakref.WeakSet[Worker] = weakref.WeakSet()
_guard = threading.Lock()
_hooked = False


def stop_at_exit(worker: Worker) -> None:
    """Have `worker.stop()` called when the interpreter exits (if `worker` still exists then)."""
    global _hooked
    with _guard:
        _workers.add(worker)
        if not _hooked:
            atexit.register(stop_all)
            _hooked = True


def joined(thread: threading.Thread | None, timeout: float | None) -> bool:
    """Wait up to `timeout` seconds for `thread` to end (not when it is the calling thread); -> whether it has."""
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    return not thread.is_alive()


def stop_all(timeout: float = EXIT_TIMEOUT_S) -> None:
    """Stop every registered worker, each given up to `timeout` seconds (the exit hook)."""
    with _guard:
        workers = list(_workers)
    for worker in workers:
        worker.stop(timeout)
