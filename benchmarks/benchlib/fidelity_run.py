"""The fidelity benchmark's runner: every rule at every ratio on every case, one JSONL record per (case, method).

Per case, full recompute's reference answer is computed once (`cacheblend_rag.evaluation.fidelity`), then each
method is measured against it. Records go to `OUT/fidelity.jsonl`, so a run resumes where it stopped;
`fidelity_report` turns them into tables and figures.

With stored-KV codecs (`codec_engines`), every method is measured again on engines whose memory tier stores chunk
KV through each codec, against the same reference: `attention@0.15+int8` is `attention@0.15` with its chunks read
back from int8. The uncompressed store (`native`) keeps the plain names, so its records pair with older runs'.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchlib.records import append_record, check_run_settings, load_records
from cacheblend_rag.config import BlendConfig, blend_rule
from cacheblend_rag.engine import CacheBlendEngine, TokenizedPrompt
from cacheblend_rag.errors import CacheBlendError, ConfigError
from cacheblend_rag.evaluation.datasets import Case, Dataset, TaskSpec
from cacheblend_rag.evaluation.fidelity import Reference, measure_with_logits, prepare_case
from cacheblend_rag.guard import kl
from cacheblend_rag.store.codec import CALIBRATED_CODECS, CODECS

RESULTS_FILE = "fidelity.jsonl"
# Fills a variant engine's store for a case: (engine, spec, case, prompt) -> fields added to the variant's records
Prepare = Callable[[CacheBlendEngine, TaskSpec, Case, TokenizedPrompt], dict[str, Any]]
DEFAULT_RATIOS = (0.02, 0.05, 0.10, 0.15, 0.30)
NATIVE = "native"  # the uncompressed store: its methods keep their plain names


@dataclass(frozen=True)
class FidelityMethod:
    """One way to prefill a case: full KV reuse, or blend with a named rule at a ratio."""

    rule: str  # "reuse", or a blend rule name (`config.RULE_NAMES`)
    ratio: float | None = None  # blend only

    def __post_init__(self) -> None:
        if (self.rule == "reuse") != (self.ratio is None):
            raise ConfigError(f"a ratio goes with blend rules only, got rule {self.rule!r}, ratio {self.ratio}")
        if self.ratio is not None:
            blend_rule(self.rule, self.ratio)  # validates name and ratio

    @property
    def name(self) -> str:
        return self.rule if self.ratio is None else f"{self.rule}@{self.ratio:.2f}"

    @property
    def blend(self) -> BlendConfig | None:
        return None if self.ratio is None else blend_rule(self.rule, self.ratio)


def fidelity_methods(rules: Sequence[str], ratios: Sequence[float], *, reuse: bool = True) -> list[FidelityMethod]:
    """Every rule at every ratio (and full KV reuse first, unless `reuse=False`)."""
    if not rules and not reuse:
        raise ConfigError("name at least one rule, or keep full KV reuse")
    methods = [FidelityMethod("reuse")] if reuse else []
    methods += [FidelityMethod(rule, float(r)) for rule in rules for r in ratios]
    return methods


def codec_method_name(method: str, codec: str) -> str:
    """'attention@0.15', 'int8' -> 'attention@0.15+int8'; the uncompressed store keeps the plain name."""
    return method if codec == NATIVE else f"{method}+{codec}"


def split_codec(name: str) -> tuple[str, str]:
    """A recorded method name -> (the method, the codec its chunk KV was read through); undoes `codec_method_name`.
    The "codec" is everything after the method: a variant of the chunk KV and a codec over it read as one
    ('attention@0.15+grp+int4' -> ('attention@0.15', 'grp+int4'); `fidelity_codecs.baseline_of`)."""
    method, sep, codec = name.partition("+")
    return (method, codec) if sep else (name, NATIVE)


def parse_codecs(text: str) -> list[str]:
    """ "int8,int4" -> ['native', 'int8', 'int4']: the uncompressed store always comes first, as every codec's
    measures are paired against it. ConfigError naming a codec that `store.codec.CODECS` does not have (nor
    `CALIBRATED_CODECS`, which the engines fit to the model)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [*CODECS, *CALIBRATED_CODECS]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--kv-codec: unknown codec {unknown[0]!r}; choose among {', '.join(known)}")
    return list(dict.fromkeys([NATIVE, *names]))


def codec_engines(engine: CacheBlendEngine, codecs: Sequence[str]) -> dict[str, CacheBlendEngine]:
    """Per codec name, an engine on `engine`'s model (shared, not copied) whose memory tier stores chunk KV through
    that codec; `engine` itself for the uncompressed store."""
    engines = {}
    for name in codecs:
        config = replace(engine.config, store=replace(engine.config.store, memory_codec=name))
        engines[name] = engine if name == NATIVE else CacheBlendEngine(engine.model, engine.tokenizer, config=config,
                                                                      template=engine.template)  # fmt: skip
    return engines


def copy_chunks(src: CacheBlendEngine, dst: CacheBlendEngine, prompt: TokenizedPrompt) -> None:
    """Put the prompt's stored KV (prefix and chunks) from `src`'s store into `dst`'s, which encodes it with its
    codec: the same KV as a prefill on `dst` would store, without computing it again. An entry `src` no longer
    holds is left out; `dst` then prefills it when it is read."""
    for key in src.prompt_keys(prompt):
        kv = src.store.get(key)
        if kv is not None:
            dst.store.put(kv)


