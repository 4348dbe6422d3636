"""What this CPU can do that matters for the dtype: bfloat16 is fast on a CPU only with bf16 instructions (Intel
AMX, or AVX-512 with its BF16 extension). Without them PyTorch converts every bf16 value to float32 and back, and
bfloat16 runs several times slower than float32 (4.1x measured on a 2-core AVX2 machine). Torch-free, so the
settings and the CLI's help can use it."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

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


# The flags a bug report about speed needs: AVX-512 (fast fp32), its BF16 extension and AMX (fast bf16).
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_summary(cpuinfo: str | None = None) -> tuple[str, dict[str, bool]]:
    """(this CPU's model name, whether it has each of `REPORTED_FLAGS`) read from /proc/cpuinfo (or `cpuinfo`'s
    text); ("unknown", {}) where it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return "unknown", {}
    model, flags = "unknown", None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    return model, ({} if flags is None else {flag: flag in flags for flag in REPORTED_FLAGS})
