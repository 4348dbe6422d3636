"""Does `torch.compile` make an int8 decode step faster on a CPU? And where does the step's time go?

    python research/compiled_decode_step.py --batches 1,8 --cache-tokens 3150 --repeats 20 --out /tmp/compiled

The engine's int8 decode step (`decode_weights="int8"`: `int8_decode_lm`, `BatchDecoder.step`) issues a few
thousand small PyTorch operations per step around its int8 products. Inductor (`torch.compile` on a CPU emits C++)
could fuse the norms, rotations, residual adds, the MLP's activation and the int8 inputs' row scaling into a few
kernels. Dynamo cannot trace fbgemm's packed weights (a TorchScript object: a graph break at every product), so
here each packed weight is reached through a custom op that takes a small integer tensor naming it. Per layer, the
part before attention (norm, fused q/k/v product, rotations) and the part after it (residual, norm, MLP) are
compiled, once for all layers (the layers differ only in their tensors); attention over each request's own cache
and the output projection stay as the engine runs them.

Measured as a paired A/B in one process, the engine's step and the compiled step alternating on caches of the same
length filled with random keys and values (timing does not depend on them), median of `--repeats`. Also the
step's floor: its int8 products alone, and its attention (with the output projection) alone. Reports the largest
logit difference between the compiled and the engine's step. Writes OUT/results.json and OUT/summary.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchlib.cli import cpu_name  # noqa: E402
from benchlib.timing import median_ms  # noqa: E402

from cacheblend_rag.engine.serving.batch_decode import BatchDecoder, DecodeCache  # noqa: E402
from cacheblend_rag.models import load_model  # noqa: E402
from cacheblend_rag.models.adapter import LayerwiseModel, rotate_keys  # noqa: E402
from cacheblend_rag.models.int8 import Int8Linear, int8_decode_lm  # noqa: E402

_PACKED: list[object] = []  # fbgemm's packed weights, named by their index


@torch.library.custom_op("cacheblend_research::int8_product", mutates_args=())
def int8_product(x: torch.Tensor, name: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, _PACKED[int(name)], True)


@int8_product.register_fake
def _(x: torch.Tensor, name: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class TraceableInt8Linear(torch.nn.Module):
    """`Int8Linear`'s arithmetic, with its packed weight reached through `int8_product` (which dynamo can trace)."""

    def __init__(self, linear: Int8Linear) -> None:
        super().__init__()
        _PACKED.append(linear.packed)
        self.register_buffer("name", torch.tensor(len(_PACKED) - 1), persistent=False)
        self.bias, self.out_features, self.out_dtype = linear.bias, linear.out_features, linear.out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        size = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        ends = torch.tensor([1.0, -1.0]).expand(rows.shape[0], 2)
        y = int8_product(torch.cat([rows / size, ends], dim=1), self.name, self.out_features) * size
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype).view(*shape[:-1], self.out_features)


def traceable(module: torch.nn.Module) -> torch.nn.Module:
    for name, child in list(module.named_children()):
        if isinstance(child, Int8Linear):
            setattr(module, name, TraceableInt8Linear(child))
        else:
            traceable(child)
    return module


