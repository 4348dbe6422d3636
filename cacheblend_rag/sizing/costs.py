"""What a request costs on one machine: a cost model of time to first token, fitted from timed requests.

Three curves, each `c0 + c1 * n + c2 * n**2` seconds for n tokens (the square term is attention's):
- `full`: a full prefill of an n-token prompt (what a request costs without cached KV, and the reference a
  speed-up is measured against);
- `blend`: a blended prefill of an n-token prompt whose chunks are all stored (loading included);
- `chunk`: prefilling one missing chunk of n tokens after the shared prefix and storing it (what the miss policy
  adds to a blend for each chunk it finds missing).
`measure_costs` times them with a real engine; a `CostModel` is kept as JSON (`save` / `load`) so that sizing a store
(`plan_store`) needs no model run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..engine import CacheBlendEngine

COST_FORMAT = "cacheblend-rag/cost-model/1"
MAX_COST_BYTES = 1 << 20


@dataclass(frozen=True)
class Curve:
    """Seconds as a function of tokens: c0 + c1 * n + c2 * n**2, every coefficient >= 0."""

    c0: float
    c1: float
    c2: float = 0.0

    def __post_init__(self) -> None:
        for name in ("c0", "c1", "c2"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not 0 <= value < float("inf"):
                raise ConfigError(f"cost curve coefficient {name} must be a finite number >= 0, got {value!r}")

    def __call__(self, tokens: float) -> float:
        return self.c0 + self.c1 * tokens + self.c2 * tokens * tokens

    @classmethod
    def fit(cls, tokens: Sequence[float], seconds: Sequence[float]) -> Curve:
        """Least squares over (tokens, seconds); a coefficient that comes out negative is dropped and the rest refit
        (time never falls with more tokens). One distinct length gives a line through the origin."""
        import numpy as np

        if len(tokens) != len(seconds) or not tokens:
            raise ConfigError(f"a cost curve needs as many timings as lengths (>= 1), got {len(tokens)} and "
                              f"{len(seconds)}")  # fmt: skip
        x, y = np.asarray(tokens, dtype=float), np.asarray(seconds, dtype=float)
        terms = [0, 1, 2] if len(set(tokens)) >= 3 else [1]
        while True:
            design = np.stack([x**p for p in terms], axis=1)
            coef = np.linalg.lstsq(design, y, rcond=None)[0]
            if (coef >= 0).all() or len(terms) == 1:
                break
            terms = [p for p, c in zip(terms, coef, strict=True) if c >= 0] or [1]
        out = dict.fromkeys((0, 1, 2), 0.0)
        out.update({p: max(0.0, float(c)) for p, c in zip(terms, coef, strict=True)})
        return cls(out[0], out[1], out[2])


@dataclass(frozen=True)
class CostModel:
    """Time to first token of the three kinds of prefill a request runs, on one machine, model and dtype."""

    full: Curve
    blend: Curve
    chunk: Curve
    model: str = ""  # model name or path, as given when measured
    dtype: str = ""
    machine: str = ""  # the CPU's model name and matrix-instruction flags (`machine_name`)
    samples: dict[str, int] = field(default_factory=dict)  # timings behind each curve

    def to_json(self) -> dict[str, Any]:
        return {"format": COST_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        return cls(
            full=Curve(**data["full"]), blend=Curve(**data["blend"]), chunk=Curve(**data["chunk"]),
            model=str(data.get("model", "")), dtype=str(data.get("dtype", "")),
            machine=str(data.get("machine", "")), samples={str(k): int(v) for k, v in data.get("samples", {}).items()},
        )  # fmt: skip

    def save(self, path: str | os.PathLike[str]) -> None:
        from ..controller.profile_io import write_profile_json

        write_profile_json(path, self.to_json(), indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a cost model written by `save`; ConfigError naming the path for anything else."""
        from ..controller.profile_io import load_profile_json

        redo = "write one with cacheblend_rag.sizing.measure_costs(engine, prompts).save(path)"
        return load_profile_json(path, "a cost model", COST_FORMAT, MAX_COST_BYTES, redo, cls.from_json)


