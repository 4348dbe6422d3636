"""What a corpus costs on disk per codec, side by side in one run: bits per corpus value, precompute time, warm TTFT
from the disk tier, first tokens against exact KV, and encode/decode speed on real chunk KV.

    python benchmarks/codec_bytes.py --codecs native,int8,pca --datasets wikimqa --cases 10 --data-dir DATA

Per codec an engine on the same model stores into its own empty disk folder with the memory tier off, as a
deployment would (grouped precompute, so ~2 entries per chunk). Every case's chunks are precomputed, the codecs in
turn per case; the tier's bytes (every entry, headers included; the pca calibration apart) over the corpus's values
(its distinct chunks' tokens x layers x KV heads x head dim x 2) give bits per corpus value. Then each case is asked
through every codec in turn (`--repeats` rounds, greedy, `--max-new-tokens`), every chunk read from disk: median
blend TTFT, and how often the first answer token equals the one read from exact KV (`native`). Encode and decode:
the first case's entries through each codec, as the disk tier codes them (a captured entry against its isolated
one where the codec allows it; MB of KV in the compute dtype per s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib.cli import Transcript, add_engine_arguments, add_out_argument, cpu_name, load_engine

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.evaluation.datasets import load_dataset
from cacheblend_rag.store import ChunkKV, MemoryStore
from cacheblend_rag.store.codec import CodesCodec, KVCodec
from cacheblend_rag.store.layout import BaseReader
from cacheblend_rag.store.serialize import deserialize_chunk, read_base, serialize_chunk


def engines_for(base: CacheBlendEngine, codecs: list[str], root: Path) -> dict[str, CacheBlendEngine]:
    """An engine per codec on `base`'s model: no memory tier, a disk tier in root/<codec>."""
    out = {}
    for name in codecs:
        store = StoreConfig(memory_budget_bytes=0, disk_dir=str(root / name), kv_codec=name)
        config = EngineConfig(device=base.config.device, dtype=base.config.dtype, store=store)
        out[name] = CacheBlendEngine(base.model, base.tokenizer, config=config)
    return out


def corpus_values(engine: CacheBlendEngine, cases) -> int:
    """Values of the corpus's distinct chunks: tokens x layers x KV heads x head dim x 2 (keys and values)."""
    s = engine.lm.shape
    chunks = {}
    for case in cases:
        prompt = engine.build_prompt(list(case.chunks), case.question)
        chunks.update(zip(case.chunks, prompt.chunk_ids, strict=True))
    return sum(len(ids) for ids in chunks.values()) * s.num_layers * s.num_kv_heads * s.head_dim * 2


