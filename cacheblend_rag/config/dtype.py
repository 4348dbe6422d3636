"""The precision names the settings take ('bf16', torch.bfloat16, 'auto', ...) and the torch dtype of each."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def normalize_dtype_name(dtype: object, device: object = "auto") -> str:
    """'bf16', torch.bfloat16, ... -> 'bfloat16'; anything else is a ConfigError listing the choices.

    "auto" picks for `device`: bfloat16 on a GPU and on a CPU with bf16 instructions (AMX or AVX-512-BF16), where it
    is the fast precision; float32 on other CPUs, where bf16 runs several times slower (`cpu.py`)."""
    name = str(dtype).removeprefix("torch.").lower()
    if name == "auto":
        return auto_dtype(device)
    if name not in _DTYPES:
        raise ConfigError(
            f"dtype must be one of float32, bfloat16, float16 (or fp32/bf16/fp16), or auto, got {dtype!r}"
        )
    return _DTYPES[name]


def auto_dtype(device: object = "auto") -> str:
    """What "auto" picks on `device`: bfloat16 on a GPU and on a CPU with bf16 instructions, else float32."""
    from ..cpu import cpu_has_bf16  # torch-free
    from .device import DEVICE_AUTO, resolve_device

    if str(device) == DEVICE_AUTO:
        device = resolve_device(device)
    return "bfloat16" if str(device).startswith("cuda") or cpu_has_bf16() else "float32"


def torch_dtype(dtype: object, device: object = "auto") -> Any:
    """'bf16', 'float32', torch.float16, 'auto' (for `device`), ... -> the torch.dtype; anything else is a
    ConfigError."""
    import torch

    return getattr(torch, normalize_dtype_name(dtype, device))
