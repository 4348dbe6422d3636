"""Where a CPU full prefill's time goes in bf16, against the FLOP floor, and what each faster path saves.

1. `profile`: torch.profiler over one full prefill (the model's own forward, as the engine's full mode runs it) of a
   RAG prompt of the peer benchmark (10 SQuAD paragraphs and a question, ~1,360 tokens): the linear products per
   layer by projection (told apart by their weight's shape), attention (SDPA's kernels), everything else; beside the
   FLOP count and the bf16 product rate measured here, which give the floor.
2. `variants`: in one process, alternated, median of --repeats: the plain model; its linears packed once for oneDNN
   (`models.packed.pack_linears`, what the engine does now); with --compile, the plain model under torch.compile's CPU
   inductor with freezing. Each one's logits are compared with the plain model's, bit for bit.
3. `attention`: the default model's own forward over --prompts prompts of the peer benchmark, packed, attending with
   torch's SDPA and with the engine's `blocked_attention`, alternated, median of --repeats rounds; and each one's
   next-token distribution against the float32 model's (KL, and whether the top token agrees).
4. `runtimes`: `variants` again in child processes under each OpenMP set-up: libgomp as torch ships it, libgomp with
   threads bound to cores (OMP_PROC_BIND, OMP_PLACES), libgomp's threads sleeping at once when idle
   (OMP_WAIT_POLICY=PASSIVE), Intel's libiomp5 preloaded (--iomp PATH) with vLLM's binding (KMP_AFFINITY,
   KMP_BLOCKTIME=5).
5. `fused`: what torch offers to fuse the rest, against the engine's eager path (packed, blocked attention): one
   layer's causal attention (the default model's heads, the prompt's length) as flex attention compiled by inductor's
   CPU template, as `blocked_attention` and as SDPA; then the whole forward under torch.compile (inductor, freezing)
   with blocked attention (no KV cache kept, both), alternated with the eager path, median of --repeats, and their
   logits' largest difference.

    python research/prefill_cpu_paths.py --data-dir DATA profile
    python research/prefill_cpu_paths.py --data-dir DATA variants --repeats 5 [--compile]
    python research/prefill_cpu_paths.py --data-dir DATA attention --prompts 10 --repeats 2
    python research/prefill_cpu_paths.py --data-dir DATA runtimes --iomp /path/to/vllm-venv/lib/libiomp5.so
    python research/prefill_cpu_paths.py --data-dir DATA fused --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from benchlib.cli import cpu_name  # noqa: E402
from benchlib.peers import rag_prompts  # noqa: E402
from benchlib.timing import median_ms  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from cacheblend_rag import CacheBlendEngine, EngineConfig  # noqa: E402
from cacheblend_rag.models import default_model, load_model  # noqa: E402
from cacheblend_rag.models.attention import BLOCKED_ATTENTION, blocked_attention, use_blocked_attention  # noqa: E402
from cacheblend_rag.models.packed import pack_linears  # noqa: E402

LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::linear", "mkldnn::_linear_pointwise")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention")  # fmt: skip


def full_prefill(model: torch.nn.Module, ids: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
    """The model's own forward over the prompt (the engine's full mode), -> the last token's logits."""
    with torch.inference_mode():
        return model(input_ids=ids[None], use_cache=use_cache, logits_to_keep=1).logits[0, -1]


def flops(model: torch.nn.Module, n: int) -> dict[str, float]:
    """Multiply-adds x 2 of one prefill of n tokens: the decoder's linear layers, causal attention, the last row's
    LM head."""
    cfg = model.config
    linear = sum(m.weight.numel() for layer in model.model.layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear))  # fmt: skip
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention = cfg.num_hidden_layers * 2 * n * n * cfg.num_attention_heads * head_dim  # QK^T and PV, half each
    return {"linear": 2 * linear * n, "attention": attention, "lm_head": 2 * model.lm_head.weight.numel()}


def product_rate(n: int = 1360, k: int = 896, m: int = 4864, repeats: int = 20) -> float:
    """bf16 FLOP/s of the largest product of a layer (n x k by k x m), packed for oneDNN: the ceiling used here."""
    x, w = torch.randn(n, k).bfloat16(), (torch.randn(m, k) * 0.05).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, n)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        times.append(time.perf_counter() - t0)
    return 2 * n * k * m / min(times)


