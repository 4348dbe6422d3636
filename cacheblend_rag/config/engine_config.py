"""`EngineConfig`: where and how the model runs, the store, the blend, how chunk KV is cached, and serving."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..guard import Guard
from .blend import BlendConfig
from .checks import check_count
from .device import DEVICE_AUTO, check_device_spec, resolve_device
from .dtype import normalize_dtype_name
from .serving_config import SERVING_FIELDS, ServingConfig
from .store_config import STORE_FIELDS, StoreConfig

MISS_POLICIES = ("auto", "blend", "full")
# How a chunk's KV is cached (`EngineConfig.chunk_context`), with what each stores beside the chunk's isolated entry.
CHUNK_CONTEXTS: dict[str, str] = {
    "grouped": "precompute caches each chunk within a group of similar chunks; full prefills keep every chunk's KV",
    "captured": "precompute caches each chunk alone; full prefills keep every later chunk's KV as that prompt had it",
    "isolated": "every chunk cached alone, after the prompt's prefix only (the paper's setting)",
}
# Grouped precompute's group size, about a RAG prompt's chunks (6 of 512 tokens): on the paired fidelity run it brought
# every ratio closer to full recompute (docs/benchmarks.md, "Grouped precompute").
DEFAULT_GROUP_TOKENS = 3072

# Settings that left `EngineConfig`, and what replaces each (refused with that advice for one release).
_MOVED_TO_STORE = "moved to StoreConfig: EngineConfig(store=StoreConfig({name}=...))"
_MOVED_TO_SERVING = "moved to ServingConfig: EngineConfig(serving=ServingConfig({name}=...))"
REMOVED: dict[str, str] = {
    **{name: _MOVED_TO_STORE.format(name=name) for name in STORE_FIELDS if name != "hmac_key"},
    **{name: _MOVED_TO_SERVING.format(name=name) for name in SERVING_FIELDS},
    "store_hmac_key": "moved to StoreConfig: EngineConfig(store=StoreConfig(hmac_key=...))",
    "capture": "replaced by chunk_context: capture='all' is chunk_context='captured' (or the default 'grouped'), "
    "capture='exact' is chunk_context='isolated'",
    "precompute_groups": "replaced by chunk_context: 'grouped' (the default) precomputes in groups, 'captured' or "
    "'isolated' does not; the group size is precompute(..., group_tokens=N)",
    "context_neighbours": "neighbour context left the product (grouped precompute, the default, took its place); "
    "to cache chunks after given texts, pass them as precompute(chunks, context=[[text, ...], ...])",
    "stale_key_temperature": "the attention temperature on stale KV left the product (within noise for the default "
    "blend; research/README.md keeps its study)",
    "pipelined_loading": "pipelined loading is always on (benchmarks compare it with "
    "engine.prefiller.pipelined = False)",
}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: device and precision, the chunk KV store, the blend, how chunk KV is cached, serving."""

    # "auto" (default): the GPU where torch sees one, else the CPU (`config.resolve_device`); or "cpu", "cuda",
    # "cuda:N". Decided when the config is made: `config.device` names the choice.
    device: str = DEVICE_AUTO
    # "auto" (default): bfloat16 on a GPU and on a CPU with bf16 instructions, float32 elsewhere; "float32" for
    # exactness; "bfloat16" / "float16". Decided for the device when the config is made: `config.dtype` names it.
    dtype: str = "auto"
    store: StoreConfig = field(default_factory=StoreConfig)  # the tiers that keep chunk KV, their budgets and codecs
    blend: BlendConfig = field(default_factory=BlendConfig)  # the blend's rule and ratio r
    # How chunk KV is cached beside each chunk's isolated entry: "grouped" (default), "captured" or "isolated"
    # (`CHUNK_CONTEXTS`; docs/configuration.md, "How chunk KV is cached").
    chunk_context: str = "grouped"
    # A request with chunks not stored yet: "blend" prefills each missing chunk, stores it and blends; "full" answers
    # with a full prefill and stores the missing chunks after the answer; "auto" does the latter only when the
    # missing chunks would cost more to prefill than the whole prompt (docs/benchmarks.md, "Cold requests").
    miss_policy: str = "auto"
    # The fidelity guard of the "attention" rule (`guard.Guard`): escalates a request whose blend looks risky
    # to a larger recompute budget. None: off.
    guard: Guard | None = None
    chunk_separator: str = "\n\n"  # appended to each chunk's text before tokenizing (part of its cache key)
    max_prompt_tokens: int | None = None  # None: the model's context length
    # CUDA only: the row-wise half of each prefill layer (norms, q/k/v, RoPE, MLP) of up to 2,048 recomputed tokens,
    # padded to a size bucket and replayed as CUDA graphs (`fusion.GraphedLayerSteps`); the same tokens as the eager
    # layers at bf16 tolerance. Off until a GPU run shows its gain.
    prefill_graphs: bool = False
    # How requests are served together: the decode batch and its KV bound, decode steps between a prefill's
    # layers, the decode step's weights and CUDA graphs (`ServingConfig`; docs/configuration.md, "Serving many
    # requests").
    serving: ServingConfig = field(default_factory=ServingConfig)

    def __new__(cls, *args: Any, **kwargs: Any) -> EngineConfig:
        gone = [name for name in kwargs if name in REMOVED]
        if gone:
            raise ConfigError("; ".join(f"EngineConfig({name}=...): {REMOVED[name]}" for name in gone))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        dev = check_device_spec(self.device)
        if dev == DEVICE_AUTO:  # decided here; a named GPU is checked against torch's when the model loads
            dev = resolve_device(dev)
        object.__setattr__(self, "device", dev)
        object.__setattr__(self, "dtype", normalize_dtype_name(self.dtype, dev))  # "auto" decided here
        if not isinstance(self.store, StoreConfig):
            raise ConfigError(f"store must be a StoreConfig, got {type(self.store).__name__}")
        if self.chunk_context not in CHUNK_CONTEXTS:
            raise ConfigError(f"chunk_context must be one of {', '.join(CHUNK_CONTEXTS)}, got {self.chunk_context!r}")
        if not isinstance(self.serving, ServingConfig):
            raise ConfigError(f"serving must be a ServingConfig, got {type(self.serving).__name__}")
        if self.serving.decode_weights == "int8" and dev != "cpu":
            raise ConfigError("serving.decode_weights='int8' runs on the CPU's int8 kernels; use 'native' on a GPU")
        if self.serving.decode_graphs and dev == "cpu":
            raise ConfigError("serving.decode_graphs=True replays CUDA graphs: it needs device='cuda'")
        if not isinstance(self.prefill_graphs, bool):
            raise ConfigError(f"prefill_graphs must be True or False, got {self.prefill_graphs!r}")
        if self.prefill_graphs and dev == "cpu":
            raise ConfigError("prefill_graphs=True replays CUDA graphs: it needs device='cuda'")
        if self.max_prompt_tokens is not None:
            check_count("max_prompt_tokens", self.max_prompt_tokens, 1, "a number of tokens, or None")
        if not isinstance(self.chunk_separator, str):
            raise ConfigError(f"chunk_separator must be a string, got {type(self.chunk_separator).__name__}")
        if not isinstance(self.blend, BlendConfig):
            raise ConfigError(f"blend must be a BlendConfig, got {type(self.blend).__name__}")
        if self.guard is not None and not isinstance(self.guard, Guard):
            raise ConfigError(f"guard must be a Guard or None, got {type(self.guard).__name__}")
        if self.guard is not None and not self.blend.uses_attention_pass:
            raise ConfigError(
                f"the guard reads the 'attention' rule's first pass, but blend.rule is {self.blend.rule!r}; use "
                "blend_rule('attention', r) or guard=None"
            )
        if self.guard is not None and not self.blend.full_probe:
            raise ConfigError(
                f"the guard reads full reuse's logits from a first pass over every layer, but blend.probe_depth is "
                f"{self.blend.probe_depth:g}; use probe_depth=1.0 or guard=None"
            )
        if self.miss_policy not in MISS_POLICIES:
            raise ConfigError(f"miss_policy must be one of {', '.join(MISS_POLICIES)}, got {self.miss_policy!r}")

    @property
    def capture_policy(self) -> str:
        """Which captured entries requests read and full prefills store: "all" (every later chunk's, as the prompt
        computed it) for "grouped" and "captured", "exact" (only entries a full prefill computes as they are
        stored) for "isolated" (`engine.chunks.placement`)."""
        return "exact" if self.chunk_context == "isolated" else "all"

    @property
    def group_tokens(self) -> int:
        """Grouped precompute's group size (0: chunks are precomputed alone)."""
        return DEFAULT_GROUP_TOKENS if self.chunk_context == "grouped" else 0
