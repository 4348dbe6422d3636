"""How similar is the passage a chunk is cached after, and does a weak link go with a worse blend? For each case of a
grouped-precompute fidelity run, the cosine (packaged all-MiniLM-L6-v2) between each of the case's chunks and the
passage right before it in its group (the prompt's first chunk excluded: it reads its isolated entry), and the case's
KL change against isolated entries (grouped minus isolated, `attention`@0.15 and full reuse), by the case's weakest
link.

    python research/group_links.py benchmarks/results/fidelity-grouped-apart --data-dir ../shared/data
    python research/group_links.py benchmarks/results/fidelity-grouped --allowed

`--allowed` lays the groups out as they were before the near-copy rule (the run of that folder was). Runs no
language model (it loads the default one for its tokenizer); the groupings are the benchmark's (the set's whole
pool, 3,072-token groups, the model's tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chunk_kv_paired import records  # noqa: E402
from near_copies import group_of, pool_of  # noqa: E402

from cacheblend_rag import CacheBlendEngine  # noqa: E402
from cacheblend_rag.engine.request.prompt import tokenize_chunks  # noqa: E402
from cacheblend_rag.evaluation import load_dataset  # noqa: E402
from cacheblend_rag.retrieval.embeddings import embed_texts, load_embedder  # noqa: E402

BINS = (-1.0, 0.2, 0.3, 0.45, 0.6, 1.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--allowed", action="store_true", help="near copies allowed in a group (the layout before the rule)")
    args = p.parse_args()
    by_case = records(args.folder)
    engine = CacheBlendEngine.from_pretrained(show_progress=False)  # its tokenizer: the groups' token lengths
    tokenizer, embedder = engine.tokenizer, load_embedder()
    rows = []  # (set, case, weakest link, [links], delta r=0.15, delta reuse, first token iso, grp)
    for name in sorted({r["full"]["dataset"] for r in by_case.values() if "full" in r}):
        ds = load_dataset(name, args.data_dir, None)
        pool = pool_of(ds)
        row_of = {t: i for i, t in enumerate(pool)}
        vectors = embed_texts(embedder, pool, batch_size=64, show_progress=False)
        lengths = [len(ids) for ids in tokenize_chunks(tokenizer, pool, engine.config.chunk_separator)]
        layout = group_of(pool, vectors, lengths, allowed=args.allowed)
        for case in ds.cases:
            got = by_case.get(case.id, {})
            if not all(m in got for m in ("attention@0.15", "attention@0.15+grp", "reuse", "reuse+grp")):
                continue
            links = []
            for c in case.chunks[1:]:
                g = layout[c]
                i = g.index(c)
                if i:
                    links.append(float(vectors[row_of[c]] @ vectors[row_of[g[i - 1]]]))
            kl = {m: got[m]["kl_mean"] for m in ("attention@0.15", "attention@0.15+grp", "reuse", "reuse+grp")}
            rows.append((name, case.id, min(links, default=np.nan), links,
                         kl["attention@0.15+grp"] - kl["attention@0.15"], kl["reuse+grp"] - kl["reuse"],
                         got["attention@0.15"]["first_token"], got["attention@0.15+grp"]["first_token"]))  # fmt: skip
    print(f"{len(rows)} cases of {args.folder} ({'near copies allowed' if args.allowed else 'near copies apart'})\n")
    print("| weakest link (cosine) | cases | r = 0.15: grouped minus isolated, mean (median) | worse by > 0.05 | "
          "reuse: grouped minus isolated, mean | first tokens iso / grp |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    binned = defaultdict(list)
    for r in rows:
        binned[-1 if np.isnan(r[2]) else int(np.digitize(r[2], BINS)) - 1].append(r)
    for b in sorted(binned):
        rs = binned[b]
        label = "no link (every chunk first in its group)" if b < 0 else f"[{BINS[b]:.2f}, {min(BINS[b + 1], 1.0):.2f})"
        d = [r[4] for r in rs]
        reuse = statistics.mean(r[5] for r in rs)
        print(f"| {label} | {len(rs)} | {statistics.mean(d):+.3f} "
              f"({statistics.median(d):+.3f}) | {sum(x > 0.05 for x in d)} | {reuse:+.3f} | "
              f"{sum(r[6] for r in rs):.0f} / {sum(r[7] for r in rs):.0f} |")  # fmt: skip
    print("\nWorst five at r = 0.15:\n")
    for r in sorted(rows, key=lambda r: -r[4])[:5]:
        print(f"- {r[1][:24]}: {r[4]:+.3f} (reuse {r[5]:+.3f}); links {', '.join(f'{x:.2f}' for x in r[3])}")
    every = [x for r in rows for x in r[3]]
    print(f"\nLinks over all cases: {len(every)}, quantiles 5/25/50%: "
          f"{', '.join(f'{q:.2f}' for q in np.quantile(every, [0.05, 0.25, 0.5]))}")  # fmt: skip


if __name__ == "__main__":
    main()
