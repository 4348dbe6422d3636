# A study, kept for reading. It runs at the git tag lab-2026-11-25, where it is
# benchmarks/selection_headroom.py: see research/README.md.
"""How much can any choice of tokens give at r = 0.05? Selection rules against oracles that know the answer.

Every blend rule guesses, before the prefill, which chunk tokens to recompute. This script ranks them instead
with what only a full prefill knows, and measures the blend that recomputes the oracle's picks (teacher-forced
fidelity to full recompute, as `cacheblend-rag bench fidelity` measures it), beside the real rules on the same
cases:
- `oracle-attention`: the attention the reference answer's tokens (and the prompt's last token) pay to each
  chunk token in a full prefill, averaged over heads, those tokens and all layers but the last. The
  `attention` rule estimates this with the question's attention over reused KV.
- `oracle-deviation`: how far each token's cached KV is from full prefill's, summed over every layer (keys and
  values, each divided by its mean over chunk tokens on that layer). The deviation rules estimate this on their
  check layers only.
- `oracle-product`: the two above multiplied (each divided by its mean): tokens the answer reads whose KV is
  wrong.
Two rankings a rule can compute, beside them:
- `probe-x-error`: `oracle-product` with signals a rule can have: the question's attention in the `attention`
  rule's reuse pass, times the layer-1 value error that `paper` measures on its check layer. (Given as scores,
  its compute share leaves out that pass and that check layer.)
- `weighted-deviation`, a named rule: the question's attention on check layer 1 times the layer-1 value error.
The oracles are ranked through `CacheBlendEngine.prefill(..., token_scores=...)`, which skips the attention
pass, so their compute share is the recompute alone. Every method runs at r = 0.05, 0.10 and 0.15. If no oracle
at r = 0.05 reaches `paper` at 0.15, a rule that picks 5% of the tokens once, by either signal, is unlikely to.

    python benchmarks/selection_headroom.py --datasets multi_news,musique --cases 0-9 \\
        --out benchmarks/results/selection_headroom

Appends one JSON line per (case, method) to OUT/selection_headroom.jsonl (a run resumes where it stopped) and
prints, per data set, mean KL and top-1 agreement with 95% intervals over the cases every method finished, and
each method's paired KL difference to `paper@0.15`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cacheblend_rag import blend_rule
from cacheblend_rag.engine.planning import prefix_and_chunk_masks, question_mask, reuse_plan
from cacheblend_rag.evaluation.case_scripts import case_script_parser, paired_kl_table, run_case_script
from cacheblend_rag.evaluation.fidelity import measure_blend, prepare_case
from cacheblend_rag.evaluation.records import append_record
from cacheblend_rag.fusion import FusionPlan, fuse

RESULTS_FILE = "selection_headroom.jsonl"
RATIOS = (0.05, 0.10, 0.15)
RULES = tuple((rule, r) for rule in ("paper", "attention", "weighted-deviation") for r in RATIOS)
ORACLES = ("oracle-attention", "oracle-deviation", "oracle-product")
PROBE_PRODUCT = "probe-x-error"  # scores a rule could compute: see `rankings`
BASELINE = "paper@0.15"


def _per_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x / (x[mask].mean() + torch.finfo(torch.float32).tiny)


@torch.inference_mode()
def rankings(engine, prompt, reference) -> dict[str, torch.Tensor]:
    """The three oracles' and `probe-x-error`'s scores ([N] each) of one prompt, from one full prefill of the
    prompt and its answer (by the fusor, which gives the prompt's KV as a full prefill does), one full-KV-reuse
    prefill and the `attention` rule's probe over the stored chunks."""
    lm = engine.lm
    fed = list(reference.token_ids[:-1])  # the answer tokens teacher forcing feeds
    ids = torch.cat([prompt.input_ids(), torch.tensor(fed, dtype=torch.long)])
    m, n = ids.shape[0], prompt.num_tokens
    readers = torch.zeros(m, dtype=torch.bool)
    readers[n - 1 :] = True  # the positions whose logits are compared
    nothing = torch.zeros(m, dtype=torch.bool)
    plan = FusionPlan(input_ids=ids, positions=torch.arange(m), exact=nothing, reused=nothing)
    full = fuse(lm, plan, engine.chunks.layer_loader([], m), want_logits=False, attention_from=readers)
    reuse = engine.prefill(prompt, "reuse").cache
    _, chunks = prefix_and_chunk_masks(prompt)

    def distance(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:  # [Hkv, N, D] x 2 -> [N]
        return (fresh[:, :n].float() - cached.float()).pow(2).sum(dim=(0, 2)).cpu()

    deviation = torch.zeros(n)
    for layer, (k_full, v_full) in enumerate(zip(full.keys, full.values, strict=True)):
        k_reuse, v_reuse = reuse.layers[layer].keys[0], reuse.layers[layer].values[0]  # [Hkv, N, D], rotated
        deviation += _per_mean(distance(k_full, k_reuse), chunks) + _per_mean(distance(v_full, v_reuse), chunks)
    assert full.attention is not None
    attention = full.attention[:n].float().cpu()

    # What a rule could compute: the question's attention in the `attention` rule's probe over the stored chunk
    # KV, times the layer-1 value error that `paper` measures on its check layer.
    parts = [engine.store.get(k) for k in engine.prompt_keys(prompt)]
    load = engine.chunks.layer_loader(parts, n)
    probe = fuse(lm, reuse_plan(prompt), load, want_logits=False, attention_from=question_mask(prompt))
    assert probe.attention is not None
    value_error = distance(full.values[1], reuse.layers[1].values[0]).sqrt()
    return {
        "oracle-attention": attention,
        "oracle-deviation": deviation,
        "oracle-product": _per_mean(attention, chunks) * _per_mean(deviation, chunks),
        PROBE_PRODUCT: probe.attention.float().cpu() * value_error,
    }


def method_names() -> list[str]:
    rules = [f"{rule}@{r:.2f}" for rule, r in RULES]
    scored = [f"{o}@{r:.2f}" for o in (*ORACLES, PROBE_PRODUCT) for r in RATIOS]
    return ["reuse", *rules, *scored]


def run_case(engine, name: str, spec, case, done: set[str], out: Path) -> list[dict]:
    """Measure the methods of one case not in `done`; -> the new records (already appended to the file)."""
    names = method_names()
    if done >= set(names):
        return []
    prompt, ref = prepare_case(engine, spec, case)
    base = {"dataset": name, "case_id": case.id, "answer_tokens": len(ref.token_ids)}
    jobs = [("reuse", None, None)] + [(f"{rule}@{r:.2f}", blend_rule(rule, r), None) for rule, r in RULES]
    scored = [(f"{o}@{r:.2f}", o, r) for o in (*ORACLES, PROBE_PRODUCT) for r in RATIOS]
    if any(method not in done for method, _, _ in scored):
        scores = rankings(engine, prompt, ref)
        jobs += [(method, blend_rule("attention", r), scores[o]) for method, o, r in scored]
    new = []
    for method, blend, given in jobs:
        if method in done:
            continue
        rec = {**base, "method": method, **measure_blend(engine, prompt, ref, blend, given)}
        append_record(out / RESULTS_FILE, rec)
        new.append(rec)
    return new


def table(records: list[dict]) -> str:
    """Per data set, over the cases every method finished: mean KL and top-1 [95% CI], compute share, and the
    paired KL difference to `paper@0.15`."""
    return paired_kl_table(
        records,
        lambda names: sorted(names, key=lambda s: (s != "reuse", s)),
        lambda method: None if method == BASELINE else BASELINE,
        diff_column=f"KL - {BASELINE}",
    )


def main(argv: list[str] | None = None) -> int:
    p = case_script_parser(__doc__, cases="0-9", datasets="multi_news,musique", out="bench-results/selection_headroom")
    args = p.parse_args(argv)
    return run_case_script(
        args,
        RESULTS_FILE,
        lambda engine, name, ds, i, done, out: run_case(engine, name, ds.spec, ds.cases[i], done, out),
        table,
    )


if __name__ == "__main__":
    sys.exit(main())
