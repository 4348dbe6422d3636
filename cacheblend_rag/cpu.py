"""What this CPU can do that matters for the dtype: bfloat16 is fast on a CPU only with bf16 instructions (Intel
AMX, or AVX-512 with its BF16 extension). Without them PyTorch converts every bf16 value to float32 and back, and
bfloat16 runs several times slower than float32 (4.1x measured on a 2-core AVX2 machine). And how its threads are
kept: `release_thread_pool`. Torch-free, so the CLI's help can use it."""

from __future__ import annotations

import ctypes
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # /proc/cpuinfo's names for the instructions
SLOW_BF16_WARNING = (
    "this CPU has no bf16 instructions (AMX or AVX-512-BF16): bfloat16 runs slower than float32 here; use float32"
)


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool | None:
    """Whether this CPU has bf16 instructions (`amx_bf16` or `avx512_bf16` among its flags): True or False on an
    x86 Linux machine, None where it cannot be told (no /proc/cpuinfo, or no x86 flags in it)."""
    try:
        return bf16_in_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return None


def bf16_in_cpuinfo(text: str) -> bool | None:
    """`cpu_has_bf16` read from the text of /proc/cpuinfo: the first "flags" line decides; None without one."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return not BF16_FLAGS.isdisjoint(value.split())
    return None


def warn_if_slow_bf16(device: object, dtype: object) -> None:
    """Warn (`SLOW_BF16_WARNING`) when a model is to run in bfloat16 on a CPU known to lack bf16 instructions;
    nothing on other devices or dtypes, or where `cpu_has_bf16()` cannot tell. `device`, `dtype`: torch's."""
    if getattr(device, "type", device) == "cpu" and str(dtype) == "torch.bfloat16" and cpu_has_bf16() is False:
        warnings.warn(SLOW_BF16_WARNING, stacklevel=3)


# PyTorch's Linux wheels run their CPU threads on GNU OpenMP (libgomp), which keeps a pool of threads for every thread
# that runs torch operations. While the pools together hold more threads than the machine has cores, libgomp makes
# every pool's threads sleep between operations instead of spinning, and a decode step (a few hundred short
# parallel operations) ran 1.4x slower on a 2-core CPU. A thread that has done its share of torch work and now only
# waits (it loaded the model, stored chunks, or read an answer that the engine's worker thread now serves) lets its
# pool go, so the thread that computes keeps its pool's threads spinning.
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
