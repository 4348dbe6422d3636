"""Settings of the blend (fusion) step and of the engine, as frozen dataclasses validated on creation.

`BlendConfig` holds the algorithm's hyperparameters (paper §4.3); `EngineConfig` holds where and how the model
runs and how much chunk KV stays in memory. Per-request choices (mode, ratio override, sampling) are arguments
of the engine's calls, never module state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from .errors import ConfigError

DEVIATION_KINDS = ("key", "value", "both")
SELECTIONS = ("deviation", "deviation+attention", "deviation*attention", "attention", "attention|deviation", "none")


class PrefillMode(str, Enum):
    """How the prompt's KV cache is built before decoding."""

    FULL = "full"  # recompute every token (the reference)
    PREFIX = "prefix"  # reuse the shared prefix and the first chunk (what prefix caching can reuse)
    REUSE = "reuse"  # reuse every chunk's cached KV at its real position, recompute nothing (PromptCache)
    BLEND = "blend"  # CacheBlend: reuse every chunk and recompute the tokens whose KV deviates most

    @classmethod
    def parse(cls, value: str | PrefillMode) -> PrefillMode:
        if isinstance(value, PrefillMode):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"mode must be one of {names}, got {value!r}") from None


def _check_ratio(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class BlendConfig:
    """Hyperparameters of selective KV recompute: how many reused chunk tokens to recompute, and which.

    The budget is `recompute_ratio` of the reused chunk tokens, recomputed on every layer after the checks.
    Which tokens fill it (the selection rule):
    - `anchor_share` of the budget goes to the first tokens of every chunk, in proportion to its length
      (EPIC's observation: a chunk prefilled on its own puts its error at its start);
    - the rest is ranked by `selection`:
      - "deviation": fresh vs cached K/V on the check layers (paper §4.3). With several check layers the
        candidates shrink step by step (gradual filtering, Fig. 9): check layer j keeps `check_ratios[j]` of the
        reused tokens, chosen among those kept by check layer j-1. Layers up to the first check layer recompute
        every chunk token, which is the price of measuring the deviation.
      - "deviation+attention": as "deviation", but each check layer adds the attention the question's tokens
        pay to each candidate on that layer (each score divided by its mean), so that among deviating tokens
        those the question reads win. No extra layers: the question is computed on the check layers anyway.
      - "deviation*attention": as "deviation+attention", but the two multiply: the question's attention to a
        token times the size of its deviation (the root of the squared distance), which is how much the stale
        KV moves what the question reads. A token with no attention or no deviation is never chosen.
      - "attention|deviation": half of the budget as "attention" chooses, the other half as "deviation" does
        among the remaining tokens (a reuse pass first, then the check layers).
      - "attention": the attention the question's tokens pay to each chunk token, averaged over layers and heads,
        in a first pass that reuses all chunk KV (cheap: only the question is computed); the chosen tokens are
        then recomputed on every layer. No check layers. `probe_depth` < 1 stops that pass early: it computes
        only the first `probe_depth` of the layers (at least 2) and averages their attention. With `per_chunk`,
        each chunk gets its length's share of the attention picks, ranked within the chunk: the question's
        attention favours the last chunk (recency), which is not the same as relevance.
      - "none": no ranking; only the anchors are recomputed (needs `anchor_share=1.0`). No check layers.
    `blend_rule(name, r)` builds the named rules compared in `docs/benchmarks.md`.
    """

    # The defaults are the rule "attention" at r = 0.15, chosen from `bench fidelity` and `benchmarks/ttft.py`
    # (docs/benchmarks.md, "Fidelity to full recompute"): closer to full recompute than the deviation rules on
    # MuSiQue, 2WikiMQA and SAMSum, and faster (no check layers); on MultiNews the deviation rules stay closer.
    # The check-layer fields below serve the deviation rules (e.g. `blend_rule("gradual")`).
    recompute_ratio: float = 0.15  # r: share of reused chunk tokens recomputed on the non-check layers
    check_layers: tuple[int, ...] = (1, 2, 3)  # layers where deviations are measured; increasing, each >= 1
    check_ratios: tuple[float, ...] | None = None  # kept share per check layer; None: derived from the ratio
    filter_slack: float = 0.5  # derived schedule: first check keeps (1 + slack) * r, falling linearly to r
    deviation: str = "key"  # which fresh-vs-cached difference ranks tokens: "key", "value" or "both"
    selection: str = "attention"  # how non-anchor tokens are ranked: see SELECTIONS
    anchor_share: float = 0.0  # share of the budget given to the first tokens of every chunk
    probe_depth: float = 1.0  # share of the layers the attention pass computes (rules with one); at least 2
    per_chunk: bool = False  # attention rankings: each chunk gets its length's share of the budget

    def __post_init__(self) -> None:
        _check_ratio("recompute_ratio", self.recompute_ratio)
        if not self.check_layers:
            raise ConfigError("check_layers must name at least one layer, e.g. (1,), got ()")
        layers = tuple(self.check_layers)
        if any((not isinstance(x, int)) or isinstance(x, bool) or x < 1 for x in layers):
            raise ConfigError(
                f"check_layers must be layer indices >= 1 (layer 0 sees no cross-chunk context), got {layers}"
            )
        if list(layers) != sorted(set(layers)):
            raise ConfigError(f"check_layers must be strictly increasing, got {layers}")
        object.__setattr__(self, "check_layers", layers)
        if not isinstance(self.filter_slack, (int, float)) or not self.filter_slack >= 0:
            raise ConfigError(f"filter_slack must be >= 0, got {self.filter_slack!r}")
        if self.deviation not in DEVIATION_KINDS:
            raise ConfigError(f"deviation must be one of {DEVIATION_KINDS}, got {self.deviation!r}")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        _check_ratio("anchor_share", self.anchor_share)
        _check_ratio("probe_depth", self.probe_depth)
        if self.probe_depth == 0:
            raise ConfigError("probe_depth must be above 0 (a share of the layers), got 0")
        if not isinstance(self.per_chunk, bool):
            raise ConfigError(f"per_chunk must be True or False, got {self.per_chunk!r}")
        if self.per_chunk and not self.uses_attention_pass:
            raise ConfigError(
                f"per_chunk applies to the attention rankings (selection 'attention' or 'attention|deviation'), "
                f"not to {self.selection!r}"
            )
        if self.selection == "none" and self.anchor_share != 1.0:
            raise ConfigError(
                f"selection 'none' recomputes only chunk starts, so anchor_share must be 1.0, got {self.anchor_share}"
            )
        if self.check_ratios is not None:
            ratios = tuple(float(x) for x in self.check_ratios)
            if len(ratios) != len(layers):
                raise ConfigError(
                    f"check_ratios needs one ratio per check layer ({len(layers)}), got {len(ratios)}: {ratios}"
                )
            for i, x in enumerate(ratios):
                _check_ratio(f"check_ratios[{i}]", x)
            if any(b > a for a, b in zip(ratios, ratios[1:], strict=False)):
                raise ConfigError(f"check_ratios must not increase (each check filters the last), got {ratios}")
            if ratios[-1] < self.recompute_ratio:
                raise ConfigError(
                    f"the last check ratio ({ratios[-1]}) must be >= recompute_ratio ({self.recompute_ratio}): "
                    "later layers can only recompute tokens that survived the checks"
                )
            object.__setattr__(self, "check_ratios", ratios)

    @property
    def uses_check_layers(self) -> bool:
        """Whether this rule measures deviations (and so recomputes every chunk token up to a check layer)."""
        return self.selection in ("deviation", "deviation+attention", "deviation*attention", "attention|deviation")

    @property
    def uses_attention_pass(self) -> bool:
        """Whether this rule first runs a reuse pass to read the question's attention."""
        return self.selection in ("attention", "attention|deviation")

    def probe_layers(self, num_layers: int) -> int:
        """How many layers the attention pass computes in a model of `num_layers` layers."""
        return min(num_layers, max(2, math.ceil(self.probe_depth * num_layers - 1e-9)))

    def schedule(self, recompute_ratio: float | None = None) -> tuple[float, ...]:
        """Kept share of reused tokens after each check layer, ending at the recompute ratio."""
        r = self.recompute_ratio if recompute_ratio is None else recompute_ratio
        _check_ratio("recompute_ratio", r)
        if self.check_ratios is not None and recompute_ratio is None:
            return self.check_ratios
        n = len(self.check_layers)
        if n == 1:
            return (r,)
        return tuple(min(1.0, r * (1.0 + self.filter_slack * (n - 1 - j) / (n - 1))) for j in range(n))

    def with_ratio(self, recompute_ratio: float) -> BlendConfig:
        """The same rule at another ratio (explicit check ratios are dropped: they belong to the old r)."""
        _check_ratio("recompute_ratio", recompute_ratio)
        return replace(self, recompute_ratio=recompute_ratio, check_ratios=None)


# The selection rules compared by `cacheblend-rag bench fidelity` (docs/benchmarks.md), by name.
_RULES: dict[str, dict[str, object]] = {
    # CacheBlend's paper and research code: value deviation on layer 1, one top-k
    "paper": {"selection": "deviation", "deviation": "value", "check_layers": (1,)},
    # LMCache's blending: key deviation on layer 1, one top-k
    "lmcache": {"selection": "deviation", "deviation": "key", "check_layers": (1,)},
    # gradual filtering over layers 1-3 on key deviation (the paper's §4.3 refinement)
    "gradual": {"selection": "deviation", "deviation": "key", "check_layers": (1, 2, 3)},
    # EPIC-style static: the first tokens of every chunk, no deviation check
    "epic": {"selection": "none", "anchor_share": 1.0},
    # half the budget on chunk starts, the other half on key deviation at layer 1
    "hybrid": {"selection": "deviation", "deviation": "key", "check_layers": (1,), "anchor_share": 0.5},
    # query-aware: the tokens the question attends to most in a reuse pass: the default
    "attention": {"selection": "attention"},
    # half the budget by the question's attention (reuse pass), half by key deviation on layer 1
    "attention-deviation": {"selection": "attention|deviation", "deviation": "key", "check_layers": (1,)},
    # key deviation plus the question's attention, both on check layer 1
    "deviation-attention": {"selection": "deviation+attention", "deviation": "key", "check_layers": (1,)},
    # value deviation on layer 1 weighted by the question's attention there: the error the question reads
    "weighted-deviation": {"selection": "deviation*attention", "deviation": "value", "check_layers": (1,)},
    # query-aware plus chunk starts, half the budget each
    "attention-anchors": {"selection": "attention", "anchor_share": 0.5},
    # query-aware, each chunk ranked on its own with a budget in proportion to its length
    "attention-quota": {"selection": "attention", "per_chunk": True},
    # as attention-deviation, with the attention half split over chunks by length
    "attention-deviation-quota": {
        "selection": "attention|deviation",
        "deviation": "key",
        "check_layers": (1,),
        "per_chunk": True,
    },
}
RULE_NAMES = tuple(_RULES)


def rule_name(blend: BlendConfig) -> str | None:
    """The name of the rule `blend` follows (whatever its ratio), or None for a rule of its own."""
    for name in RULE_NAMES:
        if blend_rule(name, blend.recompute_ratio) == replace(blend, check_ratios=None):
            return name
    return None


def blend_rule(name: str, recompute_ratio: float = 0.15) -> BlendConfig:
    """The named selection rule at ratio r, e.g. `blend_rule("paper", 0.15)`. Names: see `RULE_NAMES`."""
    if name not in _RULES:
        raise ConfigError(f"unknown blend rule {name!r}; choose one of {', '.join(RULE_NAMES)}")
    return BlendConfig(recompute_ratio=recompute_ratio, **_RULES[name])  # type: ignore[arg-type]


_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def normalize_dtype_name(dtype: object) -> str:
    """'bf16', torch.bfloat16, ... -> 'bfloat16'; anything else is a ConfigError listing the choices."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of float32, bfloat16, float16 (or fp32/bf16/fp16), got {dtype!r}")
    return _DTYPES[name]


def torch_dtype(dtype: object) -> Any:
    """'bf16', 'float32', torch.float16, ... -> the torch.dtype; anything else is a ConfigError."""
    import torch

    return getattr(torch, normalize_dtype_name(dtype))


# A neutral passage for `EngineConfig(lead_in=DEFAULT_LEAD_IN)`: chunks cached after it read as a passage that
# follows another, not as the opening of the prompt. Any ordinary prose of about this length serves; a passage
# typical of your own corpus may serve better.
DEFAULT_LEAD_IN = (
    "Lighthouses have guided ships along dangerous coasts for more than two thousand years. Early ones were "
    "simple towers with an open fire at the top, kept burning through the night by a keeper who carried wood or "
    "coal up the stairs. Later towers used oil lamps and, from the nineteenth century, glass lenses that gathered "
    "the light into a narrow beam visible many miles out to sea. Each light was given its own pattern of flashes "
    "so that sailors could tell one station from another. Keepers lived at the station with their families, "
    "recording the weather, cleaning the lenses and sounding a fog signal when visibility fell. Most lights today "
    "are automatic and maintained by small teams who visit them a few times a year, and many old towers have "
    "become museums."
)


LEAD_IN_HELP = (
    "text every chunk but a prompt's first is cached after: 'none', 'default' (DEFAULT_LEAD_IN) or a text file"
)


def resolve_lead_in(value: str) -> str | None:
    """A command line's --lead-in: 'none' -> None, 'default' -> DEFAULT_LEAD_IN, else the text of that file."""
    if value == "none":
        return None
    if value == "default":
        return DEFAULT_LEAD_IN
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"--lead-in must be 'none', 'default' or a readable text file; {value!r}: {exc}") from None
    if not text:
        raise ConfigError(f"--lead-in file {value!r} is empty; give a passage of ordinary prose, or 'none'")
    return text


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: device and precision, memory budget for chunk KV, prompt assembly."""

    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "float32"  # "float32" for quality and exactness, "bfloat16"/"float16" for speed
    memory_budget_bytes: int = 2 * 1024**3  # in-process chunk KV store, LRU beyond this
    disk_dir: str | None = None  # local disk tier (diskcache) under this folder; None: no disk tier
    disk_budget_bytes: int = 20 * 1024**3
    redis_url: str | None = None  # shared Redis tier, e.g. "redis://127.0.0.1:6379/0"; None: no Redis tier
    redis_budget_bytes: int = 8 * 1024**3
    chunk_separator: str = "\n\n"  # appended to each chunk's text before tokenizing (part of its cache key)
    # Text that every chunk but a prompt's first is also cached after (between the prefix and the chunk), e.g.
    # DEFAULT_LEAD_IN: see docs/configuration.md. None: each chunk is cached right after the prefix only.
    lead_in: str | None = None
    max_prompt_tokens: int | None = None  # None: the model's context length
    pipelined_loading: bool = True  # fetch layer l+1's chunk KV (disk, Redis) while layer l is being fused
    blend: BlendConfig = field(default_factory=BlendConfig)
    # Signs disk/Redis entries and refuses unsigned or forged ones (give every worker the same key); None: off
    store_hmac_key: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype_name(self.dtype))
        dev = str(self.device)
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("memory_budget_bytes", "disk_budget_bytes", "redis_budget_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.redis_url is not None and not str(self.redis_url).startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"max_prompt_tokens must be >= 1 or None, got {self.max_prompt_tokens}")
        if self.lead_in is not None and (not isinstance(self.lead_in, str) or not self.lead_in.strip()):
            raise ConfigError(
                f"lead_in must be None (no lead-in) or a non-blank text such as DEFAULT_LEAD_IN, got {self.lead_in!r}"
            )
        if not isinstance(self.blend, BlendConfig):
            raise ConfigError(f"blend must be a BlendConfig, got {type(self.blend).__name__}")
        if self.store_hmac_key is not None and (
            not isinstance(self.store_hmac_key, (bytes, str)) or len(self.store_hmac_key) < 16
        ):
            raise ConfigError("store_hmac_key must be None or a secret of at least 16 bytes (str or bytes)")
        self._check_codecs()

    # How chunk KV is stored (docs/configuration.md, "Stored KV: codecs and bytes per token"): one of "native"
    # (the compute dtype, exact), "fp16", "bf16", "int8" (keys per channel, values per token), "int4" (the same
    # in groups of 32). An entry written with another codec is a miss and is recomputed.
    kv_codec: str = "native"  # the disk and Redis tiers
    memory_codec: str = "native"  # the memory tier (encoded entries are decoded layer by layer when read)

    def _check_codecs(self) -> None:
        from .store.codec import CODECS

        for name in ("kv_codec", "memory_codec"):
            if getattr(self, name) not in CODECS:
                raise ConfigError(f"{name} must be one of {sorted(CODECS)}, got {getattr(self, name)!r}")


# The command lines' --lead-in default: the spelling of EngineConfig's own default.
LEAD_IN_DEFAULT = "default" if EngineConfig.lead_in == DEFAULT_LEAD_IN else "none"
