"""The methods compared in the paper's §7, each answering one `Case` on a `CacheBlendEngine`.

Scope: how each method turns a case into an answer and a time to first token (TTFT). Every method has a
`warm` step (fill the chunk store, untimed: the paper measures the steady state where chunk KV is already
stored) and a timed `run`.

- `full`, `prefix`, `reuse`, `blend@r`: one request over all chunks with the data set's prompt, in the engine's
  prefill mode of that name; TTFT is the engine's (call -> first token, cache loads included).
- `mapreduce` (LangChain's map_reduce chain): one request per chunk, each chunk the only chunk of its prompt
  (so prefix caching reuses its whole KV), asking for the chunk's relevant sentences (QA) or a short summary;
  then one full-prefill request answers from the non-empty map outputs with the data set's prompt.
  Map requests keep the data set's prefix and put their instruction after the chunk, so every method reads the
  same stored chunk KV (one warm-up per case, not one per method).
- `maprerank` (LangChain's map_rerank chain, QA only): per chunk, a request for an answer and a 0-100
  confidence score (the reply is forced on to "Score:" in a second request, as small models stop after the
  answer); the best-scored answer wins (ties: earliest chunk).

The map-style methods run their calls one after another, as this engine serves one request at a time, so
their TTFT is the wall time from the first map call to the first token of the final answer (for MapRerank:
to the end of the last map call, when the winner is known). `ttft_parallel_s` adds the idealised figure with
all map calls in parallel (slowest map call + reduce TTFT), for comparison with the paper's GPU batches.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from cacheblend_rag.config import RULE_NAMES, blend_rule
from cacheblend_rag.engine.request.prompt import PromptTemplate
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.evaluation.datasets import Case, TaskSpec
from cacheblend_rag.evaluation.scoring import first_line

__all__ = [
    "DEFAULT_METHODS",
    "MapReduce",
    "MapRerank",
    "Method",
    "MethodResult",
    "PrefillMethod",
    "parse_method",
    "parse_methods",
]

DEFAULT_METHODS = "full,prefix,reuse,blend@0.05,blend@0.15,blend@0.30,mapreduce,maprerank"


@dataclass
class MethodResult:
    """What one method produced for one case. `extra` holds method-specific figures for the JSONL record."""

    text: str  # the raw generated text of the final answer
    ttft_s: float
    prompt_tokens: int  # over all the method's requests
    recomputed_tokens: int  # last-layer recomputed tokens over all requests
    extra: dict[str, Any] = field(default_factory=dict)


class Method(Protocol):
    name: str

    def supports(self, spec: TaskSpec) -> bool: ...

    def warm(self, engine: Any, spec: TaskSpec, case: Case) -> None: ...

    def run(self, engine: Any, spec: TaskSpec, case: Case, max_new_tokens: int) -> MethodResult: ...


_METRIC_KEYS = ("compute_share", "chunks_hit", "chunks_missed", "load_s", "compute_s", "decode_s", "generated_tokens")


@dataclass(frozen=True)
class PrefillMethod:
    """One request over all the case's chunks in one of the engine's prefill modes."""

    mode: str  # "full" | "prefix" | "reuse" | "blend"
    recompute_ratio: float | None = None  # blend only
    rule: str | None = None  # blend only: a named selection rule (`blend_rule`); None: the engine's BlendConfig

    def __post_init__(self) -> None:
        if self.mode not in ("full", "prefix", "reuse", "blend"):
            raise ConfigError(f"mode must be full, prefix, reuse or blend, got {self.mode!r}")
        if (self.recompute_ratio is not None) != (self.mode == "blend"):
            raise ConfigError(
                f"recompute_ratio goes with mode 'blend' only, got mode {self.mode!r}, ratio {self.recompute_ratio}"
            )
        if self.recompute_ratio is not None and not 0.0 <= self.recompute_ratio <= 1.0:
            raise ConfigError(f"recompute ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.rule is not None and (self.mode != "blend" or self.rule.partition(":")[0] not in RULE_NAMES):
            raise ConfigError(f"rule goes with mode 'blend' and is one of {', '.join(RULE_NAMES)}; got {self.rule!r}")
        if self.rule is not None:
            blend_rule(self.rule, self.recompute_ratio or 0.0)  # "attention:D": D must be a share of the layers

    @property
    def name(self) -> str:
        if self.recompute_ratio is None:
            return self.mode
        return f"{self.rule or 'blend'}@{self.recompute_ratio:.2f}"

    def request_options(self) -> dict[str, Any]:
        """The prefill options of `CacheBlendEngine.generate` for this method (mode, ratio or pinned rule)."""
        if self.rule is not None:
            return {"mode": self.mode, "blend": blend_rule(self.rule, self.recompute_ratio or 0.0)}
        return {"mode": self.mode, "recompute_ratio": self.recompute_ratio}

    def supports(self, spec: TaskSpec) -> bool:
        return True

    def warm(self, engine: Any, spec: TaskSpec, case: Case) -> None:
        if self.mode != "full":  # full recompute never reads the store; isolated entries, as the tables were measured
            engine.precompute(list(case.chunks), case.question, template=spec.template, context=None)

    def run(self, engine: Any, spec: TaskSpec, case: Case, max_new_tokens: int) -> MethodResult:
        res = engine.generate(
            list(case.chunks),
            case.question,
            **self.request_options(),
            max_new_tokens=max_new_tokens,
            template=spec.template,
        )
        m = res.metrics
        extra = {k: getattr(m, k) for k in _METRIC_KEYS}
        extra["finish_reason"] = res.finish_reason
        return MethodResult(res.text, m.ttft_s, m.prompt_tokens, m.recomputed_tokens, extra)


# -- map-style methods -----------------------------------------------------------------------------------------

# Prompts in the spirit of LangChain's map_reduce / map_rerank chains, worded for small instruction models. Each map
# request keeps the data set's own prefix and puts the map instruction after the chunk, so the chunk's stored KV
# (computed once under that prefix) serves every method, as one chunk store would in a deployed RAG system.
MAP_QA_SUFFIX = (
    "\n\nThe passage above is one of several. Do not answer yet: copy out, word for word, the sentences of this "
    "passage that help answer the question below. If none do, reply with: None\nQuestion: {question}\n"
    "Helpful sentences:"
)
MAP_SUMMARY_SUFFIX = "\n\nWrite a concise summary of the passage above in a few sentences.{question}\n\nSummary:"
RERANK_SUFFIX = (
    "\n\nAnswer the question below from the passage above alone, within 5 words, and say how sure you are "
    "that the passage contains the answer. Reply in exactly two lines:\nAnswer: <the answer>\n"
    "Score: <0 to 100>\nQuestion: {question}"
)
NO_EVIDENCE = "No passage contained relevant information."

_NONE_RE = re.compile(r"^\W*none\b\W*", re.IGNORECASE)


def _strip_none(text: str) -> str:
    """A map output that says "None" (possibly followed by an apology) carries nothing for the reduce step."""
    text = text.strip()
    if _NONE_RE.match(text):
        return ""
    return text


def _map_template(spec: TaskSpec, suffix: str) -> PromptTemplate:
    """The data set's template with another text after the chunks: same prefix, so the same chunk KV entries."""
    return replace(spec.template, question_template=suffix)


