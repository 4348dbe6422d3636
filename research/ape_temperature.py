"""An attention temperature on stale chunk KV (APE-style): does sharpening or flattening the attention paid to
reused keys bring full KV reuse and the default blend closer to full recompute?

APE (ICLR'25) recovers much of the loss of independently encoded contexts with two numbers fitted by KL to a
sequential prefill: a temperature on the attention logits of the context tokens and a scale on their share. The
temperature needs no change to any kernel: a query's logit to key k is q.k / sqrt(d), so keys divided by T give
every query (the recomputed tokens, the question, each decoded token) logits divided by T on exactly those keys.

This study runs on `main` through the public API. Per case, each chunk's isolated entry is stored; then for each T
the entries of every chunk but the first (whose entry is exact there: it follows the prefix as in the prompt) are
replaced by copies with their keys on layers 1.. divided by T (layer 0's keys depend on the token alone, so they are
exact everywhere), and full KV reuse and the default blend (`attention`@0.15) are teacher-forced along full
recompute's answer. T = 1 is today's engine. Each case is judged at the T chosen on all the other cases (lowest
mean KL of the default blend; leave one out), paired against T = 1 (95% bootstrap interval over cases).

    python research/ape_temperature.py --cases 4 --temperatures 0.8,0.9,1,1.1,1.25 --out research/results/ape
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cacheblend_rag import BlendConfig, CacheBlendEngine, ChunkKV, EngineConfig
from cacheblend_rag.evaluation import load_dataset
from cacheblend_rag.evaluation.fidelity import bootstrap_ci, compare, prepare_case, teacher_forced_logits

METHODS = {"reuse": None, "attention@0.15": BlendConfig(rule="attention", recompute_ratio=0.15)}


def with_temperature(kv: ChunkKV, temperature: float) -> ChunkKV:
    """A copy of a stored entry whose keys on layers 1.. are divided by `temperature` (layer 0 left exact)."""
    keys = kv.keys.clone()
    keys[1:] /= temperature
    return ChunkKV(kv.key, keys, kv.values)


def run_case(engine: CacheBlendEngine, spec, case, temperatures: list[float]) -> list[dict]:
    prompt, ref = prepare_case(engine, spec, case)
    keys = engine.prompt_keys(prompt, with_prefix=False)[1:]  # every chunk but the first
    stored = {k: engine.store.get(k) for k in keys}
    rows = []
    for t in temperatures:
        for kv in stored.values():
            engine.store.put(with_temperature(kv, t))
        for name, blend in METHODS.items():
            pre = engine.prefill(prompt, "reuse" if blend is None else "blend", blend=blend)
            fig = compare(ref, teacher_forced_logits(engine, pre, ref))
            rows.append(dict(dataset=spec.name, case_id=case.id, method=name, temperature=t, **fig))
            print(f"  T={t:<5g} {name:<15} KL {fig['kl_mean']:.4f} first {fig['first_token']:.0f}", flush=True)
    for kv in stored.values():
        engine.store.put(kv)
    return rows


def report(rows: list[dict], temperatures: list[float]) -> str:
    lines = ["| set | method | " + " | ".join(f"T={t:g}" for t in temperatures) + " |",
             "|---|---|" + "---:|" * len(temperatures)]  # fmt: skip
    sets = sorted({r["dataset"] for r in rows})
    for ds in [*sets, "pooled"]:
        for m in METHODS:
            cells = []
            for t in temperatures:
                kl = [r["kl_mean"] for r in rows if r["method"] == m and r["temperature"] == t
                      and ds in ("pooled", r["dataset"])]  # fmt: skip
                cells.append(f"{statistics.mean(kl):.4f}" if kl else "")
            lines.append(f"| {ds} | {m} | " + " | ".join(cells) + " |")
    # leave one case out: T chosen on the other cases (lowest mean KL of the default blend), judged on this one
    cases = sorted({(r["dataset"], r["case_id"]) for r in rows})
    at = {(r["dataset"], r["case_id"], r["method"], r["temperature"]): r for r in rows}

    def mean_kl(t: float, others: list[tuple[str, str]]) -> float:
        return statistics.mean(at[(d, c, "attention@0.15", t)]["kl_mean"] for d, c in others)

    chosen = {case: min(temperatures, key=lambda t: mean_kl(t, [o for o in cases if o != case])) for case in cases}
    lines += ["", "T chosen leaving each case out: " + ", ".join(f"{c} {t:g}" for (_, c), t in chosen.items()), ""]
    for m in METHODS:
        diffs = [at[(d, c, m, chosen[(d, c)])]["kl_mean"] - at[(d, c, m, 1.0)]["kl_mean"] for d, c in cases]
        base = sum(at[(d, c, m, 1.0)]["first_token"] for d, c in cases)
        kept = sum(at[(d, c, m, chosen[(d, c)])]["first_token"] for d, c in cases)
        lo, hi = bootstrap_ci(diffs)
        better = sum(x < 0 for x in diffs)
        lines.append(f"- {m}, each case at the T chosen without it, minus T = 1: KL {statistics.mean(diffs):+.4f} "
                     f"[{lo:+.4f}, {hi:+.4f}], closer on {better} of {len(diffs)}; first tokens kept {kept:.0f} "
                     f"against {base:.0f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--datasets", default="samsum,musique,wikimqa,multi_news")
    p.add_argument("--cases", type=int, default=4, help="cases per set")
    p.add_argument("--temperatures", default="0.8,0.9,1,1.1,1.25")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", default="research/results/ape")
    args = p.parse_args()
    temperatures = sorted({float(x) for x in args.temperatures.split(",")} | {1.0})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ape.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["dataset"], r["case_id"]) for r in rows}
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(), show_progress=False)
    for name in args.datasets.split(","):
        ds = load_dataset(name, args.data_dir, args.cases)
        for case in ds.cases:
            if (ds.spec.name, case.id) in done:
                continue
            print(f"{ds.spec.name} {case.id}", flush=True)
            new = run_case(engine, ds.spec, case, temperatures)
            with path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            rows += new
    text = report(rows, temperatures)
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
