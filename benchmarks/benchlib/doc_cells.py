"""The cells and rows the generated tables of docs/benchmarks.md are made of (`doc_tables` builds the tables)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SETS = ("multi_news", "musique", "samsum", "wikimqa")
SET_NAMES = {"multi_news": "MultiNews", "musique": "MuSiQue", "samsum": "SAMSum", "wikimqa": "2WikiMQA"}


@dataclass(frozen=True)
class Table:
    """One generated table: the results files it reads (relative to benchmarks/results) and its builder."""

    sources: tuple[str, ...]
    build: Callable[[Path], list[str]]  # results folder -> the table's lines


def json_file(results: Path, name: str) -> Any:
    return json.loads((results / name).read_text(encoding="utf-8"))


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def head(*names: str, numeric_from: int = 1) -> list[str]:
    rule = ["---" if i < numeric_from else "---:" for i in range(len(names))]
    return [row(*names), "|" + "|".join(rule) + "|"]


def ci(value: float, ci: list[float], digits: int = 3) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def signed_ci(value: float, ci: list[float], digits: int = 4) -> str:
    return f"{value:+.{digits}f} [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"