def _warm_dataset_prefix(engine: Any, spec: TaskSpec, case: Case) -> None:
    engine.precompute(list(case.chunks), case.question, template=spec.template, context=None)


@dataclass(frozen=True)
class MapReduce:
    """Map each chunk on its own (relevant sentences / summary), then answer from the map outputs."""

    map_max_new_tokens_qa: int = 48
    map_max_new_tokens_summary: int = 96
    name: str = "mapreduce"

    def supports(self, spec: TaskSpec) -> bool:
        return spec.chunks_are_context  # mapping few-shot examples one by one means nothing

    def warm(self, engine: Any, spec: TaskSpec, case: Case) -> None:
        _warm_dataset_prefix(engine, spec, case)

    def run(self, engine: Any, spec: TaskSpec, case: Case, max_new_tokens: int) -> MethodResult:
        if spec.task == "qa":
            template = _map_template(spec, MAP_QA_SUFFIX)
            prefix, suffix = template.render(engine.tokenizer, case.question)
            map_tokens = self.map_max_new_tokens_qa
        else:  # the summary request needs no question: the "{question}" slot stays empty
            prefix, suffix = _map_template(spec, MAP_SUMMARY_SUFFIX).render(engine.tokenizer, "")
            map_tokens = self.map_max_new_tokens_summary
        t0 = time.perf_counter()
        outputs, map_times, prompt_tokens, recomputed, missed = [], [], 0, 0, 0
        for chunk in case.chunks:
            t = time.perf_counter()
            # The chunk is the prompt's only chunk, so prefix caching reuses its whole stored KV.
            res = engine.generate([chunk], prefix=prefix, suffix=suffix, mode="prefix", max_new_tokens=map_tokens)
            map_times.append(time.perf_counter() - t)
            outputs.append(res.text)
            prompt_tokens += res.metrics.prompt_tokens
            recomputed += res.metrics.recomputed_tokens
            missed += res.metrics.chunks_missed
        kept = [o.strip() for o in outputs if _strip_none(o)]
        t_reduce = time.perf_counter()
        final = engine.generate(
            kept or [NO_EVIDENCE], case.question, mode="full", max_new_tokens=max_new_tokens, template=spec.template
        )
        ttft = (t_reduce - t0) + final.metrics.ttft_s
        extra = {
            "map_calls": len(outputs),
            "map_kept": len(kept),
            "map_s": sum(map_times),
            "map_max_s": max(map_times),
            "map_chunks_missed": missed,  # 0 when the warm step did its job
            "reduce_ttft_s": final.metrics.ttft_s,
            "reduce_prompt_tokens": final.metrics.prompt_tokens,
            "ttft_parallel_s": max(map_times) + final.metrics.ttft_s,
            "map_outputs": outputs,
            "finish_reason": final.finish_reason,
        }
        prompt_tokens += final.metrics.prompt_tokens
        recomputed += final.metrics.recomputed_tokens
        return MethodResult(final.text, ttft, prompt_tokens, recomputed, extra)


