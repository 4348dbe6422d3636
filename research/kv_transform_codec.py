"""Stored chunk KV in a fitted basis: how many bits, at what cost in fidelity, and what coding the in-context entry
against the isolated one would save (the study behind `store/transform_codec.py`).

    python research/kv_transform_codec.py collect --data-dir DATA --out /tmp/kv.pt     # entries of 3 cases per set
    python research/kv_transform_codec.py rates /tmp/kv.pt                              # bits per variant, delta
    python research/kv_transform_codec.py entropy /tmp/kv.pt                            # what a coder could save
    python research/kv_transform_codec.py screen NAME:p|w:RHO_K:RHO_V,... -- FIDELITY ARGS
    python research/kv_transform_codec.py divergence NAME:p:RHO_K:RHO_V,... --data-dir DATA [--cases 10]
    python research/kv_transform_codec.py steps RHO_K:RHO_V [fidelity|codec_bytes] -- ARGS   # pca at other steps

Variants: `p` each head's principal axes with one step per layer (the product's); `w` the axes of the KV weighted by
what an error costs (keys by their queries' energy per RoPE pair, values by the output projection), one step per
kind over all layers. Both are fitted on the packaged calibration text. `screen` runs `benchmarks/fidelity.py` with
each variant as a lossy memory codec (the KV rounded and restored; its bits measured by `rates`), e.g.
`--datasets wikimqa,samsum --rules attention --ratios 0.15 --no-reuse --kv-codec pB,pC --limit 8`.
`divergence` measures each variant against exact KV directly: KL(first answer token's distribution read from exact KV
|| read from the variant's), at full reuse and at r = 0.15, per case of every set; unlike each one's KL to full
prefill, it grows with the rounding error instead of moving a case's distance to full either way.
"""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path
from types import MappingProxyType

import torch
import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def collect(data_dir: str, out: str, per_set: int = 3) -> None:
    """The entries grouped precompute stores for the first cases of each set, in order: (set, key, keys, values)."""
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.evaluation.datasets import load_dataset
    from cacheblend_rag.store import MemoryStore

    kept: list[tuple[str, object]] = []
    current = [""]

    class Kept(MemoryStore):
        def put(self, kv):  # noqa: ANN001
            kept.append((current[0], kv))
            super().put(kv)

    engine = CacheBlendEngine.from_pretrained(store=Kept(64 * 2**30), show_progress=False)
    for name in ("musique", "wikimqa", "samsum", "multi_news"):
        current[0] = name
        for case in load_dataset(name, data_dir, limit=per_set).cases:
            engine.precompute(list(case.chunks), case.question)
    torch.save([(s, kv.key, kv.keys, kv.values) for s, kv in kept], out)