def kind_of(shapes: list, names: dict[tuple[int, int], str]) -> str:
    """A linear op's projection, from its weight: the last 2-D input, [in, out] for mm and addmm (the weight
    transposed), [out, in] for linear."""
    weights = [tuple(s) for s in shapes if len(s) == 2]
    if not weights:
        return "?"
    in_out = weights[-1]
    return names.get(in_out[::-1], names.get(in_out, "?"))


def run_profile(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    names = {}
    layer = model.model.layers[0]
    for name, m in layer.named_modules():  # projections of one shape share a row: q and o, k and v, gate and up
        if isinstance(m, torch.nn.Linear):
            shape = tuple(m.weight.shape)
            names[shape] = "/".join(filter(None, (names.get(shape), name.split(".")[-1])))
    names[tuple(model.lm_head.weight.shape)] = "lm_head"
    full_prefill(model, ids)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        full_prefill(model, ids)
        wall = time.perf_counter() - t0
    by: dict[str, float] = defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in LINEAR_OPS:
            by["linear " + kind_of(e.input_shapes, names)] += e.self_cpu_time_total
        elif e.key in ATTENTION_OPS:
            by["attention"] += e.self_cpu_time_total
        else:
            by["other"] += e.self_cpu_time_total
    layers = model.config.num_hidden_layers
    table = {k: {"total_ms": v / 1e3, "per_layer_ms": v / 1e3 / layers} for k, v in sorted(by.items())}
    count, rate = flops(model, ids.shape[0]), product_rate()
    return {"wall_s": wall, "ops": table, "flops": count, "bf16_rate_flops": rate,
            "floor_s": sum(count.values()) / rate}  # fmt: skip


def run_variants(model: torch.nn.Module, ids: torch.Tensor, repeats: int, compiled: bool) -> dict:
    packed = copy.deepcopy(model)
    pack_linears(packed, None)
    variants = {"plain": model, "packed": packed}
    if compiled:
        import torch._inductor.config as inductor

        inductor.freezing = True
        variants["compiled (inductor, freezing)"] = torch.compile(copy.deepcopy(model))
    reference = full_prefill(model, ids)
    out = {}
    for name, m in variants.items():
        t0 = time.perf_counter()
        got = full_prefill(m, ids)  # warm-up (and, compiled, the compile)
        out[name] = {"first_call_s": time.perf_counter() - t0, "times": [],
                     "bit_equal": bool(torch.equal(got, reference)),
                     "max_abs_diff": float((got.float() - reference.float()).abs().max())}  # fmt: skip
    for _ in range(repeats):
        for name, m in variants.items():
            t0 = time.perf_counter()
            full_prefill(m, ids)
            out[name]["times"].append(time.perf_counter() - t0)
    for row in out.values():  # on a busy machine the best of the rounds is the steadier figure
        row["median_s"], row["best_s"] = statistics.median(row["times"]), min(row["times"])
    return out


def run_attention(plain: torch.nn.Module, prompts: list[torch.Tensor], repeats: int) -> dict:
    fp32 = load_model(default_model(), dtype="float32", show_progress=False)[0]
    model = copy.deepcopy(plain)
    pack_linears(model, None)
    use_blocked_attention(model)  # registers the kernel under BLOCKED_ATTENTION
    kinds = ("sdpa", BLOCKED_ATTENTION)
    out: dict = {k: {"times": [], "kl": [], "top_agrees": 0} for k in kinds}
    for i, ids in enumerate(prompts):
        reference = torch.log_softmax(full_prefill(fp32, ids).float(), -1)
        for kind in kinds:
            model.set_attn_implementation(kind)
            got = torch.log_softmax(full_prefill(model, ids).float(), -1)
            out[kind]["kl"].append(float((reference.exp() * (reference - got)).sum()))
            out[kind]["top_agrees"] += int(got.argmax() == reference.argmax())
        for r in range(repeats):
            for kind in kinds if (i + r) % 2 == 0 else kinds[::-1]:
                model.set_attn_implementation(kind)
                t0 = time.perf_counter()
                full_prefill(model, ids)
                out[kind]["times"].append(time.perf_counter() - t0)
    for row in out.values():
        row["median_s"], row["mean_kl"] = statistics.median(row["times"]), statistics.mean(row["kl"])
    return out


def run_fused(plain: torch.nn.Module, ids: torch.Tensor, repeats: int) -> dict:
    import torch._inductor.config as inductor
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cfg, n = plain.config, ids.shape[0]
    d = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    q = torch.randn(1, cfg.num_attention_heads, n, d).bfloat16()
    k, v = (torch.randn(1, cfg.num_key_value_heads, n, d).bfloat16() for _ in range(2))
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, n, n, device="cpu")
    flex = torch.compile(flex_attention, dynamic=False)
    t0 = time.perf_counter()
    flex(q, k, v, block_mask=mask, enable_gqa=True)
    layer = {"flex_compile_s": time.perf_counter() - t0}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        layer["flex_ms"] = median_ms(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True), warmup=3)
        layer["blocked_ms"] = median_ms(lambda: blocked_attention(q[0], k[0], v[0], None, d**-0.5), warmup=3)
        layer["sdpa_ms"] = median_ms(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), warmup=3)
    eager = copy.deepcopy(plain)
    pack_linears(eager, None)
    use_blocked_attention(eager)
    inductor.freezing = True
    compiled_model = copy.deepcopy(plain)
    use_blocked_attention(compiled_model)
    compiled = torch.compile(compiled_model, dynamic=False)
    # no KV cache kept, both ways: inductor fails on blocked attention's query view when the forward also fills a
    # DynamicCache (torch 2.13)
    t0 = time.perf_counter()
    got = full_prefill(compiled, ids, use_cache=False)
    forward: dict = {"compile_s": time.perf_counter() - t0, "compiled": [], "eager": []}
    reference = full_prefill(eager, ids, use_cache=False)
    forward["max_abs_logit_diff"] = float((got.float() - reference.float()).abs().max())
    for _ in range(repeats):
        for name, m in (("compiled", compiled), ("eager", eager)):
            t0 = time.perf_counter()
            full_prefill(m, ids, use_cache=False)
            forward[name].append(time.perf_counter() - t0)
    forward["compiled_median_s"] = statistics.median(forward["compiled"])
    forward["eager_median_s"] = statistics.median(forward["eager"])
    return {"layer_attention": layer, "forward": forward}


