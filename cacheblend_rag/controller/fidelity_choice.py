"""A choice of recompute setting for a fidelity target: the setting (a fixed ratio, or a guard over a base ratio),
its figures with 95% intervals, whether they meet the target, and the engine settings it gives.
`FidelityProfile.choose` makes one (`fidelity_profile.py`).

A choice is judged on what to expect on a new question, not on the sample's own shares. Choosing the cheapest of
many settings by k/n picks the one that was luckiest on the sample: replayed on the benchmark's questions, a choice
made that way for 0.95 gave 0.91-0.96 on the questions it was not chosen on. So an agreement share of k in n
counts as (k + 1) / (n + 2), the chance that the next question agrees when nothing else is known (Laplace's rule
of succession): 29 of 30 is 0.94, 30 of 30 is 0.97, 6 of 6 is 0.88. Full recompute is exact by construction and
counts as 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import BlendConfig, EngineConfig, Guard
from ..errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """A blend at `ratio` of the profile's rule, with a guard or without."""

    ratio: float
    guard: Guard | None = None

    @property
    def name(self) -> str:
        if self.guard is None:
            return "full (r=1)" if self.ratio >= 1.0 else f"r={self.ratio:g}"
        return f"guard {self.guard.describe()} (from r={self.ratio:g})"


@dataclass(frozen=True)
class Estimate:
    """A setting's figures over a set of questions: means with 95% bootstrap intervals."""

    setting: Setting
    n: int  # questions
    first_token: float  # share of questions whose first token matches full recompute's
    first_token_ci: tuple[float, float]
    top1: float  # mean share of answer tokens ranked first by both
    top1_ci: tuple[float, float]
    kl_mean: float  # mean KL(full || setting) over the answer, nats
    kl_ci: tuple[float, float]
    compute_share: float  # mean token-layers computed / a full prefill's
    escalated: float  # share of questions the guard escalated

    @property
    def exact(self) -> bool:
        """Full recompute: its figures are those of full recompute on every question, not only on the sample."""
        return self.setting.guard is None and self.setting.ratio >= 1.0

    def expected(self, share: float) -> float:
        """The agreement to expect on a new question for a `share` measured on this estimate's n questions:
        (n * share + 1) / (n + 2); `share` itself for full recompute."""
        return share if self.exact else (self.n * share + 1.0) / (self.n + 2.0)


@dataclass(frozen=True)
class Targets:
    """What a choice must meet; None: no target on that figure."""

    first_token: float | None = 0.95
    top1: float | None = None
    max_kl: float | None = None  # the highest acceptable mean KL, nats

    def __post_init__(self) -> None:
        for name in ("first_token", "top1"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"target {name} must be a share in [0, 1], got {value!r}")
        if self.max_kl is not None and not self.max_kl >= 0:
            raise ConfigError(f"target max_kl must be a number >= 0 (nats), got {self.max_kl!r}")

    def shortfall(self, e: Estimate, *, expected: bool = False) -> float:
        """How far `e` is from the targets (0: met): agreement shares and nats summed. With `expected`, the
        agreement shares are those to expect on a new question (`Estimate.expected`), as a choice is made;
        without, those measured, as a held-back check reads them."""
        first, top1 = (e.expected(e.first_token), e.expected(e.top1)) if expected else (e.first_token, e.top1)
        return (
            max(0.0, (self.first_token or 0.0) - first)
            + max(0.0, (self.top1 or 0.0) - top1)
            + (max(0.0, e.kl_mean - self.max_kl) if self.max_kl is not None else 0.0)
        )

    def __str__(self) -> str:
        parts = [f"first-token >= {self.first_token:g}" if self.first_token is not None else ""]
        parts += [f"top-1 >= {self.top1:g}" if self.top1 is not None else ""]
        parts += [f"mean KL <= {self.max_kl:g}" if self.max_kl is not None else ""]
        return ", ".join(p for p in parts if p) or "no target"


@dataclass(frozen=True)
class FidelityChoice:
    """The chosen setting, its expected figures, and whether they meet the targets (else it is the closest)."""

    estimate: Estimate
    targets: Targets
    met: bool
    rule: str

    @property
    def blend(self) -> BlendConfig:
        return BlendConfig(recompute_ratio=self.estimate.setting.ratio, rule=self.rule)

    @property
    def guard(self) -> Guard | None:
        return self.estimate.setting.guard

    @property
    def min_ratio(self) -> float:
        """The quality floor to give a `LoadingController`: r = max(this, the ratio loading time hides)."""
        return self.estimate.setting.ratio

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """`base` with the chosen blend ratio (the profile's rule) and guard."""
        return replace(base, blend=self.blend, guard=self.guard)

    def describe(self) -> str:
        e = self.estimate
        verdict = "meets" if self.met else "does NOT meet (closest setting)"
        return (
            f"{e.setting.name} {verdict} the target ({self.targets}) on {e.n} questions: first-token "
            f"{_ci(e.first_token, e.first_token_ci)} ({e.expected(e.first_token):.3f} expected on a new question), "
            f"top-1 {_ci(e.top1, e.top1_ci)} ({e.expected(e.top1):.3f} expected), mean KL "
            f"{_ci(e.kl_mean, e.kl_ci)}, compute share {e.compute_share:.2f}"
        )


@dataclass(frozen=True)
class HeldBackCheck:
    """The choice made on the first questions of a sample, and its figures on the questions held back."""

    choice: FidelityChoice
    held_back: Estimate

    @property
    def met(self) -> bool:
        return self.choice.targets.shortfall(self.held_back) == 0.0

    def describe(self) -> str:
        e = self.held_back
        return (
            f"chosen on {self.choice.estimate.n} questions, checked on {e.n} held back: {e.setting.name} "
            f"{'meets' if self.met else 'does NOT meet'} the target there (first-token "
            f"{_ci(e.first_token, e.first_token_ci)}, top-1 {_ci(e.top1, e.top1_ci)}, mean KL "
            f"{_ci(e.kl_mean, e.kl_ci)}, compute share {e.compute_share:.2f})"
        )


def _ci(value: float, ci: tuple[float, float]) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