def fit(kind_of: str, rho_k: float, rho_v: float) -> dict[tuple[int, int, int], tuple]:
    """(layer, kind, head) -> (mean, into, back, step) of a variant, fitted on the calibration text."""
    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.engine.chunks.calibrate import calibration_kv, calibration_paragraphs
    from cacheblend_rag.engine.request.prompt import encode, tokenize_prefix

    engine = CacheBlendEngine.from_pretrained(show_progress=False)
    lm, tok = engine.lm, engine.tokenizer
    prefix = tokenize_prefix(tok, engine.template.render_parts(tok, "?")[0])
    keys, values = (x.double() for x in calibration_kv(lm, tok, prefix))
    L, H, _, D = keys.shape
    weights = None
    if kind_of == "w":  # what an error costs: queries' energy per RoPE pair (keys), the output projection (values)
        energy = torch.zeros(L, lm.shape.num_heads, D, dtype=torch.float64)
        with torch.inference_mode():
            for paragraph in calibration_paragraphs():
                ids = torch.tensor([[*prefix, *encode(tok, paragraph)]])
                hidden = engine.model(ids, output_hidden_states=True).hidden_states
                for layer in range(L):
                    q = lm.project_raw_qkv(layer, lm.normed_input(layer, hidden[layer][0]))[0]
                    energy[layer] += q[:, len(prefix) :].double().pow(2).sum(1)
        group = lm.shape.num_heads // H
        per_head = energy.view(L, H, group, D).sum(2)
        paired = (per_head[..., : D // 2] + per_head[..., D // 2 :]) / 2
        key_w = torch.diag_embed(torch.cat([paired, paired], -1))
        value_w = torch.stack([
            torch.einsum("ohgd,ohge->hde", *(lm.layers[i].self_attn.o_proj.weight.detach().double()
                                             .view(-1, H, group, D),) * 2)
            for i in range(L)
        ])  # fmt: skip
        weights = (key_w, value_w)
    mats, variances = {}, {}
    for kind, (x, rho) in enumerate(((keys, rho_k), (values, rho_v))):
        for layer in range(L):
            for h in range(H):
                mu = x[layer, h].mean(0)
                into = back = torch.eye(D, dtype=torch.float64)
                if weights is not None:
                    e, q = torch.linalg.eigh(weights[kind][layer, h])
                    e = e.clamp_min(e.max() * 1e-6)
                    into, back = (q * e.sqrt()) @ q.T, (q * e.rsqrt()) @ q.T
                y = (x[layer, h] - mu) @ into
                axes = torch.linalg.eigh(torch.cov(y.T))[1]
                mats[layer, kind, h] = [mu.float(), (into @ axes).float(), (axes.T @ back).float(), rho]
                variances[layer, kind, h] = float(y.var(0).mean())
    for key, m in mats.items():
        mean_var = [v for k, v in variances.items() if k[1] == key[1]]
        ref = sum(mean_var) / len(mean_var) if weights is not None else variances[key]
        m[3] = math.sqrt(12 * m[3] * ref)
    return mats


class Lossy:
    """A variant as a memory codec: the KV rounded in its basis and restored, stored in the compute dtype."""

    def __init__(self, name: str, mats: dict) -> None:
        self.name, self.mats = name, mats

    def payload_spec(self, shape, dtype):  # noqa: ANN001
        from cacheblend_rag.store.codec import PayloadSpec

        return PayloadSpec(dtype, tuple(shape), tuple(shape))

    def codes(self, x: torch.Tensor, layer: int, kind: int) -> list[torch.Tensor]:
        out = []
        for h in range(x.shape[0]):
            mu, into, _, step = self.mats[layer, kind, h]
            out.append(torch.round((x[h].float() - mu) @ into / step))
        return out

    def restore(self, x: torch.Tensor, layer: int, kind: int) -> torch.Tensor:
        out = torch.empty_like(x)
        for h, z in enumerate(self.codes(x, layer, kind)):
            mu, _, back, step = self.mats[layer, kind, h]
            out[h] = ((z * step) @ back + mu).to(x.dtype)
        return out

    def encode(self, k, v, layer):  # noqa: ANN001
        return self.restore(k, layer, 0), self.restore(v, layer, 1)

    def decode(self, key_payload, value_payload, shape, dtype, layer):  # noqa: ANN001
        return key_payload.view(shape), value_payload.view(shape)


def zstd_bits(codes: torch.Tensor) -> int:
    return 8 * len(zstandard.ZstdCompressor(level=3).compress(codes.clamp(-127, 127).to(torch.int8).numpy().tobytes()))


def grouped_bits(codes: torch.Tensor) -> int:
    """Codes [H, T, D] (components in rising variance, as `fit` orders them) as the `pca` codec frames them: one zstd
    frame per group of component ranks counted from the largest (`component_groups`), each component-major."""
    from cacheblend_rag.store.transform_codec import component_groups

    falling = codes.flip(-1)
    groups = component_groups(codes.shape[-1])
    return sum(zstd_bits(falling[..., a:b].transpose(1, 2).contiguous()) for a, b in groups)


def rates(path: str, specs: str) -> None:
    """Bits per stored value of each variant on the collected entries, and of the in-context entries coded as the
    difference of their codes from their isolated entry's (the pairs: same tokens, layer-0 keys equal)."""
    data = torch.load(path)
    pairs, used = [], set()
    for i, a in enumerate(data):
        for j in range(i + 1, len(data)):
            b = data[j]
            if {i, j} & used or a[2].shape != b[2].shape:
                continue
            if float((a[2][0].float() - b[2][0].float()).abs().max()) < 0.05 * float(a[2][0].float().abs().max()):
                pairs.append((i, j))
                used |= {i, j}
                break
    print(f"{len(data)} entries, {len(pairs)} isolated / in-context pairs")
    for spec in specs.split(","):
        name, kind_of, rk, rv = spec.split(":")
        codec = Lossy(name, fit(kind_of, float(rk), float(rv)))
        alone = delta = n = 0
        grouped = torch.zeros(2, 2)  # [keys / values, the entry alone / against its isolated one]
        for i, j in pairs[:20]:
            for layer in range(data[i][2].shape[0]):
                for kind in (0, 1):
                    a = torch.stack(codec.codes(data[i][2 + kind][layer], layer, kind))
                    b = torch.stack(codec.codes(data[j][2 + kind][layer], layer, kind))
                    alone += zstd_bits(b.transpose(1, 2).contiguous())
                    delta += zstd_bits((b - a).transpose(1, 2).contiguous())
                    grouped[kind] += torch.tensor([grouped_bits(b), grouped_bits(b - a)])
                    n += b.numel()
        g = grouped / (n / 2)  # per value of each kind
        print(f"{name}: {alone / n:.3f} bits per stored value; the in-context entry against the isolated one "
              f"{delta / n:.3f}; a frame per group of components {g.mean(0)[0]:.3f} and {g.mean(0)[1]:.3f} "
              f"(keys {g[0, 0]:.3f} / {g[0, 1]:.3f}, values {g[1, 0]:.3f} / {g[1, 1]:.3f})")  # fmt: skip


def entropy(path: str, spec: str = "p1:p:0.0007:0.0014") -> None:
    """Against zstd over one frame per layer, on every third collected entry (40): the static entropy of each
    (layer, kind, head, component)'s codes pooled over the entries (what an ideal coder with fixed tables would
    reach), and zstd over the codes' differences from one token to the next (CacheGen's token locality)."""
    data = torch.load(path)[::3][:40]
    name, kind_of, rk, rv = spec.split(":")
    codec = Lossy(name, fit(kind_of, float(rk), float(rv)))
    plain = tokens = ideal = n = 0
    for layer in range(data[0][2].shape[0]):
        for kind in (0, 1):
            per_entry = [torch.stack(codec.codes(d[2 + kind][layer], layer, kind)).transpose(1, 2) for d in data]
            for c in per_entry:  # [H, D, T]
                plain += zstd_bits(c.contiguous())
                tokens += zstd_bits(torch.cat([c[..., :1], c.diff(dim=-1)], -1).contiguous())
            pooled = torch.cat(per_entry, dim=-1)
            for row in pooled.reshape(-1, pooled.shape[-1]):
                p = torch.unique(row, return_counts=True)[1].double() / row.numel()
                ideal += float(-(p * p.log2()).sum()) * row.numel()
            n += pooled.numel()
    print(f"{name}, {len(data)} entries: zstd {plain / n:.3f} bits per value, over token differences "
          f"{tokens / n:.3f}, static entropy per component {ideal / n:.3f}")  # fmt: skip


def screen(specs: str, fidelity_args: list[str]) -> None:
    import benchlib.fidelity_run as fidelity_run

    import cacheblend_rag.config.store_config as store_config
    import cacheblend_rag.store.codec as codec_module

    codecs = dict(codec_module.CODECS)
    for spec in specs.split(","):
        name, kind_of, rk, rv = spec.split(":")
        codecs[name] = Lossy(name, fit(kind_of, float(rk), float(rv)))
    codec_module.CODECS = MappingProxyType(codecs)
    store_config.CODEC_NAMES = tuple(codecs)
    fidelity_run.CODECS = codec_module.CODECS
    sys.argv = ["fidelity.py", *fidelity_args]
    runpy.run_path(str(ROOT / "benchmarks" / "fidelity.py"), run_name="__main__")


def steps(rel_mse: str, bench: str, args: list[str]) -> None:
    """`benchmarks/<bench>.py` (fidelity or codec_bytes) with the product's `pca` calibrated to other steps (its
    `REL_MSE`), e.g. `steps 0.0028:0.0028 -- --datasets multi_news --rules attention --ratios 0.15 --kv-codec pca`."""
    from cacheblend_rag.store.transform_codec import KVCalibration

    KVCalibration.fit.__func__.__defaults__ = (tuple(float(x) for x in rel_mse.split(":")),)
    sys.argv = [f"{bench}.py", *args]
    runpy.run_path(str(ROOT / "benchmarks" / f"{bench}.py"), run_name="__main__")


def divergence(specs: str, data_dir: str, cases: int, ratio: float = 0.15) -> None:
    """Per set and variant, the mean KL(exact || variant) of the first answer token [95% CI] at full reuse and at
    `ratio`, then the per-case agreement of the variants' divergences (Spearman)."""
    from statistics import mean

    from cacheblend_rag import CacheBlendEngine
    from cacheblend_rag.evaluation.datasets import load_dataset
    from cacheblend_rag.evaluation.fidelity import bootstrap_ci
    from cacheblend_rag.store import MemoryStore

    exact = CacheBlendEngine.from_pretrained(show_progress=False)
    variants = {}
    for spec in specs.split(","):
        name, kind_of, rk, rv = spec.split(":")
        store = MemoryStore(64 * 2**30, codec=Lossy(name, fit(kind_of, float(rk), float(rv))))
        variants[name] = CacheBlendEngine(exact.model, exact.tokenizer, config=exact.config, store=store)
    modes = {"reuse": ("reuse", None), f"r={ratio}": ("blend", ratio)}
    found: dict[tuple[str, str, str], list[float]] = {}
    for set_name in ("multi_news", "musique", "samsum", "wikimqa"):
        for case in load_dataset(set_name, data_dir, limit=cases).cases:
            exact.clear_store()
            exact.precompute(list(case.chunks), case.question)
            prompt = exact.build_prompt(list(case.chunks), case.question)
            for engine in variants.values():
                engine.clear_store()
                for key in exact.prompt_keys(prompt):
                    kv = exact.store.get(key)
                    if kv is not None:
                        engine.store.put(kv)
            for label, (mode, r) in modes.items():
                want = exact.prefill(prompt, mode, recompute_ratio=r).logits.float().log_softmax(-1)
                for name, engine in variants.items():
                    got = engine.prefill(prompt, mode, recompute_ratio=r).logits.float().log_softmax(-1)
                    kl = float((want.exp() * (want - got)).sum())
                    found.setdefault((label, set_name, name), []).append(kl)
                    found.setdefault((label, "all", name), []).append(kl)
    for label in modes:
        print(f"\nKL(exact || variant) of the first answer token, {label}, mean [95% CI]")
        print("| set | " + " | ".join(variants) + " |")
        for set_name in ("multi_news", "musique", "samsum", "wikimqa", "all"):
            cells = []
            for name in variants:
                values = found[label, set_name, name]
                lo, hi = bootstrap_ci(values)
                cells.append(f"{mean(values):.4f} [{lo:.4f}, {hi:.4f}]")
            print(f"| {set_name} ({len(values)}) | " + " | ".join(cells) + " |")
        names = list(variants)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                x, y = (torch.tensor(found[label, "all", n]).argsort().argsort().float() for n in (a, b))
                print(f"  per-case rank correlation {a} ~ {b}: {float(torch.corrcoef(torch.stack([x, y]))[0, 1]):.2f}")


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "collect":
        collect(rest[rest.index("--data-dir") + 1], rest[rest.index("--out") + 1])
    elif command == "rates":
        rates(rest[0], rest[1] if len(rest) > 1 else "pB:p:0.002:0.004,pC:p:0.001:0.002")
    elif command == "entropy":
        entropy(rest[0])
    elif command == "screen":
        screen(rest[0], rest[rest.index("--") + 1 :])
    elif command == "steps":
        bench = rest[1] if rest[1] != "--" else "fidelity"
        steps(rest[0], bench, rest[rest.index("--") + 1 :])
    elif command == "divergence":
        cases = int(rest[rest.index("--cases") + 1]) if "--cases" in rest else 10
        divergence(rest[0], rest[rest.index("--data-dir") + 1], cases)
    else:
        sys.exit(__doc__)