RUNTIMES = {
    "libgomp (torch's)": {},
    "libgomp, bound": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "libgomp, passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def run_runtimes(args: argparse.Namespace) -> dict:
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    setups = dict(RUNTIMES)
    if args.iomp:
        affinity = f"granularity=fine,explicit,proclist=[{cores}]"
        setups["libiomp5, bound"] = {"LD_PRELOAD": args.iomp, "KMP_AFFINITY": affinity, "KMP_BLOCKTIME": "5",
                                     "KMP_TPAUSE": "0"}  # fmt: skip
    out = {}
    for name, env in setups.items():
        cmd = [sys.executable, __file__, "--data-dir", args.data_dir, "--json", "variants", "--repeats",
               str(args.repeats)]  # fmt: skip
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])["variants"]
        print(name, {k: (round(v["median_s"], 3), round(v["best_s"], 3)) for k, v in out[name].items()}, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("CACHEBLEND_RAG_DATA"))
    p.add_argument("--json", action="store_true", help="print one JSON line only (for `runtimes`' children)")
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("profile")
    v = sub.add_parser("variants")
    v.add_argument("--repeats", type=int, default=5)
    v.add_argument("--compile", action="store_true")
    a = sub.add_parser("attention")
    a.add_argument("--prompts", type=int, default=10)
    a.add_argument("--repeats", type=int, default=2)
    f = sub.add_parser("fused")
    f.add_argument("--repeats", type=int, default=5)
    r = sub.add_parser("runtimes")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--iomp", help="libiomp5.so to preload (e.g. the intel-openmp wheel's)")
    args = p.parse_args()
    if args.what == "runtimes":
        result = run_runtimes(args)
    else:
        plain, tokenizer = load_model(default_model(), dtype="bfloat16", show_progress=False)  # nothing packed
        engine = CacheBlendEngine(copy.deepcopy(plain), tokenizer, config=EngineConfig(dtype="bfloat16"))
        count = args.prompts if args.what == "attention" else 1
        prompts = [p.prompt.input_ids() for p in rag_prompts(engine, Path(args.data_dir), count, 1300, 1420)]
        ids = prompts[0]
        del engine
        if args.what == "attention":
            result = {"attention": run_attention(plain, prompts, args.repeats)}
        elif args.what == "fused":
            result = run_fused(plain, ids, args.repeats)
        elif args.what == "profile":
            result = run_profile(plain, ids)
        else:
            result = {"variants": run_variants(plain, ids, args.repeats, args.compile)}
        result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "tokens": int(ids.shape[0]), **result}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