def interleave(datasets: Sequence[Dataset]) -> Iterator[tuple[TaskSpec, Case]]:
    """Case 1 of every data set, then case 2 of every data set...: a stopped run covers all sets evenly."""
    longest = max((len(ds.cases) for ds in datasets), default=0)
    for i in range(longest):
        for ds in datasets:
            if i < len(ds.cases):
                yield ds.spec, ds.cases[i]


def run_fidelity(
    engine: Any,
    datasets: Sequence[Dataset],
    methods: Sequence[FidelityMethod],
    out_dir: str | os.PathLike[str],
    *,
    codecs: Mapping[str, CacheBlendEngine] | None = None,
    codec_methods: Sequence[FidelityMethod] | None = None,
    prepare: Mapping[str, Prepare] | None = None,
    settings: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> list[dict[str, Any]]:
    """Measure every (case, method, codec) not yet in `OUT/fidelity.jsonl`; return all records.

    Per case: warm the chunk store (untimed), compute full recompute's reference once with `engine`, then each
    method on each engine of `codecs` (codec name -> an engine on the same model whose store reads chunk KV
    through that codec, `codec_engines`; default: `engine` alone, as "native"), its store warmed with `engine`'s
    chunk KV; the codecs other than "native" measure `codec_methods` (default: `methods`). `prepare` names the
    variants whose store is filled otherwise (e.g. contextual chunk KV, `fidelity_context`): a callable that fills
    the variant engine's store for the case and returns fields added to its records. A case whose prompt
    the engine refuses (e.g. beyond the context) is recorded with its error and
    skipped.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_run_settings(out, settings or {})
    records = load_records(out, repair=True, filename=RESULTS_FILE)
    done = {(r["dataset"], r["case_id"], r["method"]) for r in records}
    codecs = dict(codecs or {NATIVE: engine})
    coded = list(methods if codec_methods is None else codec_methods)
    per_codec = {c: methods if c == NATIVE else coded for c in codecs}
    names = ["full", *(codec_method_name(m.name, c) for c in codecs for m in per_codec[c])]
    work = [(s, c) for s, c in interleave(datasets) if any((s.name, c.id, n) not in done for n in names)]
    bar = tqdm(work, desc="fidelity", unit="case", disable=not show_progress)
    for spec, case in bar:
        bar.set_postfix_str(f"{spec.name} {case.id}", refresh=True)
        base = {"dataset": spec.name, "case_id": case.id, "task": case.task}
        try:
            prompt, ref = prepare_case(engine, spec, case)
        except CacheBlendError as e:
            rec = {**base, "method": "full", "error": f"{type(e).__name__}: {e}"}
            append_record(out / RESULTS_FILE, rec)
            records.append(rec)
            continue
        todo: list[tuple[str, dict[str, Any]]] = []
        if (spec.name, case.id, "full") not in done:
            todo.append(("full", _full_record(ref)))
        for codec, codec_engine in codecs.items():
            todo_here = per_codec[codec]
            missing = [m for m in todo_here if (spec.name, case.id, codec_method_name(m.name, codec)) not in done]
            extra: dict[str, Any] = {}
            if missing and codec in (prepare or {}):
                extra = prepare[codec](codec_engine, spec, case, prompt)  # type: ignore[index]
            elif missing and codec_engine is not engine:
                codec_engine.clear_store()  # only this case's chunks: the stores stay small
                copy_chunks(engine, codec_engine, prompt)
            firsts: dict[str, torch.Tensor] = {}  # this codec's methods' first-token logits, in order
            for method in missing:
                rec, logits = measure_with_logits(codec_engine, prompt, ref, method.blend)
                # KL(this || earlier method) of the first token: replays the guard's ladder offline
                rec["first_kl"] = {name: kl(logits, other) for name, other in firsts.items()}
                firsts[method.name] = logits
                rec.update(rule=method.rule, ratio=method.ratio, codec=codec, **extra)
                todo.append((codec_method_name(method.name, codec), rec))
        shared = {"answer_tokens": len(ref.token_ids), "prompt_tokens": ref.prompt_tokens,
                  "reference_digest": reference_digest(ref)}  # fmt: skip
        for name, rec in todo:
            rec = {**base, "method": name, **shared, **rec}
            append_record(out / RESULTS_FILE, rec)
            records.append(rec)
            done.add((spec.name, case.id, name))
    return records


def reference_digest(ref: Reference) -> str:
    """A short digest of the reference answer's tokens. A run resumed on another machine computes the reference
    again; where the greedy answer came out differently there, records of one case would compare methods against
    different answers, and their digests tell (`fidelity_codecs` pairs only records whose digests agree)."""
    return hashlib.sha1(",".join(map(str, ref.token_ids)).encode()).hexdigest()[:16]


def _full_record(ref: Reference) -> dict[str, Any]:
    """Full recompute against its own reference: the zero point of every figure."""
    logprob = float(ref.logprobs.gather(1, torch.tensor(ref.token_ids)[:, None]).sum())
    return {
        "rule": "full", "ratio": None, "kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0, "first_token": 1.0,
        "logprob": logprob, "ttft_s": ref.ttft_s, "compute_share": 1.0, "recomputed_share": 1.0,
        "reference": ref.text,
    }  # fmt: skip