class CompiledStep:
    """`BatchDecoder.step` with each layer's work before and after attention compiled (see the module docstring)."""

    def __init__(self, lm: LayerwiseModel) -> None:
        self.lm = lm
        s = lm.shape
        self.split = [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        self.before = torch.compile(self._before, dynamic=True)
        self.after = torch.compile(self._after, dynamic=True)

    def _before(self, layer, qkv, hidden, cos, sin):
        x = layer.input_layernorm(hidden)
        t, d = x.shape[0], self.lm.shape.head_dim
        q, k, v = (part.view(t, -1, d).transpose(0, 1) for part in qkv(x).split(self.split, -1))
        return rotate_keys(q, cos, sin), rotate_keys(k, cos, sin), v

    @staticmethod
    def _after(layer, hidden, attn_out):
        hidden = hidden + attn_out
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    @torch.inference_mode()
    def step(self, tokens: list[int], caches: list[DecodeCache]) -> torch.Tensor:
        lm = self.lm
        hidden = lm.embed(torch.tensor(tokens))
        cos, sin = lm.rope(torch.tensor([c.length for c in caches]))
        for i, layer in enumerate(lm.layers):
            q, k, v = self.before(layer, lm.fused_qkv[i], hidden, cos, sin)
            per_request = [c.put(i, k[:, b], v[:, b]) for b, c in enumerate(caches)]
            hidden = self.after(layer, hidden, lm.attend_each(i, q, per_request))
        for c in caches:
            c.advance()
        return lm.logits(hidden)


def random_prompt_caches(lm: LayerwiseModel, batch: int, length: int) -> list[DynamicCache]:
    """One prompt's cache of random keys and values per request (a `DecodeCache` copies it into its own buffers)."""
    s = lm.shape
    out = []
    for _ in range(batch):
        cache = DynamicCache()
        for i in range(s.num_layers):
            kv = torch.randn(2, 1, s.num_kv_heads, length, s.head_dim)
            cache.update(kv[0], kv[1], i)
        out.append(cache)
    return out


@torch.inference_mode()
def floor(lm: LayerwiseModel, batch: int, length: int, repeats: int) -> dict[str, float]:
    """The step's int8 products alone (q/k/v, MLP, LM head), and its attention with the output projection alone."""
    s = lm.shape
    x = torch.randn(batch, s.hidden_size)
    kv = [(torch.randn(s.num_kv_heads, length, s.head_dim), torch.randn(s.num_kv_heads, length, s.head_dim))] * batch
    q = torch.randn(s.num_heads, batch, s.head_dim)

    def products():
        for i, layer in enumerate(lm.layers):
            lm.fused_qkv[i](x)
            layer.mlp(x)
        lm.model.lm_head(x)

    def attention():
        for i in range(s.num_layers):
            lm.attend_each(i, q, kv)

    return {
        "int8_products_ms": median_ms(products, repeats, warmup=0),
        "attention_and_o_proj_ms": median_ms(attention, repeats, warmup=0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a preset or path (default: the default model)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--cache-tokens", type=int, default=3150)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="research/results/compiled_decode")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype="float32", show_progress=False)
    engine_lm = int8_decode_lm(model)
    eager = BatchDecoder(engine_lm)
    compiled_lm = int8_decode_lm(model)
    traceable(compiled_lm.model)
    compiled = CompiledStep(LayerwiseModel(compiled_lm.model, compiled_lm.model.fused_qkv))  # traceable copies now
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts, room = random_prompt_caches(engine_lm, batch, args.cache_tokens), args.repeats + 4
        caches = [DecodeCache(c, args.cache_tokens, args.cache_tokens + room) for c in prompts]
        twins = [DecodeCache(c, args.cache_tokens, args.cache_tokens + room) for c in prompts]  # the same KV
        tokens = list(range(1000, 1000 + batch))
        started = time.perf_counter()
        compiled_logits = compiled.step(tokens, twins)
        compile_s = time.perf_counter() - started
        difference = float((compiled_logits - eager.step(tokens, caches)).abs().max())
        eager_ms, compiled_ms = [], []
        for _ in range(args.repeats):  # alternating, so drifts of the machine's speed fall on both alike
            eager_ms.append(median_ms(functools.partial(eager.step, tokens, caches), 1, warmup=0))
            compiled_ms.append(median_ms(functools.partial(compiled.step, tokens, twins), 1, warmup=0))
        row = {"batch": batch, "cache_tokens": args.cache_tokens, "first_compiled_step_s": compile_s,
               "eager_ms": statistics.median(eager_ms), "compiled_ms": statistics.median(compiled_ms),
               "max_logit_difference": difference}  # fmt: skip
        row |= floor(engine_lm, batch, args.cache_tokens, args.repeats)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__, "rows": rows}
    (out / "results.json").write_text(json.dumps(run, indent=2))
    lines = [f"CPU: {run['cpu']}, {args.threads} threads, torch {torch.__version__}; int8 decode weights, default "
             f"model unless --model; caches of {args.cache_tokens} tokens.", "",
             "| requests | engine step (ms) | compiled step (ms) | engine / compiled | int8 products alone (ms) | "
             "attention + o_proj alone (ms) | the rest of the engine step (ms) | max logit difference |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        rest = r["eager_ms"] - r["int8_products_ms"] - r["attention_and_o_proj_ms"]
        lines.append(f"| {r['batch']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
                     f"{r['eager_ms'] / r['compiled_ms']:.2f}x | {r['int8_products_ms']:.1f} | "
                     f"{r['attention_and_o_proj_ms']:.1f} | {rest:.1f} | "
                     f"{r['max_logit_difference']:.3g} |")  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
