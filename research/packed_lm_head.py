"""The LM head packed for oneDNN (`models.packed.pack_linears`) against the plain product, bf16 on a CPU (research
log, study 34): the default model's LM head alone at 1, 2 and 8 rows (median of 30, bit-equality checked), then a
warm default blend answering up to 24 tokens over --prompts prompts of the peer benchmark, the engine's LM head
swapped between the packed and the plain module in one process, alternated: TTFT and decoding tokens/s.

    python research/packed_lm_head.py --data-dir DATA
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
import torch.nn.functional as F  # noqa: E402
from benchlib.cli import cpu_name  # noqa: E402
from benchlib.peers import rag_prompts  # noqa: E402
from benchlib.timing import median_ms  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.models import default_model  # noqa: E402
from cacheblend_rag.models.packed import PackedLinear  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("CACHEBLEND_RAG_DATA"))
    p.add_argument("--prompts", type=int, default=5)
    args = p.parse_args()
    engine = CacheBlendEngine.from_pretrained(default_model(), config=EngineConfig(dtype="bfloat16"),
                                              show_progress=False)  # fmt: skip
    packed = engine.model.lm_head
    assert isinstance(packed, PackedLinear), "the engine packs the LM head where packing is available"
    plain = torch.nn.Linear(packed.in_features, packed.out_features, bias=False)
    plain.weight = packed.weight
    print(cpu_name())
    with torch.inference_mode():
        for rows in (1, 2, 8):
            x = torch.randn(rows, packed.in_features).bfloat16()
            same = torch.equal(packed(x), F.linear(x, plain.weight))
            print(f"LM head, {rows} rows: packed {median_ms(lambda x=x: packed(x), 30):.2f} ms, plain "
                  f"{median_ms(lambda x=x: plain(x), 30):.2f} ms, bit-equal {same}")  # fmt: skip
    got: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "rate": []} for k in ("packed", "plain")}
    prompts = rag_prompts(engine, Path(args.data_dir), args.prompts, 1300, 1420)
    for round_ in range(2):
        for rag in prompts:
            engine.clear_store()
            engine.precompute(rag.texts, rag.question)
            for kind in ("packed", "plain") if round_ == 0 else ("plain", "packed"):
                engine.model.lm_head = packed if kind == "packed" else plain
                m = engine.generate(rag.prompt, mode="blend", max_new_tokens=24).metrics
                got[kind]["ttft"].append(m.ttft_s)
                got[kind]["rate"].append((m.generated_tokens - 1) / max(m.decode_s, 1e-9))
    for kind, row in got.items():
        print(f"{kind}: warm TTFT median {statistics.median(row['ttft']):.3f} s, decoding median "
              f"{statistics.median(row['rate']):.1f} tokens/s")  # fmt: skip


if __name__ == "__main__":
    main()
