"""Settings of the blend (fusion) step and of the engine, as frozen dataclasses validated on creation.

`BlendConfig` holds the algorithm's hyperparameters (paper §4.3); `EngineConfig` holds where and how the model
runs and how much chunk KV stays in memory. Per-request choices (mode, ratio override, sampling) are arguments
of the engine's calls, never module state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from .checks import check_count, check_ratio, check_real, mask_url
from .errors import ConfigError
from .guard import Guard  # the guard's policy lives with its signals and loop; re-exported here


class PrefillMode(str, Enum):
    """How the prompt's KV cache is built before decoding."""

    FULL = "full"  # recompute every token (the reference)
    PREFIX = "prefix"  # reuse the shared prefix and the first chunk (what prefix caching can reuse)
    REUSE = "reuse"  # reuse every chunk's cached KV at its real position, recompute nothing (PromptCache)
    BLEND = "blend"  # CacheBlend: reuse every chunk and recompute the chunk tokens its rule picks

    @classmethod
    def parse(cls, value: str | PrefillMode) -> PrefillMode:
        if isinstance(value, PrefillMode):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"mode must be one of {names}, got {value!r}") from None


# The selection rules, by name: which reused chunk tokens a blend recomputes. Each earns its place in the fidelity
# tables of docs/benchmarks.md; the rules that lost are described in docs/research.md.
RULES: dict[str, str] = {
    # the default: the question's attention over the chunk tokens in a first pass that reuses every chunk's KV;
    # the top r of chunk tokens are then recomputed on every layer (no check layers)
    "attention": "the chunk tokens the question attends to most, read in a full-reuse first pass",
    # CacheBlend's paper and research code: value deviation on layer 1, one top-k (the reference the paper is
    # judged by)
    "paper": "the tokens whose values deviate most from a fresh prefill on layer 1 (CacheBlend's own rule)",
    # the paper's gradual filtering (§4.3): key deviation on layers 1-3, the candidates shrinking to r
    "gradual": "key deviation filtered over layers 1-3 (paper §4.3); closest to full on multi-document summaries",
    # EPIC: the first tokens of every chunk, where a chunk cached on its own holds most of its error
    "epic": "the first tokens of every chunk, in proportion to its length; no deviation check (cheapest)",
}
RULE_NAMES = tuple(RULES)

# The deviation rules: check layers, which deviation ranks tokens, and how many candidates each check layer
# keeps, as a multiple of r (gradual filtering: 1.5r, 1.25r, then r).
_CHECKS: dict[str, tuple[tuple[int, ...], str, tuple[float, ...]]] = {
    "paper": ((1,), "value", (1.0,)),
    "gradual": ((1, 2, 3), "key", (1.5, 1.25, 1.0)),
}


DECODE_WEIGHTS = ("native", "int8")
MISS_POLICIES = ("auto", "blend", "full")
CAPTURE_POLICIES = ("exact", "all")
# The codecs `kv_codec` and `memory_codec` may name: those of `store.codec.CODECS` (a test keeps the two equal),
# listed here so that the settings import nothing of the store.
CODEC_NAMES = ("native", "fp16", "bf16", "int8", "int4")


# Neighbours a chunk's KV is prefilled after where the corpus is known (contextual chunk KV). 0: grouped precompute
# took its place as the default (docs/benchmarks.md, "Contextual chunk KV"); 2 is the setting measured.
DEFAULT_CONTEXT_NEIGHBOURS = 0
# Grouped precompute's group size, about a RAG prompt's chunks (6 of 512 tokens). On by default: on the paired
# fidelity run it brought every ratio closer to full recompute (docs/benchmarks.md, "Grouped precompute").
DEFAULT_PRECOMPUTE_GROUPS = 3072


