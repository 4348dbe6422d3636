"""Paired KL(full||rule with codec) - KL(full||rule native) per selection rule, SmolLM2, the guard gate's 12 questions."""
import sys, statistics, dataclasses
sys.path.insert(0, "/work/main/tests")
from test_guard_gate import QUESTIONS
from test_quality_gate import CHUNKS, ANSWER_TOKENS
from cacheblend_rag import CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.evaluation.fidelity import measure, reference_answer
from cacheblend_rag.evaluation import bootstrap_ci
eng = CacheBlendEngine.from_pretrained("smollm2-135m-instruct", config=EngineConfig(dtype="float32", miss_policy="blend"), show_progress=False)
coded = {c: CacheBlendEngine(eng.model, eng.tokenizer, config=dataclasses.replace(eng.config, memory_codec=c), template=eng.template) for c in ("int8", "int4")}
rules = [("attention", 0.15), ("paper", 0.15), ("gradual", 0.15), ("epic", 0.15)]
diffs = {(c, r): [] for c in coded for r, _ in rules}
base = {r: [] for r, _ in rules}
for q in QUESTIONS:
    eng.precompute(CHUNKS, q); p = eng.build_prompt(CHUNKS, q); ref = reference_answer(eng, p, ANSWER_TOKENS)
    for c, e in coded.items():
        e.precompute(CHUNKS, q)
    for r, x in rules:
        n = measure(eng, p, ref, blend_rule(r, x))["kl_mean"]; base[r].append(n)
        for c, e in coded.items():
            diffs[(c, r)].append(measure(e, p, ref, blend_rule(r, x))["kl_mean"] - n)
for (c, r), d in diffs.items():
    lo, hi = bootstrap_ci(d)
    print(f"| {c} | {r}@0.15 | {statistics.fmean(base[r]):.4f} | {statistics.fmean(d):+.4f} [{lo:+.4f}, {hi:+.4f}] |", flush=True)
