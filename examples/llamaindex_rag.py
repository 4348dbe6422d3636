"""RAG with LlamaIndex: CacheBlend as the response synthesizer, against the framework's own response modes.

Indexes the passages of the first N cases of a QA data set (MuSiQue by default) in a FAISS index on the
packaged all-MiniLM-L6-v2, persists and reloads it, precomputes every node's KV once (offline, as CacheBlend
assumes), then asks each case's question in every mode on the same model, retriever and prompt:

- blend / full / reuse / prefix: `BlendSynthesizer`, one engine request with each retrieved node as a chunk;
- compact / refine / tree_summarize / accumulate / simple_summarize: LlamaIndex's own synthesizers calling the
  same `CacheBlendLLM` (each call a full prefill of a flat prompt).

For each answer it prints the gold answers, TTFT and chunk cache hits. TTFT is the model time until the first
token of the answer: the engine's own TTFT for the CacheBlend modes; for the framework's modes, every LLM call
before the one that produces the answer, plus that call's TTFT (retrieval is left out of both).

    python examples/llamaindex_rag.py [--data-dir ../shared/data] [--cases 2] [--modes blend,full,compact,refine]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from llama_index.core import Document, Settings
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMCompletionEndEvent
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.cacheblend import METRICS_KEY, CacheBlendLLM
from llama_index.response_synthesizers.cacheblend import (
    ENGINE_MODES,
    FRAMEWORK_MODES,
    BlendSynthesizer,
    build_faiss_index,
    get_blend_query_engine,
    load_faiss_index,
    minilm_embedding,
)

from cacheblend_rag import CacheBlendEngine, EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
DEFAULT_MODES = "blend,full,compact,refine,tree_summarize,accumulate"

# Short-answer prompts (as CacheBlend's QA evaluation asks for), the question after the passages so that each
# passage's cached KV does not depend on it. Every mode gets the same wording.
QA_TEMPLATE = PromptTemplate(
    "You will be asked a question after reading several passages. Answer it directly from the passages, "
    "within 5 words.\nPassages:\n{context_str}\n"
    "Answer the question directly from the passages above, within 5 words.\nQuestion: {query_str}\nAnswer:"
)
REFINE_TEMPLATE = PromptTemplate(
    "The question is: {query_str}\nThe existing answer is: {existing_answer}\n"
    "Here is one more passage:\n{context_msg}\n"
    "Using the passage if it helps, give the answer again, within 5 words. If it does not help, repeat the "
    "existing answer.\nAnswer:"
)
SUMMARY_TEMPLATE = PromptTemplate(
    "Passages:\n{context_str}\nAnswer the question directly from the passages above, within 5 words.\n"
    "Question: {query_str}\nAnswer:"
)

FRAMEWORK_TEMPLATES = {"refine_template": REFINE_TEMPLATE, "summary_template": SUMMARY_TEMPLATE}


class LLMCallRecorder(BaseEventHandler):
    """Keeps the engine metrics of every LLM completion (chat calls complete underneath, so none is missed)."""

    calls: list[dict[str, Any]] = []

    @classmethod
    def class_name(cls) -> str:
        return "LLMCallRecorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMCompletionEndEvent) and METRICS_KEY in event.response.additional_kwargs:
            self.calls.append(event.response.additional_kwargs[METRICS_KEY])


def load_cases(data_dir: Path, dataset: str, n: int) -> list[dict[str, Any]]:
    path = data_dir / dataset / f"{dataset}_s.json"
    if not path.is_file():
        raise SystemExit(f"no data set at {path}; pass --data-dir (a folder holding {dataset}/{dataset}_s.json)")
    cases = json.loads(path.read_text())
    if n < 1 or n > len(cases):
        raise SystemExit(f"--cases must be in [1, {len(cases)}], got {n}")
    return cases[:n]


def passages(cases: list[dict[str, Any]]) -> list[Document]:
    """Each case's passages as documents, once each (cases may share passages)."""
    seen: dict[str, Document] = {}
    for case in cases:
        for ctx in case["ctxs"]:
            text = (f"{ctx['title']}\n" if ctx.get("title") else "") + ctx["text"]
            seen.setdefault(text, Document(text=text))
    return list(seen.values())


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def answer_ttft(mode: str, response_metadata: dict[str, Any] | None, calls: list[dict[str, Any]]) -> float:
    """Model seconds until the answer's first token (see the module docstring)."""
    if mode in ENGINE_MODES:
        return (response_metadata or {})[METRICS_KEY]["ttft_s"]
    if not calls:
        return float("nan")
    if mode == "accumulate":  # the answer is the calls' outputs in order: it starts with the first one's
        return calls[0]["ttft_s"]
    return sum(c["ttft_s"] + c["decode_s"] for c in calls[:-1]) + calls[-1]["ttft_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="folder with <dataset>/<dataset>_s.json")
    p.add_argument("--dataset", default="musique", help="musique or wikimqa")
    p.add_argument("--cases", type=int, default=2, help="how many cases (their passages are indexed together)")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, from {ENGINE_MODES + FRAMEWORK_MODES}")
    p.add_argument("--model", default=None, help="preset or local checkpoint (default: the default preset)")
    p.add_argument("--top-k", type=int, default=5, help="nodes retrieved per question")
    p.add_argument("--ratio", type=float, default=None, help="blend recompute ratio (default: the engine's, 0.15)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--index-dir", type=Path, default=None, help="where to persist the index (default: a temp dir)")
    args = p.parse_args()

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ENGINE_MODES + FRAMEWORK_MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {list(ENGINE_MODES + FRAMEWORK_MODES)}")
    cases = load_cases(args.data_dir, args.dataset, args.cases)

    # The model and the embedder are built once and shared by every mode.
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(dtype="float32"))
    llm = CacheBlendLLM(engine=engine, max_new_tokens=args.max_new_tokens)
    Settings.llm, Settings.embed_model = llm, minilm_embedding()
    Settings.tokenizer = engine.tokenizer  # the framework's modes pack prompts counting the model's own tokens

    docs = passages(cases)
    with tempfile.TemporaryDirectory() as tmp:
        index_dir = args.index_dir or Path(tmp) / "index"
        t = time.perf_counter()
        build_faiss_index(docs, persist_dir=index_dir)
        index = load_faiss_index(index_dir)
        nodes = list(index.docstore.docs.values())
        print(
            f"indexed {len(docs)} passages of {len(cases)} {args.dataset} cases as {len(nodes)} nodes, persisted "
            f"to {index_dir} and reloaded ({time.perf_counter() - t:.1f}s)"
        )

    # Offline: each node's KV once, after the prompt's fixed prefix. Queries then only load and blend.
    t = time.perf_counter()
    hits, misses = BlendSynthesizer(llm=llm, text_qa_template=QA_TEMPLATE).precompute(nodes)
    print(f"precomputed chunk KV: {misses} computed, {hits} already cached ({time.perf_counter() - t:.1f}s)")
    llm.complete("Hello", max_new_tokens=1)  # warm-up, so the first mode's timings are the steady state

    query_engines = {
        mode: get_blend_query_engine(
            index,
            mode,
            llm=llm,
            text_qa_template=QA_TEMPLATE,
            recompute_ratio=args.ratio if mode == "blend" else None,
            synthesizer_kwargs=None if mode in ENGINE_MODES else FRAMEWORK_TEMPLATES,
            similarity_top_k=args.top_k,
        )
        for mode in modes
    }
    recorder = LLMCallRecorder()
    get_dispatcher().add_event_handler(recorder)

    totals: dict[str, dict[str, float]] = {m: {"ttft": 0.0, "total": 0.0, "calls": 0, "correct": 0} for m in modes}
    for i, case in enumerate(cases, 1):
        golds = case["answers"]
        print(f"\n=== case {i}/{len(cases)}: {case['question']}\n    gold: {' | '.join(golds)}")
        for mode in modes:
            recorder.calls.clear()
            t = time.perf_counter()
            response = query_engines[mode].query(case["question"])
            total = time.perf_counter() - t
            calls = list(recorder.calls)
            ttft = answer_ttft(mode, response.metadata, calls)
            answer = " ".join(str(response).split())
            correct = any(normalize(g) in normalize(answer) for g in golds)
            if mode in ENGINE_MODES:
                m = response.metadata[METRICS_KEY]
                cache = (
                    f"chunks hit {m['chunks_hit']}/{m['chunks_hit'] + m['chunks_missed']}, "
                    f"recomputed {m['recomputed_tokens']}/{m['prompt_tokens']} tok"
                )
                n_calls = 1
            else:
                prompt_tokens = sum(c["prompt_tokens"] for c in calls)
                cache = f"no chunk reuse ({len(calls)} LLM calls, {prompt_tokens} prompt tok prefilled)"
                n_calls = len(calls)
            print(f"  [{mode:>14}] ttft={ttft:6.2f}s total={total:6.2f}s {'OK ' if correct else '-- '} {cache}")
            print(f"  {'':>16} {answer[:200]}")
            totals[mode]["ttft"] += ttft
            totals[mode]["total"] += total
            totals[mode]["calls"] += n_calls
            totals[mode]["correct"] += correct

    n = len(cases)
    print(f"\n=== summary over {n} cases (top-k {args.top_k}, model {llm.model_name})")
    print(f"  {'mode':>14}  {'mean ttft':>9}  {'mean total':>10}  {'LLM calls':>9}  gold in answer")
    for mode in modes:
        s = totals[mode]
        print(
            f"  {mode:>14}  {s['ttft'] / n:8.2f}s  {s['total'] / n:9.2f}s  {s['calls'] / n:9.1f}  "
            f"{int(s['correct'])}/{n}"
        )


if __name__ == "__main__":
    main()
