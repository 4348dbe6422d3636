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

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, blend_rule
from cacheblend_rag.engine.planning import question_mask, reuse_plan
from cacheblend_rag.evaluation.datasets import load_dataset
from cacheblend_rag.evaluation.fidelity import measure_blend, prepare_case
from cacheblend_rag.evaluation.fidelity_report import paired_difference
from cacheblend_rag.evaluation.records import append_record, load_records, no_records
from cacheblend_rag.evaluation.report import bootstrap_ci
from cacheblend_rag.fusion import FusionPlan, fuse

RESULTS_FILE = "selection_headroom.jsonl"
RATIOS = (0.05, 0.10, 0.15)
RULES = tuple((rule, r) for rule in ("paper", "attention", "weighted-deviation") for r in RATIOS)
ORACLES = ("oracle-attention", "oracle-deviation", "oracle-product")
PROBE_PRODUCT = "probe-x-error"  # scores a rule could compute: see `probe_times_error`
BASELINE = "paper@0.15"


def parse_cases(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]"""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def chunk_mask(prompt) -> torch.Tensor:
    mask = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    for start, end in prompt.chunk_spans:
        mask[start:end] = True
    return mask


def _per_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x / (x[mask].mean() + torch.finfo(torch.float32).tiny)


@torch.inference_mode()
def oracle_scores(engine, prompt, reference) -> dict[str, torch.Tensor]:
    """The three oracle scores ([N] each) of one prompt, from one full prefill of the prompt and its answer."""
    lm = engine.lm
    fed = list(reference.token_ids[:-1])  # the answer tokens teacher forcing feeds
    ids = torch.cat([prompt.input_ids(), torch.tensor(fed, dtype=torch.long)])
    m, n = ids.shape[0], prompt.num_tokens
    readers = torch.zeros(m, dtype=torch.bool)
    readers[n - 1 :] = True  # the positions whose logits are compared
    plan = FusionPlan(
        input_ids=ids,
        positions=torch.arange(m),
        exact=torch.zeros(m, dtype=torch.bool),
        reused=torch.zeros(m, dtype=torch.bool),
    )
    shape = (lm.shape.num_kv_heads, m, lm.shape.head_dim)

    def nothing_loaded(_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        # two tensors: the fusor writes keys and values into what it is given
        return tuple(torch.zeros(shape, dtype=engine.dtype, device=lm.device) for _ in range(2))

    full = fuse(lm, plan, nothing_loaded, want_logits=False, attention_from=readers)
    reuse = engine.prefill(prompt, "reuse").cache
    chunks = chunk_mask(prompt)
    deviation = torch.zeros(n)
    for layer, (k_full, v_full) in enumerate(zip(full.keys, full.values, strict=True)):
        k_reuse, v_reuse = reuse.layers[layer].keys[0], reuse.layers[layer].values[0]  # [Hkv, N, D], rotated
        dk = (k_full[:, :n].float() - k_reuse.float()).pow(2).sum(dim=(0, 2)).cpu()
        dv = (v_full[:, :n].float() - v_reuse.float()).pow(2).sum(dim=(0, 2)).cpu()
        deviation += _per_mean(dk, chunks) + _per_mean(dv, chunks)
    assert full.attention is not None
    attention = full.attention[:n].float().cpu()
    product = _per_mean(attention, chunks) * _per_mean(deviation, chunks)
    return {"oracle-attention": attention, "oracle-deviation": deviation, "oracle-product": product}


def method_names() -> list[str]:
    rules = [f"{rule}@{r:.2f}" for rule, r in RULES]
    scored = [f"{o}@{r:.2f}" for o in (*ORACLES, PROBE_PRODUCT) for r in RATIOS]
    return ["reuse", *rules, *scored]


@torch.inference_mode()
def probe_times_error(engine, prompt) -> torch.Tensor:
    """[N]: what a rule could compute before and during a blend: the question's attention in a reuse pass (the
    `attention` rule's probe, over the stored chunk KV) times each token's layer-1 value error (what `paper`
    measures on its check layer, here taken from a full prefill, which gives the same layer-1 values)."""
    lm, n = engine.lm, prompt.num_tokens
    parts = [engine.store.get(engine.chunk_key((), prompt.prefix_ids))] if prompt.prefix_ids else []
    parts += [engine.store.get(engine.chunk_key(prompt.prefix_ids, ids)) for ids in prompt.chunk_ids]
    pad = n - sum(p.keys.shape[2] for p in parts)

    def stored(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(lm.shape.num_kv_heads, pad, lm.shape.head_dim, dtype=engine.dtype, device=lm.device)
        keys = torch.cat([*(p.keys[layer].to(lm.device) for p in parts), zeros], dim=1)
        values = torch.cat([*(p.values[layer].to(lm.device) for p in parts), zeros], dim=1)
        return keys, values

    probe = fuse(lm, reuse_plan(prompt), stored, want_logits=False, attention_from=question_mask(prompt))
    assert probe.attention is not None
    full = engine.prefill(prompt, "full").cache.layers[1].values[0]
    cached = engine.prefill(prompt, "reuse").cache.layers[1].values[0]
    error = (full.float() - cached.float()).pow(2).sum(dim=(0, 2)).sqrt().cpu()
    return probe.attention.float().cpu() * error


def run_case(engine, name: str, spec, case, done: set[str], out: Path) -> list[dict]:
    """Measure the methods of one case not in `done`; -> the new records (already appended to the file)."""
    if done >= set(method_names()):
        return []
    prompt, ref = prepare_case(engine, spec, case)
    base = {"dataset": name, "case_id": case.id, "answer_tokens": len(ref.token_ids)}
    jobs = [("reuse", None, None)] + [(f"{rule}@{r:.2f}", blend_rule(rule, r), None) for rule, r in RULES]
    if any(f"{o}@{r:.2f}" not in done for o in ORACLES for r in RATIOS):
        scores = oracle_scores(engine, prompt, ref)
        jobs += [(f"{o}@{r:.2f}", blend_rule("attention", r), scores[o]) for o in ORACLES for r in RATIOS]
    if any(f"{PROBE_PRODUCT}@{r:.2f}" not in done for r in RATIOS):
        product = probe_times_error(engine, prompt)
        jobs += [(f"{PROBE_PRODUCT}@{r:.2f}", blend_rule("attention", r), product) for r in RATIOS]
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="0-9", help="case indices of every data set, e.g. 0-9 or 0,3,7")
    p.add_argument("--datasets", default="multi_news,musique")
    p.add_argument("--out", default="bench-results/selection_headroom")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = load_records(out, repair=True, filename=RESULTS_FILE)
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
