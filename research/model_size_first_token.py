"""Is the 0.5B default model the worst case? First-token agreement with full recompute, 0.5B against 1.5B.

The 1.5B preset's quality run (`benchmarks/results/quality-1.5b/results.jsonl`: full recompute, full KV reuse and
the default `attention`@0.15 on the first 50 MuSiQue and 50 2WikiMQA cases, greedy answers) holds each method's
answer text but no logits. Greedy decoding makes its first token the argmax of the prefill's first-token
distribution, which is what the fidelity benchmark's `first_token` compares; so the share of cases whose answer
starts with the same token as full recompute's answer measures the same thing from the texts (first token of the
answer's text re-tokenized: Qwen2.5's tokenizer, shared by both sizes).

The proxy is checked where both exist: full KV reuse on the 0.5B model (the same prompts, no rule involved), whose
quality run (`quality-qa`) gives the texts and whose fidelity run (`fidelity`) the exact first-token figure.
Intervals: 95% bootstrap over cases. Reads records only; no model runs:

    python research/model_size_first_token.py > research/results/model_size_first_token.txt
"""

import json
import sys
from pathlib import Path

from cacheblend_rag.evaluation import bootstrap_ci
from cacheblend_rag.testing import default_preset_tokenizer

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
DATASETS = ("musique", "wikimqa")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answers(run: str) -> dict[tuple[str, str, str], str]:
    """(dataset, case, method) -> the generated answer's text, of a quality run."""
    return {(r["dataset"], r["case_id"], r["method"]): r["raw_text"] for r in read(RESULTS / run / "results.jsonl")
            if "error" not in r}  # fmt: skip


def first_id(tok, text: str) -> int | None:
    ids = tok.encode(text.strip(), add_special_tokens=False)
    return ids[0] if ids else None


def exact_by_case(records: list[dict], dataset: str, method: str) -> dict[str, float]:
    """case -> the fidelity run's exact first-token agreement of `method`."""
    return {r["case_id"]: r["first_token"] for r in records if r["dataset"] == dataset and r["method"] == method
            and "error" not in r}  # fmt: skip


def text_by_case(tok, texts: dict, dataset: str, method: str) -> dict[str, float]:
    """Per case with both answers: 1.0 where the method's answer starts with full recompute's first token."""
    out = {}
    for (ds, case, m), text in texts.items():
        if ds == dataset and m == method and (ds, case, "full") in texts:
            out[case] = float(first_id(tok, text) == first_id(tok, texts[(ds, case, "full")]))
    return out


def line(label: str, values: list[float]) -> str:
    lo, hi = bootstrap_ci(values)
    return f"  {label:<44} {sum(values) / len(values):.2f} [{lo:.2f}, {hi:.2f}]  ({len(values)} cases)"


def main() -> int:
    tok = default_preset_tokenizer()
    if tok is None:
        print("the default preset has not been loaded on this machine; run `cacheblend-rag ask` once", file=sys.stderr)
        return 2
    small, large = answers("quality-qa"), answers("quality-1.5b")
    fidelity = read(RESULTS / "fidelity" / "fidelity.jsonl")
    for ds in DATASETS:
        cases = sorted({case for (d, case, m) in large if d == ds and m == "full"})
        proxy, exact = text_by_case(tok, small, ds, "reuse"), exact_by_case(fidelity, ds, "reuse")
        blend = exact_by_case(fidelity, ds, "attention@0.15")
        same = sum(proxy[c] == exact[c] for c in cases if c in proxy and c in exact)
        print(f"{ds}: share of cases whose first token matches full recompute's")
        print(line("0.5B reuse, from the answers' text (proxy)", [proxy[c] for c in cases if c in proxy]))
        print(line("0.5B reuse, exact (fidelity run)", [exact[c] for c in cases if c in exact]))
        print(f"  (the proxy and the exact figure agree on {same} of {len(cases)} cases)")
        print(line("0.5B attention@0.15, exact (fidelity run)", [blend[c] for c in cases if c in blend]))
        small_by_method = {"reuse": exact, "attention@0.15": blend}
        for method in ("reuse", "attention@0.15"):
            by_case = text_by_case(tok, large, ds, method)
            print(line(f"1.5B {method}, from the answers' text", [by_case[c] for c in cases if c in by_case]))
            both = [c for c in cases if c in by_case and c in small_by_method[method]]
            diffs = [by_case[c] - small_by_method[method][c] for c in both]
            lo, hi = bootstrap_ci(diffs)
            print(
                f"    1.5B - 0.5B, paired: {sum(diffs) / len(diffs):+.2f} [{lo:+.2f}, {hi:+.2f}]  ({len(both)} cases)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
