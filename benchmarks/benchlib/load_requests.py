"""The load benchmark's requests: RAG requests over a warm pool of chunks, some of them cold on purpose.

`plan_requests` decides a run's requests before it starts: request i reads chunks (5i + 7j) mod the pool's size,
asks one of `QUESTIONS`, and a seeded share of the requests get chunks with a fresh tag in front (`fresh_text`),
so the engine has never stored them and they take the miss policy's path.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

QUESTIONS = [
    "Which people are named in these passages, and what did they do?",
    "What places do these passages mention?",
    "Summarize what these passages say about history.",
    "Which dates appear in these passages, and what happened then?",
]


@dataclass(frozen=True)
class Planned:
    """One request of a run, decided before it starts."""

    index: int
    chunks: tuple[str, ...]
    question: str
    cold: bool  # its chunks were never stored: it takes the miss policy's path


def fresh_text(text: str, uid: int) -> str:
    """`text` with a tag no other chunk has in front, so its KV is not in the store. The tag is two words "wN"
    (N in 2..31999): single tokens for the random-weights tokenizer, plain text for a real one."""
    return f"w{2 + uid % 31998} w{2 + uid // 31998 % 31998} {text}"


def plan_requests(
    pool: Sequence[str], n: int, chunks: int, cold_share: float, seed: int, fresh: Iterator[int]
) -> list[Planned]:
    """`n` requests over the warm pool; round(cold_share * n) of them, drawn with `seed`, get fresh chunks."""
    cold = set(random.Random(seed).sample(range(n), round(cold_share * n)))
    out = []
    for i in range(n):
        texts = [pool[(i * 5 + j * 7) % len(pool)] for j in range(chunks)]
        if i in cold:
            texts = [fresh_text(t, next(fresh)) for t in texts]
        out.append(Planned(i, tuple(texts), QUESTIONS[i % len(QUESTIONS)], i in cold))
    return out
