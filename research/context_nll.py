"""Can a chunk's own text tell, at precompute time, whether its grouped entry will be closer to the prompt than its
isolated one? (research/README.md; its answer is in research/results/context_nll.md).

    python research/context_nll.py --cases multi_news:multi_news-0cd7b... musique:musique-6 ...
    python research/context_nll.py --per-set 5          # the first 5 cases of each set

Grouped precompute (near copies apart, the set's whole pool, 3,072-token groups) prefills every chunk twice: alone
after the prefix (its isolated entry) and after the passages before it in its group (its grouped entry). Both
prefills compute the chunk's own next-token log-likelihood at no extra prefill cost. Per chunk of a case that reads
a grouped entry (not the prompt's first, not first in its group), this prints:

- `nll_iso`, `nll_grp`: mean negative log-likelihood of the chunk's tokens alone and after its group (nats/token);
- `err_iso`, `err_grp`: how far each entry's values are from the chunk's values in the case's full prefill
  (||V_entry - V_prompt|| / ||V_prompt||, over every layer; values carry no position, so entries compare as-is).

The question is whether `nll_grp - nll_iso` (the context made the chunk more predictable, or not) tells which of the
two entries is closer to the prompt (`err_grp - err_iso`). Rows go to `--out` as JSON lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from near_copies import SETS, group_of, pool_of

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.engine.request.prompt import tokenize_chunks
from cacheblend_rag.evaluation import load_dataset
from cacheblend_rag.retrieval.embeddings import embed_texts, load_embedder


@torch.inference_mode()
def run(model, ids: list[int], spans: list[tuple[int, int]]) -> tuple[list[float], list[torch.Tensor]]:
    """One causal prefill of `ids`: per span [a, b), the mean NLL of its tokens and its values [layers, h, b-a, d]."""
    out = model.model(torch.tensor([ids]), use_cache=True)
    hidden = out.last_hidden_state[0]
    values = torch.stack([layer.values[0] for layer in out.past_key_values.layers])  # [L, h, T, d]
    nll, vals = [], []
    target = torch.tensor(ids)
    for a, b in spans:
        logits = model.lm_head(hidden[a - 1 : b - 1]).float()
        nll.append(torch.nn.functional.cross_entropy(logits, target[a:b]).item())
        vals.append(values[:, :, a:b].float().clone())
    return nll, vals


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summary(path: Path) -> None:
    """research/results/context_nll.md from the rows: by the NLL change, and by the chunk's place in the prompt."""
    rows = read_rows(path)
    d_nll = [r["nll_grp"] - r["nll_iso"] for r in rows]
    d_err = [r["err_grp"] - r["err_iso"] for r in rows]
    cases = len({(r["dataset"], r["case_id"]) for r in rows})
    print(f"{len(rows)} chunks reading a grouped entry, {cases} cases; Pearson(NLL change, error change) = "
          f"{float(np.corrcoef(d_nll, d_err)[0, 1]):+.2f}\n")  # fmt: skip
    print("| rows | chunks | grouped entry closer to the prompt | mean change of error (grouped - isolated) |")
    print("|---|---:|---:|---:|")
    groups = {
        "NLL after its group minus alone < -0.1": lambda r, d: d < -0.1,
        "-0.1 to 0": lambda r, d: -0.1 <= d < 0,
        "0 to 0.05": lambda r, d: 0 <= d < 0.05,
        ">= 0.05": lambda r, d: d >= 0.05,
        "the prompt's second chunk": lambda r, d: r["chunk"] == 1,
        "... not cached after exactly the prompt's first chunk": lambda r, d: r["chunk"] == 1 and r["err_grp"] > 1e-3,
        "third chunk or later": lambda r, d: r["chunk"] >= 2,
    }  # fmt: skip
    for label, keep in groups.items():
        sel = [e for r, d, e in zip(rows, d_nll, d_err, strict=True) if keep(r, d)]
        if sel:
            print(f"| {label} | {len(sel)} | {sum(e < 0 for e in sel)} | {np.mean(sel):+.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=[], help="SET:CASE_ID ...")
    p.add_argument("--per-set", type=int, default=0, help="also the first N cases of each set")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", default="research/results/context_nll.jsonl")
    p.add_argument("--summary", action="store_true", help="print the tables of --out's rows and stop (no model)")
    args = p.parse_args()
    if args.summary:
        summary(Path(args.out))
        return
    wanted: dict[str, list[str]] = {}
    for item in args.cases:
        name, case_id = item.split(":", 1)
        wanted.setdefault(name, []).append(case_id)
    engine = CacheBlendEngine.from_pretrained(show_progress=False)
    model, sep = engine.model, engine.config.chunk_separator
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["dataset"], r["case_id"]) for r in read_rows(out)}
    for name in SETS:
        if not wanted.get(name) and not args.per_set:
            continue
        ds = load_dataset(name, args.data_dir, None)
        ids = {*wanted.get(name, []), *(c.id for c in ds.cases[: args.per_set])}
        pool = pool_of(ds)
        vectors = embed_texts(load_embedder(), pool, batch_size=64, show_progress=False)
        lengths = [len(t) for t in tokenize_chunks(engine.tokenizer, pool, sep)]
        layout = group_of(pool, vectors, lengths, allowed=False)
        for case in (c for c in ds.cases if c.id in ids):
            if (name, case.id) in done:
                continue
            prompt = engine.build_prompt(list(case.chunks), case.question, template=ds.spec.template)
            prefix = list(prompt.prefix_ids)
            _, real = run(model, prompt.input_ids().tolist(), prompt.chunk_spans)
            for j, chunk in enumerate(case.chunks):
                group = layout[chunk]
                at = group.index(chunk)
                if j == 0 or at == 0 or chunk in case.chunks[:j]:
                    continue  # the prompt's first chunk and a group's first read the isolated entry
                own = list(prompt.chunk_ids[j])
                before = [t for g in tokenize_chunks(engine.tokenizer, list(group[:at]), sep) for t in g]
                (nll_iso,), (v_iso,) = run(model, prefix + own, [(len(prefix), len(prefix) + len(own))])
                start = len(prefix) + len(before)
                (nll_grp,), (v_grp,) = run(model, prefix + before + own, [(start, start + len(own))])
                row = {
                    "dataset": name, "case_id": case.id, "chunk": j, "tokens": len(own), "context_tokens": len(before),
                    "nll_iso": nll_iso, "nll_grp": nll_grp,
                    "err_iso": rel_err(v_iso, real[j]), "err_grp": rel_err(v_grp, real[j]),
                    "later_in_prompt": any(c in case.chunks[j + 1 :] for c in group[:at]),
                }  # fmt: skip
                print(json.dumps(row), flush=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
