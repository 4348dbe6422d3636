"""Aten ops and host syncs per request on the GPU's path, counted on a CPU, for the default rule with a shorter first
pass (`BlendConfig(probe_depth=D)`): the shared tool `../shared/tools/opcount.py`'s own counter, engine and
prompt (a tiny 6-layer llama, 6 chunks of 70 words), over more modes than it lists. Deterministic. Run from the
project's root:

    python research/opcount_probe.py            # the host's "auto" precision
    python research/opcount_probe.py float32    # or name one (bfloat16: the GPU's)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "tools"))

import opcount  # noqa: E402
import torch  # noqa: E402

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)
opcount.gpu_path()
engine = CacheBlendEngine(
    make_tiny_model("llama", 0, num_layers=opcount.LAYERS, mute_eos=True),
    make_tiny_tokenizer(),
    config=EngineConfig(miss_policy="blend", dtype=sys.argv[1] if len(sys.argv) > 1 else "auto"),
)
chunks = [opcount.random_words(i, 70) for i in range(6)]
question = "w1 w2 w3 w4 w5"
engine.precompute(chunks, question)
engine.generate(chunks, question, max_new_tokens=1)
modes = [("full", dict(mode="full")), ("blend (default)", {})] + [
    (f"attention:{d}@0.15", dict(blend=BlendConfig(0.15, probe_depth=d))) for d in (0.5, 0.25)
]
for name, options in modes:
    first = opcount.count(engine, chunks, question, 1, **options)
    syncs = sum(v for k, v in first.items() if k in opcount.SYNC)
    print(f"{name:22s} {sum(first.values()) / opcount.LAYERS:8.1f} ops/layer {syncs:3d} syncs")
engine.close()
