"""Does model size change the guard's picture? Full reuse, the default blend and the default guard on the 1.5B preset
against the 0.5B default model, paired on the same MuSiQue and 2WikiMQA cases.

Both come from the fidelity benchmark (`benchmarks/fidelity.py --rules attention --ratios 0.15`, fp32, teacher-
forced against each model's own full recompute): the 0.5B records of the guard study
(`benchmarks/results/guard/`, `benchmarks/results/fidelity/`) and the 1.5B run (`benchmarks/results/guard-1.5b/`).
The guard is `Guard()` (escalate straight to full recompute when the blend's first-token margin is under 0.1),
replayed from the base blend's recorded risk signals exactly as the engine decides (`FidelityProfile.outcome`,
through `benchlib.guard_study`), so an escalated case pays the blend and a full prefill. Per data set, on the cases
both models have: each setting's first-token agreement, mean KL and compute share, and the paired difference
1.5B - 0.5B, with 95% bootstrap intervals over cases. It also checks the reading of first-token agreement from the
1.5B quality run's answer texts (`model_size_first_token.py`) against this exact figure on the same cases. Runs on
the current code, from records only:

    python research/model_size_guard.py > research/results/model_size_guard.txt
"""

import statistics
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).parent)]

from benchlib.guard_study import load_cases, profile  # noqa: E402
from benchlib.records import load_records  # noqa: E402
from model_size_first_token import answers, text_by_case  # noqa: E402

from cacheblend_rag.config import Guard  # noqa: E402
from cacheblend_rag.controller.fidelity_choice import Setting  # noqa: E402
from cacheblend_rag.evaluation import bootstrap_ci  # noqa: E402
from cacheblend_rag.testing import default_preset_tokenizer  # noqa: E402

RESULTS = BENCHMARKS / "results"
GRID = (0.15,)
SETTINGS = {
    "full KV reuse": None,
    "default blend (r=0.15)": Setting(0.15),
    f"guarded default ({Guard().describe()})": Setting(0.15, Guard()),
}


def cases_of(folders: list[str], probes: str | None = None) -> dict[str, dict[str, dict]]:
    """dataset -> case id -> {method: record}, for the cases with full, reuse, the default blend and its signals
    (in the records, or from the guard probe's records in folder `probes`)."""
    records = [r for f in folders for r in load_records(RESULTS / f, filename="fidelity.jsonl")]
    signals = load_records(RESULTS / probes, filename="probe.jsonl") if probes else []
    return {ds: {c["full"]["case_id"]: c for c in group} for ds, group in load_cases(records, signals, GRID).items()}


def outcomes(group: list[dict], setting: Setting | None) -> list[dict]:
    prof = profile(group, GRID, (1.0,))
    if setting is None:
        return [q["reuse"] for q in prof.questions]
    return [prof.outcome(setting, q) for q in prof.questions]


def mci(values: list[float], digits: int, sign: str = "") -> str:
    """Mean [95% bootstrap interval]; `sign="+"` for a difference."""
    lo, hi = bootstrap_ci(values)
    return f"{statistics.fmean(values):{sign}.{digits}f} [{lo:{sign}.{digits}f}, {hi:{sign}.{digits}f}]"


def main() -> None:
    small = cases_of(["fidelity", "guard"], probes="guard")
    large = cases_of(["guard-1.5b"])
    for ds in sorted(large):
        common = [cid for cid in small.get(ds, {}) if cid in large[ds]]
        if not common:
            continue
        print(f"\n{ds}: {len(common)} cases both models have (first token, mean KL nats, compute share, escalated)")
        for label, setting in SETTINGS.items():
            a = outcomes([small[ds][c] for c in common], setting)
            b = outcomes([large[ds][c] for c in common], setting)
            for model, rows in (("0.5B", a), ("1.5B", b)):
                first = [r["first_token"] for r in rows]
                kl = [r["kl_mean"] for r in rows]
                esc = statistics.fmean(float(r.get("escalated", False)) for r in rows)
                compute = statistics.fmean(r["compute_share"] for r in rows)
                print(f"  {model} {label:<44} first token {mci(first, 2)}  KL {mci(kl, 3)}  "
                      f"compute {compute:.3f}  escalated {esc:.2f}")  # fmt: skip
            d_first = [y["first_token"] - x["first_token"] for x, y in zip(a, b, strict=True)]
            d_kl = [y["kl_mean"] - x["kl_mean"] for x, y in zip(a, b, strict=True)]
            print(f"    1.5B - 0.5B, paired: first token {mci(d_first, 2, '+')}  KL {mci(d_kl, 3, '+')}")
    proxy_check(large)


def proxy_check(large: dict[str, dict[str, dict]]) -> None:
    """Per data set and method: on how many cases the quality run's answer texts give the exact first token."""
    tok = default_preset_tokenizer()
    if tok is None:
        print("\n(the text reading is not checked: the default preset has not been loaded on this machine)")
        return
    texts = answers("quality-1.5b")
    print("\n1.5B first-token agreement read from the quality run's answers, against the exact figure here:")
    for ds in sorted(large):
        for method in ("reuse", "attention@0.15"):
            proxy = text_by_case(tok, texts, ds, method)
            both = [c for c in large[ds] if c in proxy]
            same = sum(proxy[c] == large[ds][c][method]["first_token"] for c in both)
            print(f"  {ds} {method}: the same on {same} of {len(both)} cases")


if __name__ == "__main__":
    main()