def machine_name() -> str:
    """The CPU's model name and its matrix-instruction flags (AMX, AVX-512 BF16/VNNI), as timing tables name it."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and name == "unknown CPU":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    shown = sorted(f for f in flags if f.startswith("amx") or f in ("avx512f", "avx512_bf16", "avx512_vnni"))
    return f"{name} ({' '.join(shown) or 'no AVX-512/AMX'}), {os.cpu_count()} cores"


def _ttft(engine: CacheBlendEngine, chunks: Sequence[str], question: str, mode: str) -> tuple[float, Any]:
    result = engine.generate(list(chunks), question, mode=mode, max_new_tokens=1)
    engine.wait_for_fills()  # what a cold request leaves to store is stored before the next timing
    return result.metrics.ttft_s, result.metrics


def measure_costs(
    engine: CacheBlendEngine, prompts: Sequence[tuple[Sequence[str], str]], *, repeats: int = 1, model: str = ""
) -> CostModel:
    """Time `prompts` ((chunks, question) pairs, e.g. a sample of real retrievals) on `engine` and fit a `CostModel`.

    Each prompt runs as a full prefill (`full`); then each of its chunks is prefilled alone and stored (`chunk`,
    `precompute` of that chunk timed); then the prompt is blended with every chunk stored (`blend`). The store is
    cleared between prompts. About three full prefills' time per prompt and repeat.
    """
    if not prompts:
        raise ConfigError("measure_costs needs at least one (chunks, question) prompt")
    full: list[tuple[int, float]] = []
    blend: list[tuple[int, float]] = []
    chunk: list[tuple[int, float]] = []
    engine.clear_store()
    _ttft(engine, prompts[0][0], prompts[0][1], "full")  # warm-up: first calls allocate and compile
    for _ in range(repeats):
        for chunks, question in prompts:
            seconds, metrics = _ttft(engine, chunks, question, "full")
            full.append((metrics.prompt_tokens, seconds))
            engine.clear_store()
            for text in chunks:
                ids = engine.tokenizer.encode(text + engine.config.chunk_separator, add_special_tokens=False)
                t = time.perf_counter()
                engine.precompute([text], context=None)
                chunk.append((len(ids), time.perf_counter() - t))
            seconds, metrics = _ttft(engine, chunks, question, "blend")
            blend.append((metrics.prompt_tokens, seconds))
            engine.clear_store()
    fit = {name: Curve.fit([n for n, _ in pts], [s for _, s in pts]) for name, pts in
           (("full", full), ("blend", blend), ("chunk", chunk))}  # fmt: skip
    return CostModel(**fit, model=model, dtype=engine.config.dtype, machine=machine_name(),
                     samples={"full": len(full), "blend": len(blend), "chunk": len(chunk)})  # fmt: skip


# The default preset (Qwen2.5-Coder-0.5B-Instruct) in float32 on one thread of a 2-core AMD EPYC shared with other
# jobs, measured by `benchmarks/traffic.py real` (docs/benchmarks.md, "Traffic"): what `plan` assumes when it is given
# no cost model. The speed-ups it predicts depend on the ratios of these curves more than on the machine.
REFERENCE_COSTS = CostModel(
    full=Curve(0.0, 0.01200693112969278),
    blend=Curve(1.356511768704736, 0.0010388268254983306, 4.172381392135621e-07),
    chunk=Curve(0.0, 0.012219333259699641),
    model="qwen2.5-coder-0.5b-instruct",
    dtype="float32",
    machine="AMD EPYC (avx512_bf16 avx512_vnni avx512f), 1 of 2 cores",
    samples={"full": 4, "blend": 4, "chunk": 20},
)
