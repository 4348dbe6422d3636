"""Launches per prefill layer on the GPU's path with the row-wise layer halves replayed as CUDA graphs, counted on a
CPU: the shared counter's engine and request (`../shared/tools/opcount.py`), its prefill ops per layer with the eager
layers beside the same with `GraphedLayerSteps` (padded rows run eagerly here), where every op inside a captured half
counts as what a replay costs the host: one launch. Deterministic. Run from the project's root:

    python research/opcount_graphed.py            # the host's "auto" precision
    python research/opcount_graphed.py bfloat16   # as on a GPU
"""

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "tools"))

import opcount  # noqa: E402

from cacheblend_rag import BlendConfig, CacheBlendEngine, EngineConfig, cpu  # noqa: E402
from cacheblend_rag.fusion import GraphedLayerSteps  # noqa: E402
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words  # noqa: E402

if len(sys.argv) > 1:
    if sys.argv[1] not in ("float32", "bfloat16"):
        sys.exit(f"usage: python {sys.argv[0]} [float32|bfloat16]")
    bf16 = sys.argv[1] == "bfloat16"
    cpu.cpu_has_bf16 = lambda: bf16  # what "auto" reads (config/dtype.py)


def is_view(func) -> bool:
    """An op whose result aliases its input without writing it (slice, transpose, view...): host work only, no
    kernel on a GPU."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class Launches(opcount.Count):
    """Counts aten ops, an op inside a captured half counting as nothing and the half itself as one launch; the
    views among them under "(views)" too."""

    inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if Launches.inside:
            return func(*args, **(kwargs or {}))
        if is_view(func):
            self.views += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __init__(self):
        super().__init__()
        self.views = 0


def as_one_launch(run):
    def replayed(self, layer_idx):
        Launches.inside += 1
        try:
            run(self, layer_idx)
        finally:
            Launches.inside -= 1
        for mode in ACTIVE:
            mode.ops["graph replay"] += 1

    return replayed


ACTIVE: list[Launches] = []


def count(engine, chunks, question, **options) -> tuple[collections.Counter, int]:
    """-> (ops by name, how many of them were views)"""
    mode = Launches()
    ACTIVE.append(mode)
    try:
        with mode:
            engine.generate(chunks, question, max_new_tokens=1, stop=[], **options)
    finally:
        ACTIVE.remove(mode)
    return mode.ops, mode.views


def main() -> int:
    torch.set_num_threads(1)
    opcount.gpu_path()
    model = make_tiny_model("llama", 0, num_layers=opcount.LAYERS, mute_eos=True)
    engine = CacheBlendEngine(model, make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend"))
    chunks = [random_words(i, 70) for i in range(6)]
    question = "w1 w2 w3 w4 w5"
    engine.precompute(chunks, question)
    graphed = GraphedLayerSteps(engine.lm, capture=False)
    bucket = type(graphed.bucket(1))
    bucket.run_qkv, bucket.run_finish = as_one_launch(bucket.run_qkv), as_one_launch(bucket.run_finish)
    modes = [("full", dict(mode="full")), ("reuse", dict(mode="reuse")), ("blend (default)", {}),
             ("blend paper@0.15", dict(blend=BlendConfig(rule="paper", recompute_ratio=0.15)))]  # fmt: skip
    print("dtype:", engine.config.dtype)
    print("per layer: all aten ops, and in brackets those that are not views (kernels on a GPU)")
    print(f"{'mode':18s} {'eager':>16s} {'graphed':>16s} {'graph replays':>14s}")
    for name, options in modes:
        engine.prefiller.steps = None
        engine.generate(chunks, question, max_new_tokens=1, **options)  # warm
        eager, eager_views = count(engine, chunks, question, **options)
        engine.prefiller.steps = graphed
        engine.generate(chunks, question, max_new_tokens=1, **options)  # warm: the buckets are made (captured)
        launches, views = count(engine, chunks, question, **options)
        layers, e, g = opcount.LAYERS, sum(eager.values()), sum(launches.values())
        print(f"{name:18s} {e / layers:7.1f} ({(e - eager_views) / layers:5.1f}) {g / layers:7.1f} "
              f"({(g - views) / layers:5.1f}) {launches['graph replay'] / layers:14.1f}")  # fmt: skip
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
