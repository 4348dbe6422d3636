"""Letting go of the CPU thread pool of a thread that only waits.

PyTorch's Linux wheels run their CPU threads on GNU OpenMP (libgomp), which keeps a pool of threads for every thread
that runs torch operations. While the pools together hold more threads than the machine has cores, libgomp makes
every pool's threads sleep between operations instead of spinning, and a decode step (a few hundred short parallel
operations) ran 1.4x slower on a 2-core CPU. A thread that has done its share of torch work and now only waits (it
loaded the model, stored chunks, or read an answer that the engine's worker thread now serves) lets its pool go, so
the thread that computes keeps its pool's threads spinning.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
_libgomp_pause: list[Callable[[int], int]] = []
_torch_without_libgomp: list[bool] = []  # [True] once torch was found loaded with no libgomp beside it
_OMP_PAUSE_SOFT = 1  # omp_pause_soft: the pool's threads end; the next parallel operation on the thread starts new ones


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP worker threads (`omp_pause_resource_all` of each libgomp this process has
    loaded); its next torch operation starts them again (tens of microseconds). -> whether a libgomp was found
    (False on a runtime that is not libgomp, such as macOS or Windows builds, where this does nothing)."""
    if not _libgomp_pause and not _torch_without_libgomp:
        try:
            maps = Path("/proc/self/maps").read_text(errors="replace")
        except OSError:
            return False
        for path in sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}):
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            _libgomp_pause.append(pause)
        if not _libgomp_pause and "libtorch_cpu" in maps:  # torch runs on another runtime: no need to look again
            _torch_without_libgomp.append(True)
    for pause in _libgomp_pause:
        pause(_OMP_PAUSE_SOFT)
    return bool(_libgomp_pause)


def releasing_thread_pool(method: Callable[P, R]) -> Callable[P, R]:
    """For an engine method that computes on its caller's thread: the caller's pool is let go when it returns."""

    @functools.wraps(method)
    def released(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        finally:
            release_thread_pool()

    return released
