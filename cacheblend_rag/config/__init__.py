"""The settings, as frozen dataclasses validated on creation: the ground floor, importing nothing of the package
but its errors and the guard's policy, and never torch.

- `blend`: `BlendConfig` (the algorithm's hyperparameters, paper §4.3), the selection rules, the prefill modes;
- `engine_config`: `EngineConfig` (device, precision, the store, the blend, how chunk KV is cached, serving);
- `store_config`: `StoreConfig` (the tiers that keep chunk KV, their budgets and codecs);
- `serving_config`: `ServingConfig` (the decode batch, steps between a prefill's layers, the decode step's weights);
- `device`: where the model runs (`resolve_device`: "auto" is the GPU where torch sees one);
- `dtype`: precision names; `checks`: the number checks every setting and request argument shares.
Per-request choices (mode, ratio override, sampling) are arguments of the engine's calls, never module state.
"""

from ..guard import Guard  # the guard's policy lives with its signals and loop; re-exported here
from .blend import RULE_NAMES, RULES, BlendConfig, PrefillMode, blend_rule
from .device import resolve_device
from .dtype import normalize_dtype_name, torch_dtype
from .engine_config import CHUNK_CONTEXTS, DEFAULT_GROUP_TOKENS, MISS_POLICIES, EngineConfig
from .serving_config import DECODE_WEIGHTS, ServingConfig
from .store_config import CODEC_NAMES, StoreConfig

__all__ = [
    "CHUNK_CONTEXTS",
    "CODEC_NAMES",
    "DECODE_WEIGHTS",
    "DEFAULT_GROUP_TOKENS",
    "MISS_POLICIES",
    "RULES",
    "RULE_NAMES",
    "BlendConfig",
    "EngineConfig",
    "Guard",
    "PrefillMode",
    "ServingConfig",
    "StoreConfig",
    "blend_rule",
    "normalize_dtype_name",
    "resolve_device",
    "torch_dtype",
]
