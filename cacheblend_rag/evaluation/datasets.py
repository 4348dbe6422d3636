"""Benchmark data sets of the paper (§7) as lists of `Case`s: chunks, a question, gold answers.

Scope: reading the files under a data folder (`--data-dir`, or the `CACHEBLEND_RAG_DATA` environment variable) and
turning each record into a `Case`, plus each data set's prompt (`TaskSpec`). Scoring is `scoring.py`'s job,
running methods `methods.py`'s.

- MuSiQue (`musique/musique_s.json`) and 2WikiMQA (`wikimqa/wikimqa_s_clean.json`): CacheBlend's own files,
  ten passages per question, each passage one chunk; 2WikiMQA's answers are lists of aliases per gold answer,
  flattened here because any alias of any gold answer counts.
- MultiNews (`multi_news/multi_news.jsonl`, LongBench): the context "Passage 1:\\n...Passage 2:\\n..." is split
  into its passages, one chunk each; newlines inside articles are stored as "NEWLINE_CHAR" and restored.
- SAMSum (`samsum/{test,validation}.jsonl`): few-shot summarisation as in LongBench and the research code.
  A test dialogue is the query; the chunks are `shots` validation dialogues with their summaries, drawn with
  a random generator seeded by the case index, so every run and every machine builds the same prompts.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..engine.request.prompt import QA_SHORT_TEMPLATE, PromptTemplate
from ..errors import CacheBlendError

__all__ = [
    "DATASETS",
    "Case",
    "Dataset",
    "DatasetError",
    "TaskSpec",
    "canonical_dataset_name",
    "default_data_dir",
    "load_dataset",
    "load_multi_news",
    "load_musique",
    "load_samsum",
    "load_wikimqa",
    "resolve_data_dir",
]

TaskKind = Literal["qa", "summary"]


class DatasetError(CacheBlendError):
    """A data file is missing or not in the expected format."""


@dataclass(frozen=True)
class Case:
    """One benchmark request: the chunks (in prompt order), the question, and the alternative gold answers."""

    id: str
    chunks: tuple[str, ...]
    question: str  # what the template puts after the chunks (the question, or the dialogue to summarise)
    answers: tuple[str, ...]  # alternative golds: a prediction scores the best match among them
    task: TaskKind

    def __post_init__(self) -> None:
        if not self.chunks:
            raise DatasetError(f"case {self.id!r} has no chunks")
        if any(not c.strip() for c in self.chunks):
            raise DatasetError(f"case {self.id!r} has an empty chunk; drop it when loading")
        if not self.answers:
            raise DatasetError(f"case {self.id!r} has no gold answer")
        if self.task not in ("qa", "summary"):
            raise DatasetError(f"case {self.id!r}: task must be 'qa' or 'summary', got {self.task!r}")


@dataclass(frozen=True)
class TaskSpec:
    """How one data set's cases are prompted, decoded and post-processed."""

    name: str
    task: TaskKind
    template: PromptTemplate  # prefix (instruction) + chunks + suffix (the question turn)
    max_new_tokens: int  # answer budget: short for QA (the research code's 32), longer for summaries
    chunks_are_context: bool = True  # False when chunks are few-shot examples: map-style methods do not apply
    first_line_only: bool = True  # keep the answer's first non-empty line, as the research code does