@dataclass(frozen=True)
class BlendConfig:
    """Selective KV recompute: how many reused chunk tokens a blend recomputes, and which (the rule).

    The budget is `recompute_ratio` of the request's chunk tokens; the question and the chat template's tail have
    no cached KV and are always computed. Rules (see `RULES`): "attention" (default), "paper", "gradual", "epic".
    """

    # The default, "attention" at r = 0.15, was chosen with the fidelity benchmark (docs/benchmarks.md): closer to
    # full recompute than the deviation rules on MuSiQue, 2WikiMQA and SAMSum, and faster (no check layers).
    recompute_ratio: float = 0.15  # r: share of the chunk tokens recomputed
    rule: str = "attention"  # which chunk tokens: one of RULE_NAMES

    def __post_init__(self) -> None:
        check_ratio("recompute_ratio", self.recompute_ratio)
        object.__setattr__(self, "recompute_ratio", float(self.recompute_ratio))
        if self.rule not in RULES:
            raise ConfigError(f"rule must be one of {', '.join(RULE_NAMES)}, got {self.rule!r}")

    @property
    def check_layers(self) -> tuple[int, ...]:
        """Layers where a deviation rule measures fresh vs cached KV (every chunk token is recomputed up to the
        last of them); () for the other rules."""
        return _CHECKS[self.rule][0] if self.rule in _CHECKS else ()

    @property
    def deviation(self) -> str:
        """Which fresh-vs-cached difference a deviation rule ranks by: "key" or "value"."""
        return _CHECKS[self.rule][1] if self.rule in _CHECKS else "key"

    @property
    def uses_check_layers(self) -> bool:
        """Whether this rule measures deviations on check layers."""
        return self.rule in _CHECKS

    @property
    def uses_attention_pass(self) -> bool:
        """Whether this rule first runs a full-reuse pass to read the question's attention."""
        return self.rule == "attention"

    def schedule(self) -> tuple[float, ...]:
        """Kept share of the chunk tokens after each check layer, ending at the recompute ratio."""
        factors = _CHECKS[self.rule][2] if self.rule in _CHECKS else ()
        return tuple(min(1.0, f * self.recompute_ratio) for f in factors)

    def with_ratio(self, recompute_ratio: float) -> BlendConfig:
        """The same rule at another ratio."""
        return replace(self, recompute_ratio=recompute_ratio)

    @property
    def name(self) -> str:
        """`rule@ratio`, the spelling the benchmarks and metrics use, e.g. "attention@0.15"."""
        return f"{self.rule}@{self.recompute_ratio:g}"


def blend_rule(name: str, recompute_ratio: float = 0.15) -> BlendConfig:
    """The named selection rule at ratio r, e.g. `blend_rule("paper", 0.15)`. Names: see `RULE_NAMES`."""
    if name not in RULES:
        raise ConfigError(f"unknown blend rule {name!r}; choose one of {', '.join(RULE_NAMES)}")
    return BlendConfig(recompute_ratio=recompute_ratio, rule=name)


_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def normalize_dtype_name(dtype: object, device: object = "cpu") -> str:
    """'bf16', torch.bfloat16, ... -> 'bfloat16'; anything else is a ConfigError listing the choices.

    "auto" picks for `device`: bfloat16 on a GPU and on a CPU with bf16 instructions (AMX or AVX-512-BF16), where it
    is the fast precision; float32 on other CPUs, where bf16 runs several times slower (`cpu.py`)."""
    name = str(dtype).removeprefix("torch.").lower()
    if name == "auto":
        from .cpu import cpu_has_bf16  # torch-free

        return "bfloat16" if str(device).startswith("cuda") or cpu_has_bf16() else "float32"
    if name not in _DTYPES:
        raise ConfigError(
            f"dtype must be one of float32, bfloat16, float16 (or fp32/bf16/fp16), or auto, got {dtype!r}"
        )
    return _DTYPES[name]


