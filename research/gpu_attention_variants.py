"""Which attention call is fastest for the blend's scattered queries, and for a batch of decode steps, on a GPU.

    python research/gpu_attention_variants.py --out research/results/gpu_attention

The default blend ("attention" rule) recomputes ~15% of the chunk tokens, scattered over the prompt, on every
layer; each attends causally (by position) to all N keys. The fusor does that in one SDPA call under an [A, N]
mask, which PyTorch runs on its memory-efficient kernel, scoring every key (no block skipping). This times, for
one layer's shapes of a Llama-2-7B (32 heads of 128, bf16), the alternatives:
  bool mask / additive mask / additive mask over keys padded to a multiple of 16 (the kernel's alignment; an
  unaligned mask is copied to a padded one on every call) / flex_attention with a block mask (skips key blocks
  no query of a block sees; compiled once) / position blocks of 512 (the CPU path) / the full causal square.
And for decoding: B requests with caches of B different lengths, one SDPA call each (the engine's `attend_each`)
against one batched call over a padded [B, Nmax] cache under a length mask.
Median of CUDA-event timings after warm-up; results also as JSON in --out. Random data: timing does not depend on
values, but each variant's output is checked against the bool-mask call.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

DEV = torch.device("cuda")


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` calls, after three warm-up calls (wall clock on a CPU)."""
    for _ in range(3):
        fn()
    times = []
    if DEV.type == "cpu":
        import time

        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t))
        return statistics.median(times)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def blend_variants(n: int, share: float, heads: int, dim: int, repeats: int) -> dict[str, dict[str, float]]:
    dev, dt = DEV, torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    picked = torch.randperm(n - 24, generator=g)[: int(share * (n - 24))]
    q_pos = torch.cat([picked.sort().values, torch.arange(n - 24, n)]).to(dev)  # + the question, at the end
    a = q_pos.numel()
    k_pos = torch.arange(n, device=dev)
    q = torch.randn(1, heads, a, dim, device=dev, dtype=dt)
    k = torch.randn(1, heads, n, dim, device=dev, dtype=dt)
    v = torch.randn(1, heads, n, dim, device=dev, dtype=dt)
    allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [A, N]
    additive = torch.zeros(a, n, device=dev, dtype=dt).masked_fill_(~allowed, float("-inf"))
    n16 = -(-n // 16) * 16
    padded_store = torch.full((a, n16), float("-inf"), device=dev, dtype=dt)
    padded_store[:, :n] = additive
    aligned_view = padded_store[:, :n]  # aligned rows, last dim n
    k16 = torch.zeros(1, heads, n16, dim, device=dev, dtype=dt)
    k16[:, :, :n] = k
    v16 = torch.zeros_like(k16)
    v16[:, :, :n] = v

    def sdpa(mask, kk=k, vv=v):
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[None, None])

    variants = {
        "bool mask": lambda: sdpa(allowed),
        "additive mask": lambda: sdpa(additive),
        "additive, aligned rows": lambda: sdpa(aligned_view),
        "additive, keys padded to 16": lambda: sdpa(padded_store, k16, v16),
    }

    def blocks():
        outs, start = [], 0
        ids = torch.div(q_pos, 512, rounding_mode="floor")
        for size in torch.unique_consecutive(ids, return_counts=True)[1].tolist():
            qp = q_pos[start : start + size]
            end = int(qp[-1]) + 1
            m = k_pos[:end].unsqueeze(0) <= qp.unsqueeze(1)
            outs.append(F.scaled_dot_product_attention(q[:, :, start : start + size], k[:, :, :end], v[:, :, :end],
                                                       attn_mask=m[None, None]))  # fmt: skip
            start += size
        return torch.cat(outs, dim=2)

    variants["position blocks of 512"] = blocks
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)

        def mask_mod(b, h, qi, ki):
            return ki <= q_pos[qi]

        block_mask = create_block_mask(mask_mod, None, None, a, n, device=dev)
        variants["flex_attention, block mask"] = lambda: flex(q, k, v, block_mask=block_mask)
    except Exception as exc:  # noqa: BLE001 - reported, the other variants still run
        print(f"flex_attention unavailable: {type(exc).__name__}: {exc}")
    reference = sdpa(allowed)
    rows = {}
    for name, fn in variants.items():
        try:
            err = (fn().float() - reference.float()).abs().max().item()
            rows[name] = {"ms": round(timed(fn, repeats), 3), "max_abs_diff": round(err, 4)}
        except Exception as exc:  # noqa: BLE001
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(f"  blend N={n} A={a}  {name:<30} {rows[name]}")
    qs = torch.randn(1, heads, n, dim, device=dev, dtype=dt)
    rows["full causal square (N queries)"] = {
        "ms": round(timed(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True), repeats), 3)
    }
    print(f"  blend N={n}          full causal square             {rows['full causal square (N queries)']}")
    return rows


def decode_variants(n: int, batch: int, heads: int, dim: int, repeats: int) -> dict[str, dict[str, float]]:
    dev, dt = DEV, torch.bfloat16
    lengths = [n + 37 * b for b in range(batch)]
    nmax = max(lengths)
    cache_k = torch.randn(batch, heads, nmax, dim, device=dev, dtype=dt)
    cache_v = torch.randn(batch, heads, nmax, dim, device=dev, dtype=dt)
    q = torch.randn(batch, heads, 1, dim, device=dev, dtype=dt)
    lens = torch.tensor(lengths, device=dev)
    mask = torch.zeros(batch, 1, 1, nmax, device=dev, dtype=dt).masked_fill_(
        torch.arange(nmax, device=dev)[None, None, None] >= lens[:, None, None, None], float("-inf")
    )

    def each():
        outs = [
            F.scaled_dot_product_attention(q[b : b + 1], cache_k[b : b + 1, :, :ln], cache_v[b : b + 1, :, :ln])
            for b, ln in enumerate(lengths)
        ]
        return torch.cat(outs)

    def batched():
        return F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)

    rows = {}
    reference = each()
    for name, fn in (("one call per request", each), ("one batched call, length mask", batched)):
        err = (fn().float() - reference.float()).abs().max().item()
        rows[name] = {"ms": round(timed(fn, repeats), 3), "max_abs_diff": round(err, 4)}
        print(f"  decode B={batch} N~{n}  {name:<30} {rows[name]}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="3100,7708")
    p.add_argument("--share", type=float, default=0.15)
    p.add_argument("--batches", default="8,32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("research/results/gpu_attention"))
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = p.parse_args()
    global DEV
    DEV = torch.device(args.device)
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "blend": {}, "decode": {}}
    print(f"{report['device']}, torch {report['torch']}; 32 heads x 128, bf16; median ms of {args.repeats}")
    for n in (int(x) for x in args.lengths.split(",")):
        report["blend"][n] = blend_variants(n, args.share, 32, 128, args.repeats)
        for b in (int(x) for x in args.batches.split(",")):
            report["decode"][f"{n}x{b}"] = decode_variants(n, b, 32, 128, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_attention.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
