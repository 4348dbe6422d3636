"""What `Int8Linear`'s batch-invariant wrapper costs a CPU decode step, beside the int8 kernels it wraps.

The default model's int8 decode copies (fused q/k/v and gate/up: 97 products a step, ~494 MB of int8 weights, far
more than the CPU's caches, so each pass reads them from memory as a decode step does) are run one row at a time
in layer order, three ways, alternated: fbgemm's kernel alone on a ready input, `Int8Linear` as it is, and the
wrapper with the row's largest magnitude taken by `linalg.vector_norm(inf)` (what it did before `abs().amax()`).
Each pass's outputs are checked bit for bit against `Int8Linear`'s. Prints the medians of --rounds passes, in ms
for a step's 97 products.

    python research/int8_wrapper_cost.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from benchlib.cli import cpu_name  # noqa: E402

from cacheblend_rag import CacheBlendEngine  # noqa: E402
from cacheblend_rag.models.int8 import Int8Linear, int8_decode_model, pinned_rows  # noqa: E402


def with_vector_norm(lin: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """`Int8Linear.forward` as it was: the row's largest magnitude as its infinity norm."""
    rows = x.reshape(-1, x.shape[-1]).float()
    size = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True).clamp_min_(1e-12)
    pinned, body = pinned_rows(rows.shape[0], lin.in_features)
    torch.div(rows, size, out=body)
    y = torch.ops.quantized.linear_dynamic(pinned, lin.packed, True).mul_(size)
    if lin.bias is not None:
        y.add_(lin.bias)
    return y.to(lin.out_dtype).view(*x.shape[:-1], lin.out_features)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=25)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model = CacheBlendEngine.from_pretrained(args.model, show_progress=False).model
    decode = int8_decode_model(model, fuse=True)
    products: list[Int8Linear] = []
    for i, layer in enumerate(decode.model.layers):
        products += [decode.fused_qkv[i], layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down]
    products.append(decode.lm_head)
    with torch.inference_mode():
        inputs = [torch.randn(1, lin.in_features, dtype=model.dtype) for lin in products]
        for lin, x in zip(products, inputs, strict=True):
            assert torch.equal(lin(x), with_vector_norm(lin, x)), "the two wrappers must give the same bits"

        def kernels() -> None:
            for lin in products:
                pinned, _ = pinned_rows(1, lin.in_features)
                torch.ops.quantized.linear_dynamic(pinned, lin.packed, True)

        def now() -> None:
            for lin, x in zip(products, inputs, strict=True):
                lin(x)

        def before() -> None:
            for lin, x in zip(products, inputs, strict=True):
                with_vector_norm(lin, x)

        runs: dict[str, list[float]] = {"kernels alone": [], "Int8Linear (abs().amax())": [], "vector_norm(inf)": []}
        passes = dict(zip(runs, (kernels, now, before), strict=True))
        for run in passes.values():
            run()  # warm
        for _ in range(args.rounds):
            for name, run in passes.items():
                t0 = time.perf_counter()
                run()
                runs[name].append(time.perf_counter() - t0)
    weights_mb = sum(lin.in_features * lin.out_features for lin in products) / 1e6
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {model.dtype}; {len(products)} int8 products, "
          f"{weights_mb:.0f} MB of int8 weights; medians of {args.rounds} alternated passes")  # fmt: skip
    for name, times in runs.items():
        print(f"{name:<28} {statistics.median(times) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