_ANSWER_RE = re.compile(r"answer\s*[:=]\s*(.*)", re.IGNORECASE)
_SCORE_RE = re.compile(r"score\s*[:=]?\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_rerank_output(text: str) -> tuple[str, float]:
    """-> (answer, score). The answer is what follows "Answer:" up to the line end or "Score"; score -1 if absent.

    The prompt ends with "Answer:", so the text usually starts with the answer itself.
    """
    score_match = _SCORE_RE.search(text)
    score = float(score_match.group(1)) if score_match else -1.0
    body = text[: score_match.start()] if score_match else text
    answer_match = _ANSWER_RE.search(body)
    answer = first_line(answer_match.group(1) if answer_match else body)
    return answer.strip(), score


@dataclass(frozen=True)
class MapRerank:
    """Answer from each chunk alone with a confidence score; the best-scored answer is the result."""

    name: str = "maprerank"

    def supports(self, spec: TaskSpec) -> bool:
        return spec.task == "qa" and spec.chunks_are_context

    def warm(self, engine: Any, spec: TaskSpec, case: Case) -> None:
        _warm_dataset_prefix(engine, spec, case)

    def run(self, engine: Any, spec: TaskSpec, case: Case, max_new_tokens: int) -> MethodResult:
        prefix, suffix = _map_template(spec, RERANK_SUFFIX).render(engine.tokenizer, case.question)
        suffix += "Answer:"  # start the assistant's reply in the asked-for form
        t0 = time.perf_counter()
        candidates: list[tuple[str, float]] = []
        map_times, prompt_tokens, recomputed, missed, raw = [], 0, 0, 0, []
        for chunk in case.chunks:
            t = time.perf_counter()
            # Two requests per chunk, both reusing the chunk's stored KV: the answer line, then the reply forced
            # on to "Score:". Small models stop after the answer when left alone, so the score must be asked for.
            ans = engine.generate(
                [chunk], prefix=prefix, suffix=suffix, mode="prefix", max_new_tokens=max_new_tokens, stop="\n"
            )
            line = ans.text.split("\n", 1)[0]
            score = engine.generate(
                [chunk], prefix=prefix, suffix=f"{suffix}{line}\nScore:", mode="prefix", max_new_tokens=4
            )
            map_times.append(time.perf_counter() - t)
            text = f"{line}\nScore:{score.text}"
            raw.append(text)
            candidates.append(parse_rerank_output(text))
            for res in (ans, score):
                prompt_tokens += res.metrics.prompt_tokens
                recomputed += res.metrics.recomputed_tokens
                missed += res.metrics.chunks_missed
        # The answer exists once every chunk has been scored: that moment is this method's first token.
        ttft = time.perf_counter() - t0
        best = max(range(len(candidates)), key=lambda i: (candidates[i][1], -i))
        extra = {
            "map_calls": len(candidates),
            "map_s": sum(map_times),
            "map_max_s": max(map_times),
            "map_chunks_missed": missed,
            "ttft_parallel_s": max(map_times),
            "scores": [s for _, s in candidates],
            "chosen_chunk": best,
            "map_outputs": raw,
            "unscored": sum(s < 0 for _, s in candidates),
        }
        return MethodResult(candidates[best][0], ttft, prompt_tokens, recomputed, extra)


# -- names -----------------------------------------------------------------------------------------------------


def parse_method(name: str) -> Method:
    """ "full" | "prefix" | "reuse" | "blend" (r = 0.15) | "blend@R" (the engine's rule) | "RULE@R" (a named rule,
    e.g. "gradual@0.15": see `RULE_NAMES`; "attention:0.25@0.15" has a first pass over a quarter of the layers) |
    "mapreduce" | "maprerank"."""
    key = name.strip().lower()
    if key in ("full", "prefix", "reuse"):
        return PrefillMethod(key)
    if key == "blend":
        return PrefillMethod("blend", 0.15)
    head, at, tail = key.partition("@")
    if at and (head == "blend" or head.partition(":")[0] in RULE_NAMES):
        try:
            ratio = float(tail)
        except ValueError:
            raise ConfigError(f"{head}@R needs a number R in [0, 1], got {name!r}") from None
        return PrefillMethod("blend", ratio, None if head == "blend" else head)
    if key in ("mapreduce", "map_reduce", "map-reduce"):
        return MapReduce()
    if key in ("maprerank", "map_rerank", "map-rerank", "rerank"):
        return MapRerank()
    raise ConfigError(
        f"unknown method {name!r}; choose from full, prefix, reuse, blend@R (R in [0, 1]), RULE@R (RULE one of "
        f"{', '.join(RULE_NAMES)}), mapreduce, maprerank"
    )


def parse_methods(names: str | Sequence[str]) -> list[Method]:
    """Comma-separated names (or a list) -> methods, duplicates dropped, order kept."""
    items = names.split(",") if isinstance(names, str) else list(names)
    methods: dict[str, Method] = {}
    for item in items:
        if item.strip():
            m = parse_method(item)
            methods.setdefault(m.name, m)
    if not methods:
        raise ConfigError("no method given; e.g. full,blend@0.15,reuse")
    return list(methods.values())


def answer_text(spec: TaskSpec, raw: str) -> str:
    """The answer that is scored: the first non-empty line where the research code keeps only that."""
    return first_line(raw) if spec.first_line_only else raw.strip()
