"""Where the model runs: the one rule every entry point uses for `device` (the engine, the CLI, both frameworks and
the embeddings helpers).

"auto", the default everywhere, is the GPU where torch sees one, else the CPU. "cpu", "cuda" and "cuda:N" name a
device; one torch does not have is a ConfigError that says what this machine has. torch is imported only when a
spec needs it (anything but "cpu"), so the settings stay cheap to build.
"""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["DEVICE_AUTO", "check_device_spec", "device_reason", "resolve_device"]

DEVICE_AUTO = "auto"
_CHOICES = "'auto' (the GPU where torch sees one, else the CPU), 'cpu', 'cuda' or 'cuda:N'"


def check_device_spec(spec: object) -> str:
    """The spelling check alone, torch-free: `spec` as a string, or a ConfigError listing the choices."""
    name = str(spec).strip().lower() if spec is not None else ""
    if name in (DEVICE_AUTO, "cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise ConfigError(f"device must be {_CHOICES}, got {spec!r}")


def resolve_device(spec: object = DEVICE_AUTO) -> str:
    """The device a spec names here: "auto" -> "cuda" where `torch.cuda.is_available()`, else "cpu"; "cpu", "cuda",
    "cuda:N" as they are when torch has that device. A torch.device is accepted too.
    Raises ConfigError for a bad name or a missing device."""
    name = check_device_spec(spec)
    if name == "cpu":
        return name
    import torch

    if name == DEVICE_AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {spec!r} asks for CUDA, but torch sees no CUDA device (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda}); use device='auto' or 'cpu'"
        )
    count = torch.cuda.device_count()
    if name.startswith("cuda:") and int(name[5:]) >= count:
        raise ConfigError(
            f"device {spec!r} does not exist: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return name


def device_reason() -> str:
    """Why "auto" resolves as it does here, in one line (what `cacheblend-rag env` prints)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        return f"torch sees {count} CUDA device(s); cuda:0 is {props.name}, {props.total_memory / 2**30:.0f} GiB"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (no CUDA)"
    return f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but sees no CUDA device"
