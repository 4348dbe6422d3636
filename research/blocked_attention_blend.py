"""The blend's fidelity with attention over query blocks against torch's SDPA, on the same prompts (research log,
study 34): for each of 10 prompts of the peer benchmark (SQuAD, ~1,400 tokens), default model, bf16, chunks stored,
once with each attention (the model's own forward and the blend's rows switch together): KL(full || default blend),
and the ends of the ratio range (r = 1 against full, r = 0 against full reuse, max |logit difference|).

    python research/blocked_attention_blend.py --data-dir DATA
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from benchlib.peers import rag_prompts  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.models import default_model  # noqa: E402
from cacheblend_rag.models.attention import BLOCKED_ATTENTION  # noqa: E402

KINDS = ("sdpa", BLOCKED_ATTENTION)


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = p.float().log_softmax(-1), q.float().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("CACHEBLEND_RAG_DATA"))
    p.add_argument("--prompts", type=int, default=10)
    args = p.parse_args()
    engine = CacheBlendEngine.from_pretrained(default_model(), config=EngineConfig(dtype="bfloat16"),
                                              show_progress=False)  # fmt: skip
    rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in KINDS}
    for rag in rag_prompts(engine, Path(args.data_dir), args.prompts, 1300, 1420):
        for kind in KINDS:
            engine.model.set_attn_implementation(kind)
            engine.clear_store()
            engine.precompute(rag.texts, rag.question)
            full, reuse = (engine.prefill(rag.prompt, m).logits for m in ("full", "reuse"))
            blend = engine.prefill(rag.prompt, "blend").logits
            one, zero = (engine.prefill(rag.prompt, "blend", recompute_ratio=r).logits for r in (1.0, 0.0))
            rows[kind].append((kl(full, blend), float((one - full).abs().max()), float((zero - reuse).abs().max())))
    for kind, got in rows.items():
        print(f"{kind}: KL(full || blend) mean {statistics.mean(r[0] for r in got):.4f}, max |r=1 - full| "
              f"{max(r[1] for r in got):.3f}, max |r=0 - reuse| {max(r[2] for r in got):.3f}")  # fmt: skip
    diff = [a[0] - b[0] for a, b in zip(rows[BLOCKED_ATTENTION], rows["sdpa"], strict=True)]
    print(f"paired KL, blocked - sdpa: mean {statistics.mean(diff):+.4f}, per prompt {[round(d, 4) for d in diff]}")


if __name__ == "__main__":
    main()