class Kept(MemoryStore):
    """A memory store that also keeps every entry put into it, in order (what the timing runs encode)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[ChunkKV] = []

    def put(self, kv: ChunkKV) -> None:
        self.entries.append(kv)
        super().put(kv)


def first_case_entries(base: CacheBlendEngine, case) -> list[ChunkKV]:
    """The entries a precompute of `case` stores (grouped: isolated and in context), exact."""
    kept = Kept()
    engine = CacheBlendEngine(base.model, base.tokenizer, config=base.config, store=kept)
    engine.precompute(list(case.chunks), case.question)
    engine.close()
    return kept.entries


def base_of(kv: ChunkKV, blobs: dict[str, bytes], codec: KVCodec) -> BaseReader | None:
    """The isolated entry `kv` is coded against, as a tier holding it codes it (`CodesCodec` only), or None."""
    if not kv.base or kv.base not in blobs or not isinstance(codec, CodesCodec):
        return None
    return read_base(blobs[kv.base], kv.base, codec=codec)


def encode_entries(kvs: list[ChunkKV], codec: KVCodec) -> dict[str, bytes]:
    """Each entry's bytes, in the order precompute stores them (isolated entries first, then those coded
    against them)."""
    blobs: dict[str, bytes] = {}
    for kv in kvs:
        blobs[kv.key] = serialize_chunk(kv, codec=codec, base=base_of(kv, blobs, codec))
    return blobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", default="native,int8,pca")
    p.add_argument("--datasets", default="wikimqa")
    p.add_argument("--cases", type=int, default=10, help="first N cases of each data set")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--max-new-tokens", type=int, default=1)
    add_engine_arguments(p, "the data sets")
    add_out_argument(p, "codec-bytes", "folder for summary.txt")
    args = p.parse_args(argv)
    codecs = args.codecs.split(",")
    if "native" not in codecs:
        p.error("--codecs must include native: first tokens are compared with exact KV's")
    say = Transcript()
    base = load_engine(args)
    cases = [c for name in args.datasets.split(",") for c in load_dataset(name, args.data_dir, limit=args.cases).cases]
    say(f"{len(cases)} cases of {args.datasets}, {base.config.dtype} on {cpu_name()}, "
        f"{torch.get_num_threads()} threads")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cacheblend-codec-bytes-") as root:
        engines = engines_for(base, codecs, Path(root))
        spent = dict.fromkeys(codecs, 0.0)
        for case in cases:
            for name, engine in engines.items():
                t = time.perf_counter()
                engine.precompute(list(case.chunks), case.question)
                engine.store.flush()
                spent[name] += time.perf_counter() - t
        values = corpus_values(base, cases)
        report: dict[str, dict[str, float]] = {name: {} for name in codecs}
        say(f"corpus: {values:,} values (distinct chunks' tokens x layers x KV heads x head dim x 2)")
        say(f"{'codec':<8} {'entries':>8} {'MiB':>8} {'bits/corpus value':>18} {'precompute s':>13} {'/int8':>6}")
        for name, engine in engines.items():
            disk = engine.store.tiers[1]
            ratio = f"{spent[name] / spent['int8']:.2f}" if "int8" in spent else "-"
            say(f"{name:<8} {len(disk):8d} {disk.nbytes / 2**20:8.1f} {8 * disk.nbytes / values:18.2f} "
                f"{spent[name]:13.1f} {ratio:>6}")  # fmt: skip
            report[name].update(entries=len(disk), bytes=disk.nbytes, bits_per_corpus_value=8 * disk.nbytes / values,
                                precompute_s=spent[name])  # fmt: skip
        ttfts = {name: [] for name in codecs}
        first = {name: [] for name in codecs}
        for _ in range(args.repeats):
            for case in cases:
                for name, engine in engines.items():
                    prompt = engine.build_prompt(list(case.chunks), case.question)
                    result = engine.generate(prompt, mode="blend", recompute_ratio=args.ratio,
                                             max_new_tokens=args.max_new_tokens)  # fmt: skip
                    assert result.metrics.hits_by_tier.get("disk") == len(prompt.chunk_ids), result.metrics.hits_by_tier
                    ttfts[name].append(result.metrics.ttft_s)
                    first[name].append(result.token_ids[0] if result.token_ids else None)
        say(f"\nwarm blend r={args.ratio}, every chunk from disk, {args.repeats} rounds over the cases:")
        for name in codecs:
            same = sum(a == b for a, b in zip(first[name], first["native"], strict=True)) // args.repeats
            report[name].update(ttft_s=statistics.median(ttfts[name]), first_token_as_native=same, cases=len(cases))
            say(f"  {name:<8} median TTFT {statistics.median(ttfts[name]) * 1000:7.0f} ms   "
                f"first token = native's in {same}/{len(cases)} cases")  # fmt: skip
        say("\nencode / decode of the first case's entries (MB of KV in the compute dtype per second, one thread's "
            "worth, best of 3):")  # fmt: skip
        kvs = first_case_entries(base, cases[0])
        mb = sum(kv.nbytes for kv in kvs) / 1e6
        for name, engine in engines.items():
            codec = engine.store.tiers[1].codec
            enc, dec = [], []
            for _ in range(3):
                t = time.perf_counter()
                blobs = encode_entries(kvs, codec)
                enc.append(time.perf_counter() - t)
                t = time.perf_counter()
                for kv in kvs:
                    deserialize_chunk(blobs[kv.key], kv.key, codec=codec, base=base_of(kv, blobs, codec))
                dec.append(time.perf_counter() - t)
            against = sum(base_of(kv, blobs, codec) is not None for kv in kvs)
            say(f"  {name:<8} encode {mb / min(enc):7.0f} MB/s   decode {mb / min(dec):7.0f} MB/s   "
                f"({against} of {len(kvs)} entries coded against their isolated one)")  # fmt: skip
            report[name].update(encode_mb_s=mb / min(enc), decode_mb_s=mb / min(dec), coded_against=against)
        for engine in engines.values():
            engine.close()
    say.write(args.out)
    run = {"cpu": cpu_name(), "dtype": str(base.dtype).removeprefix("torch."), "datasets": args.datasets,
           "cases": args.cases, "repeats": args.repeats, "ratio": args.ratio, "corpus_values": values}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps({"run": run, "codecs": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
