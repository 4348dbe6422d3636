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

import collections
import statistics
import sys
from pathlib import Path

import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.engine.planning import prefix_and_chunk_masks, question_mask, reuse_plan
from cacheblend_rag.evaluation.case_scripts import case_script_parser, no_records, open_records, parse_cases
from cacheblend_rag.evaluation.datasets import load_dataset
from cacheblend_rag.evaluation.fidelity import measure_blend, prepare_case
from cacheblend_rag.evaluation.fidelity_report import paired_difference
from cacheblend_rag.evaluation.records import append_record
from cacheblend_rag.evaluation.report import bootstrap_ci
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
    parts = [engine.store.get(engine.chunk_key((), prompt.prefix_ids))] if prompt.prefix_ids else []
    parts += [engine.store.get(engine.chunk_key(prompt.prefix_ids, ids)) for ids in prompt.chunk_ids]
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
    lines = []
    for ds in sorted({r["dataset"] for r in records}):
        mine = [r for r in records if r["dataset"] == ds]
        methods = sorted({r["method"] for r in mine}, key=lambda s: (s != "reuse", s))
        by_case: dict[str, set[str]] = collections.defaultdict(set)
        for r in mine:
            by_case[r["case_id"]].add(r["method"])
        cases = {c for c, ms in by_case.items() if ms >= set(methods)}
        rows = [r for r in mine if r["case_id"] in cases]
        lines += [f"{ds}: {len(cases)} cases with every method", ""]
        lines += ["| method | mean KL [95% CI] | top-1 [95% CI] | compute share | KL - paper@0.15 [95% CI] |"]
        lines += ["|---|---|---|---|---|"]
        for method in methods:
            rs = [r for r in rows if r["method"] == method]
            if not rs:
                continue
            kl, top1 = [r["kl_mean"] for r in rs], [r["top1"] for r in rs]
            (kl_lo, kl_hi), (t_lo, t_hi) = bootstrap_ci(kl), bootstrap_ci(top1)
            share = statistics.fmean(r["compute_share"] for r in rs)
            diff = paired_difference(rows, ds, method, BASELINE, "kl_mean") if method != BASELINE else None
            d = f"{diff[1]:+.4f} [{diff[2][0]:+.4f}, {diff[2][1]:+.4f}]" if diff else "-"
            lines.append(
                f"| {method} | {statistics.fmean(kl):.4f} [{kl_lo:.4f}, {kl_hi:.4f}] | "
                f"{statistics.fmean(top1):.3f} [{t_lo:.3f}, {t_hi:.3f}] | {share:.3f} | {d} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = case_script_parser(__doc__, cases="0-9", datasets="multi_news,musique", out="bench-results/selection_headroom")
    args = p.parse_args(argv)
    out, records = open_records(args.out, RESULTS_FILE)
    if not args.report_only:
        indices = parse_cases(args.cases)
        engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig())
        sets = {name: load_dataset(name, args.data_dir, limit=max(indices) + 1) for name in args.datasets.split(",")}
        for i in indices:  # case i of every data set, then case i + 1: a stopped run covers the sets evenly
            for name, ds in sets.items():
                if i >= len(ds.cases):
                    continue
                case = ds.cases[i]
                done = {r["method"] for r in records if r["dataset"] == name and r["case_id"] == case.id}
                records += run_case(engine, name, ds.spec, case, done, out)
                print(name, case.id, file=sys.stderr, flush=True)
    if no_records(records, out / RESULTS_FILE):
        return 2
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