@dataclass(frozen=True)
class Dataset:
    spec: TaskSpec
    cases: tuple[Case, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        wrong = [c.id for c in self.cases if c.task != self.spec.task]
        if wrong:
            raise DatasetError(f"data set {self.spec.name!r} is a {self.spec.task} task, but cases {wrong[:3]} are not")
        ids = [c.id for c in self.cases]
        if len(set(ids)) != len(ids):
            raise DatasetError(f"data set {self.spec.name!r} has duplicate case ids")


# -- prompts ---------------------------------------------------------------------------------------------------

QA_SPEC_TEMPLATE = QA_SHORT_TEMPLATE

MULTI_NEWS_TEMPLATE = PromptTemplate(
    system="You are a helpful assistant.",
    instruction="You are given several news passages. Write a one-page summary of all news.\n\nNews:\n",
    question_template="\n\n{question}\n\nSummary:",
)
MULTI_NEWS_REQUEST = "Now, write a one-page summary of all the news."  # LongBench's closing request

SAMSUM_TEMPLATE = PromptTemplate(
    system="You are a helpful assistant.",
    instruction="Summarize the dialogue into a few short sentences. The following are some examples.\n\n",
    question_template="\n\nDialogue: {question}\nSummary:",
)

SPECS: dict[str, TaskSpec] = {
    "musique": TaskSpec("musique", "qa", QA_SPEC_TEMPLATE, max_new_tokens=32),
    "wikimqa": TaskSpec("wikimqa", "qa", QA_SPEC_TEMPLATE, max_new_tokens=32),
    # LongBench gives MultiNews 512 new tokens; 128 keeps CPU runs affordable and is the same for every method.
    "multi_news": TaskSpec("multi_news", "summary", MULTI_NEWS_TEMPLATE, max_new_tokens=128, first_line_only=False),
    "samsum": TaskSpec("samsum", "summary", SAMSUM_TEMPLATE, max_new_tokens=128, chunks_are_context=False),
}

_ALIASES = {"2wikimqa": "wikimqa", "multinews": "multi_news", "multi-news": "multi_news"}


def canonical_dataset_name(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in SPECS:
        raise DatasetError(f"unknown data set {name!r}; choose from {', '.join(SPECS)}")
    return key


# -- data folder -----------------------------------------------------------------------------------------------

DATA_ENV = "CACHEBLEND_RAG_DATA"  # the data folder when no --data-dir is given


def default_data_dir() -> Path | None:
    """The folder `CACHEBLEND_RAG_DATA` names, or None when it is unset or empty."""
    configured = os.environ.get(DATA_ENV, "").strip()
    return Path(configured) if configured else None


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """`data_dir`, else `$CACHEBLEND_RAG_DATA`; a DatasetError saying how to give one when neither is a folder."""
    if data_dir is not None:
        path = Path(data_dir)
        if not path.is_dir():
            raise DatasetError(f"--data-dir {str(path)!r} is not a folder")
        return path
    found = default_data_dir()
    if found is None:
        raise DatasetError(
            f"no data folder given: pass --data-dir DIR or set {DATA_ENV}=DIR, a folder with musique/, wikimqa/, "
            "multi_news/ and samsum/ in it"
        )
    if not found.is_dir():
        raise DatasetError(f"{DATA_ENV}={str(found)!r} is not a folder; point it at the data folder or pass --data-dir")
    return found


def _require(data_dir: Path, relative: str) -> Path:
    path = data_dir / relative
    if not path.is_file():
        raise DatasetError(f"missing data file {str(path)!r}; put it there or point --data-dir at the right folder")
    return path


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path} is not valid JSON: {e}") from e


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{line_no} is not valid JSON: {e}") from e
    return rows


def _field(record: Any, key: str, path: Path, index: int) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise DatasetError(f"{path}: record {index} has no field {key!r}")
    return record[key]


def _limit(items: Sequence[Any], limit: int | None) -> Sequence[Any]:
    if limit is not None and limit < 1:
        raise DatasetError(f"limit must be >= 1 or None, got {limit}")
    return items if limit is None else items[:limit]


# -- loaders ---------------------------------------------------------------------------------------------------


def normalize_question(question: str) -> str:
    """The research code's question form: ends with '?', first letter lower-case."""
    q = question.strip()
    if not q.endswith("?"):
        q += "?"
    return q[0].lower() + q[1:]


def _passage_chunk(ctx: dict[str, Any]) -> str:
    title, text = (ctx.get("title") or "").strip(), (ctx.get("text") or "").strip()
    return f"{title}\n\n{text}" if title else text


def _load_ctx_qa(name: str, path: Path, limit: int | None, nested_answers: bool) -> Dataset:
    records = _read_json(path)
    if not isinstance(records, list):
        raise DatasetError(f"{path}: expected a JSON list of cases, got {type(records).__name__}")
    cases = []
    for i, rec in enumerate(_limit(records, limit)):
        ctxs = _field(rec, "ctxs", path, i)
        answers = _field(rec, "answers", path, i)
        if nested_answers:
            if not all(isinstance(a, list) for a in answers):
                raise DatasetError(f"{path}: record {i}: answers must be a list of lists of aliases")
            flat = [alias for gold in answers for alias in gold]
        else:
            flat = list(answers)
        chunks = tuple(c for c in (_passage_chunk(ctx) for ctx in ctxs) if c)
        question = normalize_question(_field(rec, "question", path, i))
        golds = tuple(dict.fromkeys(str(a) for a in flat if str(a).strip()))
        cases.append(Case(f"{name}-{i}", chunks, question, golds, "qa"))
    return Dataset(SPECS[name], tuple(cases))


def load_musique(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Dataset:
    path = _require(resolve_data_dir(data_dir), "musique/musique_s.json")
    return _load_ctx_qa("musique", path, limit, nested_answers=False)


def load_wikimqa(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Dataset:
    path = _require(resolve_data_dir(data_dir), "wikimqa/wikimqa_s_clean.json")
    return _load_ctx_qa("wikimqa", path, limit, nested_answers=True)


_PASSAGE_RE = re.compile(r"(?:^|\n)Passage \d+:\n")


def split_passages(context: str) -> list[str]:
    """LongBench's "Passage 1:\\n...Passage 2:\\n..." -> the passages, newlines restored, empty ones dropped."""
    parts = _PASSAGE_RE.split(context)
    passages = []
    for p in parts:
        text = re.sub(r"\s*NEWLINE_CHAR\s*", "\n", p).strip()
        text = re.sub(r"\n{3,}", "\n\n", text)
        if text:
            passages.append(text)
    return passages


def load_multi_news(data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> Dataset:
    path = _require(resolve_data_dir(data_dir), "multi_news/multi_news.jsonl")
    cases = []
    for i, rec in enumerate(_limit(_read_jsonl(path), limit)):
        chunks = tuple(split_passages(_field(rec, "context", path, i)))
        if not chunks:
            raise DatasetError(f"{path}: record {i} has no passage in its context")
        golds = tuple(str(a).strip() for a in _field(rec, "answers", path, i) if str(a).strip())
        case_id = f"multi_news-{rec.get('_id') or i}"
        cases.append(Case(case_id, chunks, MULTI_NEWS_REQUEST, golds, "summary"))
    return Dataset(SPECS["multi_news"], tuple(cases))


def samsum_example(dialogue: str, summary: str) -> str:
    """One few-shot chunk, in LongBench's samsum layout."""
    return f"Dialogue: {dialogue.strip()}\nSummary: {summary.strip()}"


def load_samsum(
    data_dir: str | os.PathLike[str] | None = None, limit: int | None = None, *, shots: int = 10, seed: int = 0
) -> Dataset:
    """Few-shot cases: test dialogue i is the query, `shots` validation pairs (seeded by seed and i) the chunks."""
    if shots < 1:
        raise DatasetError(f"shots must be >= 1, got {shots}")
    root = resolve_data_dir(data_dir)
    test_path = _require(root, "samsum/test.jsonl")
    test = _read_jsonl(test_path)
    pool_path = _require(root, "samsum/validation.jsonl")
    pool = [
        samsum_example(_field(r, "context", pool_path, j), _field(r, "response", pool_path, j))
        for j, r in enumerate(_read_jsonl(pool_path))
        if str(r.get("context", "")).strip() and str(r.get("response", "")).strip()
    ]
    if len(pool) < shots:
        raise DatasetError(f"{pool_path} has {len(pool)} usable examples, fewer than shots={shots}")
    _limit(test, limit)  # validates limit
    cases: list[Case] = []
    for i, rec in enumerate(test):
        if limit is not None and len(cases) >= limit:
            break
        dialogue = str(_field(rec, "context", test_path, i)).strip()
        summary = str(_field(rec, "response", test_path, i)).strip()
        if not dialogue or not summary:
            continue  # nothing to ask or nothing to score against
        rng = random.Random(seed * 1_000_003 + i)  # per case, so a --limit run builds the same first cases
        chunks = tuple(pool[j] for j in rng.sample(range(len(pool)), shots))
        cases.append(Case(f"samsum-{i}", chunks, dialogue, (summary,), "summary"))
    return Dataset(SPECS["samsum"], tuple(cases))


DATASETS: dict[str, Callable[..., Dataset]] = {
    "musique": load_musique,
    "wikimqa": load_wikimqa,
    "multi_news": load_multi_news,
    "samsum": load_samsum,
}


def load_dataset(
    name: str, data_dir: str | os.PathLike[str] | None = None, limit: int | None = None, **options: Any
) -> Dataset:
    """Load a data set by name (aliases: 2wikimqa, multinews); options go to its loader (e.g. samsum shots)."""
    return DATASETS[canonical_dataset_name(name)](data_dir, limit, **options)
