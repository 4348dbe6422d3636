"""Retrieval QA in LangChain with CacheBlend, against LangChain's stuff, map-reduce and map-rerank chains.

Indexes the passages of the first N cases of a QA data set (MuSiQue by default) with FAISS and the packaged
all-MiniLM-L6-v2, then asks each case's question through `build_rag_chain` with each strategy on the same
retriever and model, printing the answer, the gold answers, the time to the answer's first token and the
chunk-cache hits. Blend's chunk KV is precomputed right after indexing (as a deployment would), unless
--no-precompute is given.

    python examples/langchain_rag.py [--data-dir ../shared/data] [--cases 2] [--strategies blend,stuff]
        [--model PRESET_OR_PATH] [--top-k 5] [--max-tokens 32]

Needs `pip install -e integrations/langchain-cacheblend`. Set CACHEBLEND_RAG_HOME to reuse converted models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate

try:
    from langchain_cacheblend import (
        STRATEGIES,
        CacheBlendMetricsHandler,
        ChatCacheBlend,
        build_faiss_index,
        build_rag_chain,
        load_engine,
        precompute_documents,
    )
    from langchain_cacheblend.vectorstores import default_text_splitter
except ImportError as exc:  # pragma: no cover - an install hint, not logic
    sys.exit(f"{exc}\ninstall the integration first: pip install -e integrations/langchain-cacheblend")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"

# CacheBlend's QA prompt (its research code's, for MuSiQue): short answers, the question after the passages,
# so the text before the passages is the same for every question and each passage's KV is reused.
QA_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "You are a helpful assistant."),
        (
            "human",
            "You will be asked a question after reading several passages. Please directly answer the question "
            "based on the given passages. Do NOT repeat the question. The answer should be within 5 words.\n"
            "Passages:\n{context}\n\nAnswer the question directly based on the given passages. Do NOT repeat "
            "the question. The answer should be within 5 words.\nQuestion: {input}\nAnswer:",
        ),
    ]
)
# Map-reduce's final step, asking for the same short answer (its map step keeps langchain-classic's prompt).
COMBINE_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "You are a helpful assistant."),
        (
            "human",
            "Extracts from several passages:\n{summaries}\n\nAnswer the question directly based on the extracts. "
            "The answer should be within 5 words.\nQuestion: {question}\nAnswer:",
        ),
    ]
)

# Map-rerank's per-passage prompt. langchain-classic's own ends the user message with "Helpful Answer:", which
# chat models answer with a bare "Score: N" and no answer; this one asks for both lines, in the parser's format.
RERANK_PROMPT = PromptTemplate.from_template(
    "Read the passage, then answer the question directly, in at most 5 words, and rate from 0 to 100 how fully "
    "the passage answers it (0: not at all).\nPassage:\n{context}\n\nQuestion: {question}\n"
    "Reply in exactly this format:\nAnswer: <answer>\nScore: <0-100>"
)


def load_cases(data_dir: Path, n: int) -> list[dict]:
    path = data_dir / "musique" / "musique_s.json"
    if not path.is_file():
        sys.exit(f"no data set at {path}; pass --data-dir pointing at the folder that holds musique/musique_s.json")
    cases = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(cases, list) or not cases:
        sys.exit(f"{path} should hold a JSON list of cases with ctxs, question and answers")
    return cases[:n]


def documents_of(cases: list[dict]) -> list[Document]:
    """Every passage of the cases once, titled, as the data set gives them."""
    seen: set[tuple[str, str]] = set()
    docs = []
    for i, case in enumerate(cases):
        for ctx in case["ctxs"]:
            key = (ctx["title"], ctx["text"])
            if key not in seen:
                seen.add(key)
                docs.append(Document(page_content=f"{ctx['title']}\n{ctx['text']}", metadata={"case": i, **ctx}))
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help=f"default: {DEFAULT_DATA}")
    p.add_argument("--cases", type=int, default=2, help="how many cases to index and ask (default 2)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {', '.join(STRATEGIES)}")
    p.add_argument("--model", default=None, help="preset or local checkpoint (default: the default preset)")
    p.add_argument("--top-k", type=int, default=5, help="documents retrieved per question")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens per model call")
    p.add_argument("--no-precompute", action="store_true", help="let blend's first questions miss the cache")
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up even when the output goes to a file
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        p.error(f"unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # langchain-classic's chains are deprecated
    warnings.filterwarnings("ignore", message=".*apply_and_parse.*")

    cases = load_cases(args.data_dir, args.cases)
    t = time.perf_counter()
    engine = load_engine(args.model)
    chat = ChatCacheBlend(model=args.model, max_tokens=args.max_tokens)
    print(f"model {chat.model_name} loaded in {time.perf_counter() - t:.1f}s")

    docs = documents_of(cases)
    t = time.perf_counter()
    store = build_faiss_index(docs, text_splitter=default_text_splitter(engine.tokenizer, 512))
    pieces = list(store.docstore._dict.values())
    print(
        f"indexed {len(docs)} passages of {len(cases)} cases as {len(pieces)} chunks in {time.perf_counter() - t:.1f}s"
    )
    if "blend" in strategies and not args.no_precompute:
        t = time.perf_counter()
        hits, misses = precompute_documents(chat, QA_PROMPT, pieces)
        print(f"precomputed chunk KV: {misses} computed, {hits} already cached, in {time.perf_counter() - t:.1f}s")
    retriever = store.as_retriever(search_kwargs={"k": args.top_k})
    chains = {
        s: build_rag_chain(
            retriever, chat, s, prompt=QA_PROMPT, combine_prompt=COMBINE_PROMPT, rerank_prompt=RERANK_PROMPT
        )
        for s in strategies
    }

    totals = {s: {"ttft": 0.0, "time": 0.0, "hit": 0, "miss": 0, "correct": 0} for s in strategies}
    for i, case in enumerate(cases):
        print(f"\n=== case {i}: {case['question']}\n    gold: {case['answers']}")
        for strategy, chain in chains.items():
            handler = CacheBlendMetricsHandler()
            t0 = time.perf_counter()
            out = chain.invoke({"input": case["question"]}, {"callbacks": [handler]})
            elapsed = time.perf_counter() - t0
            # Time to the answer's first token: that of the last model call (blend, stuff, map-reduce's final
            # step); map-rerank picks its answer only once every call has ended.
            ttft = elapsed if strategy == "map_rerank" else handler.calls[-1].first_token_at - t0
            hit = sum(c.metrics["chunks_hit"] for c in handler.calls)
            miss = sum(c.metrics["chunks_missed"] for c in handler.calls)
            answer = " ".join(out["answer"].split())
            correct = any(g.lower() in answer.lower() for g in case["answers"])
            row = totals[strategy]
            row["ttft"] += ttft
            row["time"] += elapsed
            row["hit"] += hit
            row["miss"] += miss
            row["correct"] += correct
            print(
                f"  {strategy:<10} ttft={ttft * 1000:7.0f}ms total={elapsed:5.1f}s calls={len(handler.calls):2d} "
                f"chunks hit/miss={hit}/{miss} {'OK ' if correct else '-- '} answer: {answer[:80]!r}"
            )

    n = len(cases)
    print(f"\n=== summary over {n} cases (top-k {args.top_k}, max_tokens {args.max_tokens})")
    print(f"  {'strategy':<10} {'mean TTFT':>10} {'mean total':>11} {'chunks hit/miss':>16} {'gold in answer':>15}")
    for s, row in totals.items():
        print(
            f"  {s:<10} {row['ttft'] / n * 1000:8.0f}ms {row['time'] / n:10.1f}s "
            f"{row['hit']:>8}/{row['miss']:<7} {row['correct']:>9}/{n}"
        )


if __name__ == "__main__":
    main()