def torch_dtype(dtype: object, device: object = "cpu") -> Any:
    """'bf16', 'float32', torch.float16, 'auto' (for `device`), ... -> the torch.dtype; anything else is a
    ConfigError."""
    import torch

    return getattr(torch, normalize_dtype_name(dtype, device))


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: device and precision, memory budget for chunk KV, prompt assembly."""

    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "float32"  # "float32" for exactness, "bfloat16"/"float16" for speed; "auto": bf16 where it is fast
    memory_budget_bytes: int = 2 * 1024**3  # in-process chunk KV store, LRU beyond this
    disk_dir: str | None = None  # local disk tier (diskcache) under this folder; None: no disk tier
    disk_budget_bytes: int = 20 * 1024**3
    redis_url: str | None = None  # shared Redis tier, e.g. "redis://127.0.0.1:6379/0"; None: no Redis tier
    redis_budget_bytes: int = 8 * 1024**3
    chunk_separator: str = "\n\n"  # appended to each chunk's text before tokenizing (part of its cache key)
    max_prompt_tokens: int | None = None  # None: the model's context length
    pipelined_loading: bool = True  # fetch layer l+1's chunk KV (disk, Redis) while layer l is being fused
    # A request with chunks not stored yet: "blend" prefills each missing chunk, stores it and blends; "full" answers
    # with a full prefill and stores the missing chunks after the answer; "auto" does the latter only when the
    # missing chunks would cost more to prefill than the whole prompt (docs/benchmarks.md, "Cold requests").
    miss_policy: str = "auto"
    # The fidelity guard of the "attention" rule (`guard.Guard`): escalates a request whose blend looks risky
    # to a larger recompute budget. None: off.
    guard: Guard | None = None
    # How chunk KV is stored (docs/configuration.md, "Stored KV: codecs and bytes per token"): one of "native"
    # (the compute dtype, exact), "fp16", "bf16", "int8" (keys per channel, values per token), "int4" (the same
    # in groups of 32). An entry written with another codec is a miss and is recomputed.
    kv_codec: str = "int8"  # the disk and Redis tiers (docs/configuration.md: int8 is within noise of exact)
    memory_codec: str = "native"  # the memory tier (encoded entries are decoded layer by layer when read)
    blend: BlendConfig = field(default_factory=BlendConfig)
    # Contextual chunk KV (docs/how-it-works.md): where the engine is given the corpus (`precompute`, an index), each
    # chunk's KV is prefilled after its n most similar other chunks, keeping only its own KV. 0: off.
    context_neighbours: int = DEFAULT_CONTEXT_NEIGHBOURS
    # Grouped precompute (docs/configuration.md): `precompute(chunks)` lays the corpus out in groups of similar chunks
    # of up to this many tokens and stores each chunk's KV from one full prefill of its group (a captured entry, read
    # under capture="all") beside its isolated entry. 0: off. None: 3072, or 0 with `context_neighbours` or
    # capture="exact" (`group_tokens`: the setting in force).
    precompute_groups: int | None = None
    # What a full prefill the engine runs by itself (a cold request under the miss policy, a guard escalation to
    # r = 1) stores of its chunks' KV, which it holds for free: "exact" stores the chunks whose KV there is their
    # entry (the one right after the prefix) and prefills the others after the answer; "all" also stores every
    # later chunk as that prompt computed it, after the chunks before it there, under a key of its own, which a
    # chunk after the first of a prompt reads before its own entry (docs/configuration.md, "Captured chunk KV").
    # None: "all", or "exact" with `context_neighbours` (which builds the entries after neighbours instead). A
    # full prefill asked for with mode="full" stores as "exact" does.
    capture: str | None = None
    # An attention temperature on chunk KV computed out of the prompt's context (APE, ICLR'25): the keys of every
    # chunk whose entry is not exact at its place (all but the first, for isolated entries) are divided by this on
    # layers 1.., so every later query's attention to them is that much flatter. 1: off. Recomputed tokens get
    # fresh keys; r = 1 still equals a full prefill (docs/research.md, section 14: a gain for full KV reuse).
    stale_key_temperature: float = 1.0
    # How many requests decode together: each decode step reads the weights once for all of them. Requests past it
    # wait in arrival order. 1 serves one request at a time. Memory: each decoding request holds its prompt's KV
    # and room for its answer (docs/configuration.md, "Serving many requests").
    max_batch_size: int = 8
    # The most KV positions the requests decoding together may hold: each holds its prompt's tokens and room for
    # its answer (max_new_tokens). A request that would pass it waits for room, in arrival order; one that could
    # never fit is refused when it is made (PromptError). None: only max_batch_size bounds the batch.
    max_batch_tokens: int | None = None
    # The weights decode steps read: "native" (the model's, exact) or "int8" (CPU only: per-channel int8 copies of
    # the linear layers, a quarter of the bytes; the prefill and the first token stay exact, later tokens may differ:
    # docs/benchmarks.md, "Decoding speed").
    decode_weights: str = "native"
    # While a prompt is prefilled, the requests already decoding get a step between two of its layers once their
    # last step is this many seconds old, so their answers keep streaming through a long prefill (the new request's
    # first token comes later by the steps it hosts; docs/configuration.md, "Serving many requests"). None: a
    # prefill runs to its end first.
    max_token_gap_s: float | None = None
    # Signs disk/Redis entries and refuses unsigned or forged ones (give every worker the same key); None: off
    store_hmac_key: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype_name(self.dtype, self.device))  # "auto" decided here
        dev = str(self.device)
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("memory_budget_bytes", "disk_budget_bytes", "redis_budget_bytes"):
            check_count(name, getattr(self, name), 0, "a number of bytes, e.g. 2 * 1024**3 for 2 GiB")
        for name in ("disk_dir", "redis_url"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{name} must be a path string or None, got {value!r} ({type(value).__name__})")
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", os.fspath(self.disk_dir))
            if not self.disk_dir:
                raise ConfigError("disk_dir must be a folder path or None (no disk tier), got ''")
        if self.redis_url is not None and not str(self.redis_url).startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"redis_url must start with redis://, rediss:// or unix://, got {mask_url(self.redis_url)!r}"
            )
        check_count("context_neighbours", self.context_neighbours, 0, "a number of chunks (0: no context)")
        if self.precompute_groups is not None:
            check_count("precompute_groups", self.precompute_groups, 0, "tokens per group (0: off), or None")
        if self.precompute_groups and self.context_neighbours:
            raise ConfigError(
                "precompute_groups stores each chunk's KV from its group's prefill, context_neighbours after its "
                "neighbours: choose one (set the other to 0)"
            )
        if self.precompute_groups and self.capture == "exact":
            raise ConfigError(
                "precompute_groups stores captured entries, which requests read only under capture='all' (the "
                "default): leave capture unset, or set precompute_groups=0"
            )
        check_count("max_batch_size", self.max_batch_size, 1, "a number of requests (1: one at a time)")
        if self.max_batch_tokens is not None:
            check_count("max_batch_tokens", self.max_batch_tokens, 1, "a number of KV positions, or None")
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ConfigError(f"decode_weights must be one of {', '.join(DECODE_WEIGHTS)}, got {self.decode_weights!r}")
        if self.decode_weights == "int8" and dev != "cpu":
            raise ConfigError("decode_weights='int8' runs on the CPU's int8 kernels; use 'native' on a GPU")
        check_real("stale_key_temperature", self.stale_key_temperature, lambda t: t > 0, "> 0 (1: off)")
        if self.max_token_gap_s is not None:
            check_real("max_token_gap_s", self.max_token_gap_s, lambda s: s >= 0,
                       "a number of seconds >= 0 (0: a step after every layer) or None (off)")  # fmt: skip
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
        if self.capture is not None and self.capture not in CAPTURE_POLICIES:
            raise ConfigError(f"capture must be one of {', '.join(CAPTURE_POLICIES)} or None, got {self.capture!r}")
        if self.capture == "all" and self.context_neighbours:
            raise ConfigError(
                "capture='all' keeps each chunk's KV from the prompt it came in, context_neighbours "
                "builds it after its neighbours: choose one (capture='exact' goes with both)"
            )
        if self.miss_policy not in MISS_POLICIES:
            raise ConfigError(f"miss_policy must be one of {', '.join(MISS_POLICIES)}, got {self.miss_policy!r}")
        if not isinstance(self.pipelined_loading, bool):
            raise ConfigError(f"pipelined_loading must be True or False, got {self.pipelined_loading!r}")
        if self.store_hmac_key is not None and (
            not isinstance(self.store_hmac_key, (bytes, str)) or len(self.store_hmac_key) < 16
        ):
            raise ConfigError("store_hmac_key must be None or a secret of at least 16 bytes (str or bytes)")
        self._check_codecs()

    def __repr__(self) -> str:  # the dataclass's, with a password in redis_url masked and the HMAC key left out
        shown = (
            f"{f.name}={mask_url(self.redis_url)!r}" if f.name == "redis_url" and self.redis_url else
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self) if f.repr
        )  # fmt: skip
        return f"{type(self).__name__}({', '.join(shown)})"

    @property
    def capture_policy(self) -> str:
        """The capture policy in force: `capture`, or for None "all" ("exact" with `context_neighbours`)."""
        if self.capture is not None:
            return self.capture
        return "exact" if self.context_neighbours else "all"

    @property
    def group_tokens(self) -> int:
        """Grouped precompute's group size in force (0: off): `precompute_groups`, or for None 3072 where the
        capture policy in force reads grouped (captured) entries, "all"; 0 under "exact" (`context_neighbours`)."""
        if self.precompute_groups is not None:
            return self.precompute_groups
        return DEFAULT_PRECOMPUTE_GROUPS if self.capture_policy == "all" else 0

    def store_options(self) -> dict[str, Any]:
        """The keyword arguments of `store.build_store` that make the tiers this config names."""
        return dict(
            memory_bytes=self.memory_budget_bytes, disk_dir=self.disk_dir, disk_bytes=self.disk_budget_bytes,
            redis_url=self.redis_url, redis_bytes=self.redis_budget_bytes, hmac_key=self.store_hmac_key,
            kv_codec=self.kv_codec, memory_codec=self.memory_codec,
        )  # fmt: skip

    def _check_codecs(self) -> None:
        for name in ("kv_codec", "memory_codec"):
            if getattr(self, name) not in CODEC_NAMES:
                raise ConfigError(f"{name} must be one of {sorted(CODEC_NAMES)}, got {getattr(self, name)!r}")
