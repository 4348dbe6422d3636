"""`BlendConfig`: the algorithm's hyperparameters (paper §4.3), the selection rules by name, and the prefill modes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from ..errors import ConfigError
from .checks import check_ratio


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
# tables of docs/benchmarks.md; the rules that lost are described in research/README.md.
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
    # "attention" only: the share of the layers its first pass runs (rounded up, at least one); below 1 it reads the
    # question's attention on the first layers only, and without the first pass's logits it cannot have a guard
    probe_depth: float = 1.0

    def __post_init__(self) -> None:
        check_ratio("recompute_ratio", self.recompute_ratio)
        object.__setattr__(self, "recompute_ratio", float(self.recompute_ratio))
        if self.rule not in RULES:
            raise ConfigError(f"rule must be one of {', '.join(RULE_NAMES)}, got {self.rule!r}")
        check_ratio("probe_depth", self.probe_depth)
        object.__setattr__(self, "probe_depth", float(self.probe_depth))
        if self.probe_depth == 0.0:
            raise ConfigError("probe_depth must be above 0 (a share of the layers, 1.0 for all of them)")
        if self.probe_depth < 1.0 and self.rule != "attention":
            raise ConfigError(f"probe_depth is the 'attention' rule's; rule {self.rule!r} runs no first pass")

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

    def probe_layers(self, num_layers: int) -> int:
        """How many layers the first pass runs in a model of `num_layers` layers."""
        return max(1, min(num_layers, math.ceil(self.probe_depth * num_layers - 1e-9)))

    @property
    def full_probe(self) -> bool:
        """Whether the first pass runs every layer (and so gives full reuse's logits, which the guard reads)."""
        return self.probe_depth >= 1.0

    def schedule(self) -> tuple[float, ...]:
        """Kept share of the chunk tokens after each check layer, ending at the recompute ratio."""
        factors = _CHECKS[self.rule][2] if self.rule in _CHECKS else ()
        return tuple(min(1.0, f * self.recompute_ratio) for f in factors)

    def with_ratio(self, recompute_ratio: float) -> BlendConfig:
        """The same rule at another ratio."""
        return replace(self, recompute_ratio=recompute_ratio)

    @property
    def name(self) -> str:
        """`rule@ratio`, the spelling the benchmarks and metrics use, e.g. "attention@0.15"; a shallow first pass
        adds its depth: "attention:0.25@0.15" (what `blend_rule` reads back)."""
        depth = "" if self.full_probe else f":{self.probe_depth:g}"
        return f"{self.rule}{depth}@{self.recompute_ratio:g}"


def blend_rule(name: str, recompute_ratio: float = 0.15) -> BlendConfig:
    """The named selection rule at ratio r, e.g. `blend_rule("paper", 0.15)`. Names: see `RULE_NAMES`;
    "attention:D" is "attention" with a first pass over the share D of the layers."""
    rule, colon, depth = name.partition(":")
    if rule not in RULES:
        raise ConfigError(f"unknown blend rule {name!r}; choose one of {', '.join(RULE_NAMES)}")
    if not colon:
        return BlendConfig(recompute_ratio=recompute_ratio, rule=rule)
    try:
        share = float(depth)
    except ValueError:
        raise ConfigError(f"{rule}:D needs a share D of the layers in (0, 1], got {name!r}") from None
    return BlendConfig(recompute_ratio=recompute_ratio, rule=rule, probe_depth=share)
