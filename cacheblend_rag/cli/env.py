"""`cacheblend-rag env`: what a bug report needs, in one paste (as `transformers env` does).

Package versions, the torch build, this machine's CPU and GPU, what `device="auto"` and `dtype="auto"` resolve to
here and why, whether a model's family can be blended (`--model`, from its config alone: no weights are read), and
which store tiers answer (`--kv-dir`, `--redis-url`). Nothing is written, and no model is loaded.
"""

from __future__ import annotations

import argparse
import logging
import platform
from importlib import metadata
from pathlib import Path

__all__ = ["PACKAGES", "cmd_env", "environment_report"]

# The distributions whose versions decide behaviour, in the order a reader looks for them.
PACKAGES = (
    "cacheblend-rag",
    "torch",
    "transformers",
    "accelerate",
    "safetensors",
    "sentence-transformers",
    "faiss-cpu",
    "diskcache",
    "redis",
    "langchain-cacheblend",
    "langchain-core",
    "llama-index-cacheblend",
    "llama-index-core",
)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _device_lines() -> list[str]:
    import torch

    from ..config import resolve_device
    from ..config.device import device_reason
    from ..config.dtype import auto_dtype
    from ..cpu import cpu_has_bf16, cpu_summary

    model, flags = cpu_summary()
    shown = ", ".join(f"{flag} {'yes' if has else 'no'}" for flag, has in flags.items()) or "flags unknown"
    lines = [f"cpu: {model}, {torch.get_num_threads()} torch threads; {shown}"]
    device = resolve_device("auto")
    lines.append(f'device "auto" -> {device}: {device_reason()}')
    dtype = auto_dtype(device)
    if device.startswith("cuda"):
        why = "GPUs run bf16 at full speed"
    elif cpu_has_bf16():
        why = "this CPU has bf16 instructions (avx512_bf16 or amx_bf16)"
    elif cpu_has_bf16() is False:
        why = "this CPU has no bf16 instructions, where bf16 runs several times slower than float32"
    else:
        why = "whether this CPU has bf16 instructions cannot be told"
    lines.append(f'dtype "auto" -> {dtype}: {why}')
    return lines


def _model_line(name: str) -> str:
    """Whether `name` (a preset, a folder or a cached hub id) can be blended, from its config alone."""
    from transformers import AutoConfig

    from ..errors import CacheBlendError
    from ..models import check_supported
    from ..models.presets import find_preset

    preset = find_preset(name)
    source = name
    if preset is not None:
        from ..models.gguf import preset_cache_dir

        source = str(preset_cache_dir(preset) / "hf")  # its converted copy, once made
        if not Path(source, "config.json").is_file():
            return f"model {name}: a packaged preset ({preset.description}); supported, not converted yet"
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        return (f"model {name}: not a preset, and no config.json in a folder of that name or in the local Hugging "
                "Face cache")  # fmt: skip
    try:
        check_supported(config)
    except CacheBlendError as err:
        return f"model {name} ({config.model_type}): refused: {err}"
    return f"model {name} ({config.model_type}): supported; {_fast_paths(config)}"


def _fast_paths(config: object) -> str:
    """Which fast paths the engine takes for a model of this config, read from a weightless copy of it (meta)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.layer_spec import read_spec

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        spec = read_spec(model)
    except Exception as err:  # a config transformers cannot build a model of: say so, the check above stands
        return f"fast paths unknown ({type(err).__name__}: {err})"
    covered = "yes" if spec.llama_like else "no (the exact path)"
    return f"fast paths: fused q/k/v projections yes; int8 decode weights and CUDA graphs {covered}"


def _store_lines(kv_dir: str | None, redis_url: str | None) -> list[str]:
    from ..config.checks import mask_url
    from ..errors import CacheBlendError

    lines = ["store memory tier: in-process, always available"]
    if kv_dir is None:
        lines.append("store disk tier: not asked (--kv-dir DIR checks a folder)")
    else:
        from ..store import check_disk_dir

        if not Path(kv_dir).expanduser().exists():
            lines.append(f"store disk tier {kv_dir}: does not exist yet (the engine makes it)")
        else:
            try:
                check_disk_dir(kv_dir)
                lines.append(f"store disk tier {kv_dir}: usable")
            except CacheBlendError as err:
                lines.append(f"store disk tier {kv_dir}: not usable: {err}")
    if redis_url is None:
        lines.append("store redis tier: not asked (--redis-url URL checks a server)")
    elif _version("redis") == "not installed":
        lines.append("store redis tier: the redis package is missing: pip install 'cacheblend-rag[redis]'")
    else:
        lines.append(f"store redis tier {mask_url(redis_url)}: {_redis_state(redis_url)}")
    return lines


def _redis_state(url: str) -> str:
    from ..errors import CacheBlendError
    from ..store.redis_store import RedisStore

    logging.disable(logging.WARNING)  # the tier logs an outage; here it is the answer, printed once below
    try:
        tier = RedisStore(url, connect_timeout_s=1.0, read_timeout_s=1.0)
        stored = tier.nbytes  # one round trip; an outage is counted, not raised
    except CacheBlendError as err:
        return f"not usable: {err}"
    finally:
        logging.disable(logging.NOTSET)
    if tier.stats.errors:
        return "unreachable (no answer within 1 s): check the host, port and password"
    return f"reachable, {stored:,} bytes of chunk KV stored"


def environment_report(model: str | None = None, kv_dir: str | None = None, redis_url: str | None = None) -> str:
    """The text `cacheblend-rag env` prints."""
    lines = [f"python {platform.python_version()} ({platform.system()} {platform.machine()})"]
    lines += [f"{name} {_version(name)}" for name in PACKAGES]
    import torch

    lines.append(f"torch build: {'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU only'}")
    lines += _device_lines()
    if model is not None:
        lines.append(_model_line(model))
    lines += _store_lines(kv_dir, redis_url)
    return "\n".join(lines)


def cmd_env(args: argparse.Namespace) -> int:
    print(environment_report(args.model, args.kv_dir, args.redis_url))
    return 0
