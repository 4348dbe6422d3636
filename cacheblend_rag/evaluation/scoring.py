"""Answer quality: token F1 with SQuAD normalisation (QA) and Rouge-L F (summaries), best over the golds.

Scope: turning a generated text and a case's gold answers into one number in [0, 1]. F1 counts words after
SQuAD's normalisation (lower case, no punctuation, no articles, single spaces), as LongBench does; the
research code counted model tokens instead, which makes scores depend on the tokenizer. Rouge-L is
`rouge-score`'s, with the Porter stemmer, as in the research code.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

__all__ = [
    "METRICS",
    "METRIC_NAMES",
    "best_score",
    "first_line",
    "normalize_answer",
    "parse_short_answer",
    "rouge_l",
    "score_answer",
    "token_f1",
]

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, drop articles, collapse white space."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)  # both empty: agreement; one empty: nothing in common
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


@lru_cache(maxsize=1)
def _rouge_scorer() -> Any:
    try:
        from rouge_score import rouge_scorer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Rouge-L needs rouge-score: pip install 'cacheblend-rag[eval]'") from e
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, gold: str) -> float:
    return float(_rouge_scorer().score(gold, prediction)["rougeL"].fmeasure)


METRICS: dict[str, Callable[[str, str], float]] = {"f1": token_f1, "rouge_l": rouge_l}


def best_score(prediction: str, golds: Sequence[str], metric: str) -> float:
    """The best `metric` ("f1" or "rouge_l") of `prediction` over alternative golds (2WikiMQA's aliases arrive
    already flattened)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if isinstance(golds, str):
        raise TypeError("golds must be a list of answers, got a single string; wrap it: [gold]")
    if not golds:
        raise ValueError("no gold answer to score against")
    return max(METRICS[metric](prediction, g) for g in golds)


def first_line(text: str) -> str:
    """The first non-empty line: models often add an explanation after the answer."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def parse_short_answer(text: str) -> str:
    """The research code's QA post-processing: first line, and a leading yes/no stands for the whole answer."""
    line = first_line(text)
    words = line.split()
    if words:
        head = words[0].strip(string.punctuation).lower()
        if head in ("yes", "no"):
            return head.capitalize()
    return line


def score_answer(task: str, prediction: str, golds: Sequence[str]) -> float:
    """F1 for 'qa' (on the parsed short answer), Rouge-L F for 'summary'."""
    if task == "qa":
        return best_score(parse_short_answer(prediction), golds, "f1")
    if task == "summary":
        return best_score(prediction, golds, "rouge_l")
    raise ValueError(f"task must be 'qa' or 'summary', got {task!r}")


METRIC_NAMES = {"qa": "F1", "summary": "Rouge-L"}  # the name of each task's metric in reports
