"""The traffic benchmark's corpus and questions: SQuAD 2.0 dev, its paragraphs indexed by the package's retriever,
and every question's top-k retrieval, kept in a work folder so that later runs (simulated or real) reuse them.

Each paragraph is one chunk (they are 30-700 tokens, below the 512-token default chunk size but for a few, which stay
whole). A question's topic is its article.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

SQUAD_FILE = Path("squad") / "squad_v2_dev.json"


@dataclass(frozen=True)
class Squad:
    paragraphs: list[str]
    paragraph_article: list[int]
    questions: list[str]
    question_article: list[int]  # the topic of each question
    question_paragraph: list[int]  # the paragraph it was written about
    titles: list[str]


def load_squad(data_dir: Path) -> Squad:
    """Paragraphs and questions in the file's order (questions of one article, then of one paragraph, together)."""
    data = json.loads((data_dir / SQUAD_FILE).read_text(encoding="utf-8"))["data"]
    out = Squad([], [], [], [], [], [])
    for a, article in enumerate(data):
        out.titles.append(article["title"])
        for para in article["paragraphs"]:
            p = len(out.paragraphs)
            out.paragraphs.append(para["context"].strip())
            out.paragraph_article.append(a)
            for qa in para["qas"]:
                question = " ".join(qa["question"].split())
                if not question:
                    continue
                out.questions.append(question)
                out.question_article.append(a)
                out.question_paragraph.append(p)
    return out


def chunk_index(squad: Squad, tokenizer, work: Path):
    """The FAISS index of the paragraphs (one chunk each), built once and saved under `work`/index."""
    from cacheblend_rag.retrieval import Chunk, ChunkIndex
    from cacheblend_rag.retrieval.index import index_folder_state

    folder = work / "index"
    if index_folder_state(folder) == "index":
        return ChunkIndex.load(folder)
    chunks = [
        Chunk(text, squad.titles[a], i, len(tokenizer.encode(text, add_special_tokens=False)))
        for i, (text, a) in enumerate(zip(squad.paragraphs, squad.paragraph_article, strict=True))
    ]
    print(f"embedding {len(chunks)} paragraphs", file=sys.stderr)
    index = ChunkIndex.build(chunks, show_progress=False)
    index.save(folder)
    return index


def retrievals(squad: Squad, index, k: int, work: Path) -> list[list[int]]:
    """Every question's top-k paragraphs (indexes), best first; computed once and saved under `work`."""
    from cacheblend_rag.sizing import retrieve

    path = work / f"retrieved-top{k}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if len(saved) == len(squad.questions):
            return saved
    print(f"retrieving the top {k} paragraphs of {len(squad.questions)} questions", file=sys.stderr)
    found = retrieve(index, squad.questions, k)
    path.write_text(json.dumps(found))
    return found


def export_corpus(squad: Squad, folder: Path) -> tuple[Path, Path]:
    """The paragraphs as one text file each under `folder`/docs and the questions one per line, for `plan`."""
    docs = folder / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(squad.paragraphs):
        (docs / f"p{i:04d}.txt").write_text(text + "\n", encoding="utf-8")
    questions = folder / "questions.txt"
    questions.write_text("\n".join(squad.questions) + "\n", encoding="utf-8")
    return docs, questions
