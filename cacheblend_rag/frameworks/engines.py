"""The engine a framework's model object loads, shared per process, and the name it reports."""

from __future__ import annotations

import functools
import os
from typing import Any

from ..config import EngineConfig, StoreConfig
from ..engine import CacheBlendEngine
from ..errors import ConfigError

# -- the engine and its name -----------------------------------------------------------------------------------


# What a framework model object may set of the engine it loads (the names of EngineConfig and, for the store, of
# StoreConfig); None: the default.
ENGINE_SETTINGS = (
    "device",
    "dtype",
    "memory_budget_bytes",
    "disk_dir",
    "disk_budget_bytes",
    "redis_url",
    "redis_budget_bytes",
)
# What the frameworks' model objects say of their device and dtype fields: None leaves each to the engine's default.
DEVICE_HELP = (
    "Torch device of a loaded engine: 'auto' (the GPU where torch sees one, else the CPU), 'cpu', 'cuda' or "
    "'cuda:N'; None: the engine's default, 'auto'."
)
DTYPE_HELP = (
    "Precision of a loaded engine: 'auto' (bfloat16 on a GPU or a CPU with bf16 instructions, else float32), "
    "'float32', 'bfloat16' or 'float16'; None: the engine's default, 'auto'."
)
# Those that describe the chunk store: an engine passed in has its own, so they cannot apply to it.
STORE_SETTINGS = ("memory_budget_bytes", "disk_dir", "disk_budget_bytes", "redis_url", "redis_budget_bytes")


def engine_config(**settings: Any) -> EngineConfig:
    """The EngineConfig of a loaded engine from a model object's settings (`ENGINE_SETTINGS`; None: the default).

    A disk folder is made absolute, so two spellings of one folder name one engine. Bad values raise ConfigError.
    """
    unknown = set(settings) - set(ENGINE_SETTINGS)
    if unknown:
        raise TypeError(f"unknown engine settings {sorted(unknown)}; the accepted ones are {list(ENGINE_SETTINGS)}")
    given = {name: value for name, value in settings.items() if value is not None}
    if "disk_dir" in given:
        given["disk_dir"] = os.path.abspath(os.path.expanduser(os.fspath(given["disk_dir"])))
    store = StoreConfig(**{name: given.pop(name) for name in STORE_SETTINGS if name in given})
    return EngineConfig(store=store, **given)


def check_no_store_settings(**settings: Any) -> None:
    """ConfigError when store settings come with an engine built by the caller: it has its own store."""
    given = sorted(name for name in STORE_SETTINGS if settings.get(name) is not None)
    if given:
        raise ConfigError(
            f"{', '.join(given)} set the store of an engine the model loads, but an engine was passed in, which "
            "has its own; put them in that engine's StoreConfig, or drop engine= to let the model load one"
        )


def load_engine(name_or_path: str | None = None, **settings: Any) -> CacheBlendEngine:
    """The engine of a preset or local checkpoint, built once per process and shared by every model object.

    Building an engine loads the model (seconds) and owns the chunk KV store: sharing it lets every chain,
    LLM, chat model and synthesizer of a process reuse each other's chunk caches. The engine is thread-safe.
    `settings` are `ENGINE_SETTINGS` (device, dtype, store tiers and budgets): model objects share an engine only
    when the model (None: `default_model()`, `$CACHEBLEND_RAG_MODEL` or the default preset) and every setting are
    equal, so two objects with different stores never share one. Pass an engine you built yourself to control
    the rest of its configuration (blend settings, lead-in, signing key).
    """
    from ..models import default_model

    return _shared_engine(name_or_path or default_model(), engine_config(**settings))


@functools.lru_cache(maxsize=8)
def _shared_engine(name_or_path: str, config: EngineConfig) -> CacheBlendEngine:
    return CacheBlendEngine.from_pretrained(name_or_path, config=config, show_progress=False)


def resolve_model_name(requested: str | None = None, engine: CacheBlendEngine | None = None) -> str:
    """The name metadata and traces report: the name the user gave (a preset or a path), else the engine's
    checkpoint name or folder as `transformers` recorded it ("cacheblend" for a model built in code), else
    `default_model()` (what `load_engine()` loads)."""
    if requested:
        return requested
    if engine is not None:
        return str(engine.model.config.name_or_path or "cacheblend")
    from ..models import default_model

    return default_model()
