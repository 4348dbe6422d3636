"""The traffic benchmark's real runs: one engine, a store with a byte budget, a stream of SQuAD questions.

Results are appended to a JSONL file one request at a time. A run (stream, seed, budget) whose requests are all in
the file is skipped. A run cut short starts again from its first request: its requests depend on the store the run
built, which lives in process memory, so its earlier records are replaced (they carry an attempt number).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by an interrupted write
            continue
    return out


def append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def latest_attempts(records: Sequence[dict[str, Any]], kind: str = "request") -> dict[str, list[dict[str, Any]]]:
    """Per run id, the records of its latest attempt, in request order."""
    attempts: dict[str, int] = {}
    for r in records:
        if r.get("kind") == kind:
            attempts[r["run"]] = max(attempts.get(r["run"], 0), r["attempt"])
    runs: dict[str, list[dict[str, Any]]] = {run: [] for run in attempts}
    for r in records:
        if r.get("kind") == kind and r["attempt"] == attempts[r["run"]]:
            runs[r["run"]].append(r)
    return {run: sorted(rs, key=lambda r: r["i"]) for run, rs in runs.items()}


def ask(engine, chunks: list[str], question: str, mode: str = "blend") -> tuple[Any, float]:
    """One request to its first token; then the chunks it left to store are stored (not part of its TTFT: the next
    request arrives after them, as with a user's think time) -> (metrics, seconds the fills took)."""
    result = engine.generate(chunks, question, mode=mode, max_new_tokens=1)
    t = time.perf_counter()
    engine.wait_for_fills()
    return result.metrics, time.perf_counter() - t


def time_full_sample(engine, prompts: Sequence[tuple[int, list[str], str]], out: Path) -> None:
    """Full prefills of sampled prompts (question index, chunks, question) on a store that keeps nothing."""
    from cacheblend_rag.store import MemoryStore

    done = {r["q"] for r in read_records(out) if r.get("kind") == "full"}
    kept, engine.store = engine.store, MemoryStore(0)
    try:
        for q, chunks, question in prompts:
            if q in done:
                continue
            m, _ = ask(engine, chunks, question, mode="full")
            append(out, dict(kind="full", q=q, prompt_tokens=m.prompt_tokens, ttft_s=m.ttft_s))
            print(f"full prefill q{q}: {m.prompt_tokens} tokens {m.ttft_s:.2f}s", file=sys.stderr)
    finally:
        engine.store = kept


def run_stream(engine, run: str, order: Sequence[int], retrieved: Sequence[Sequence[int]], texts: Sequence[str],
               questions: Sequence[str], budget: int, eviction: str, out: Path) -> None:  # fmt: skip
    """One run: a fresh store of `budget` bytes, then every question of `order`, each with its retrieved chunks."""
    from cacheblend_rag.config import StoreConfig
    from cacheblend_rag.store import build_store

    records = read_records(out)
    previous = latest_attempts(records).get(run, [])
    if len(previous) >= len(order):
        print(f"{run}: {len(order)} requests done already", file=sys.stderr)
        return
    attempt = max((r["attempt"] for r in records if r.get("run") == run), default=0) + 1
    engine.store = build_store(**StoreConfig(memory_budget_bytes=budget, memory_eviction=eviction).build_options())
    t0 = time.perf_counter()
    for i, q in enumerate(order):
        chunks = [texts[c] for c in retrieved[q]]
        m, fill_s = ask(engine, chunks, questions[q])
        append(out, dict(kind="request", run=run, attempt=attempt, i=i, q=q, chunks=list(retrieved[q]),
                         mode=m.mode, hits=m.chunks_hit, misses=m.chunks_missed, ttft_s=m.ttft_s,
                         compute_share=m.compute_share, prompt_tokens=m.prompt_tokens, precompute_s=m.precompute_s,
                         fill_s=fill_s, store_bytes=engine.store.tiers[0].nbytes))  # fmt: skip
        if i % 10 == 0:
            print(f"{run} #{i}: {m.summary()[:90]} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
