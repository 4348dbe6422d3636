"""Resumable benchmark records: one JSON object per line, appended and synced as each measurement ends.

An interrupted run loses at most the record in flight; a torn last line is dropped (and cut from the file
before appending resumes). `run.json` beside the records remembers the setup (model, dtype, ...), and resuming
with another setup is refused, since the numbers would not belong in one table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cacheblend_rag.errors import CacheBlendError

RUN_FILE = "run.json"
MODEL_UNKNOWN = "model not recorded"  # what a figure names when run.json has no model


def load_records(
    out_dir: str | os.PathLike[str], *, repair: bool = False, filename: str = "results.jsonl"
) -> list[dict[str, Any]]:
    """Records of `OUT/filename`. A torn last line (the process died mid-write) is dropped, and with
    `repair=True` cut from the file, so that appending goes on from a clean line."""
    path = Path(out_dir) / filename
    if not path.exists():
        return []
    data = path.read_bytes()
    records, good_end, pos = [], 0, 0
    for line in data.splitlines(keepends=True):
        pos += len(line)
        if not line.strip():
            good_end = pos
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if pos == len(data) and not line.endswith(b"\n"):
                break  # torn tail
            raise CacheBlendError(f"{path}: a line before the last is not valid JSON; fix or remove it") from None
        if not line.endswith(b"\n"):
            break  # complete JSON but no newline: treat as torn too, it is rewritten on resume
        records.append(rec)
        good_end = pos
    if repair and good_end < len(data):
        with path.open("r+b") as f:
            f.truncate(good_end)
    return records


def append_record(path: Path, record: Mapping[str, Any]) -> None:
    """Append one record as a line and sync it to disk."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_settings(out: str | os.PathLike[str]) -> dict[str, Any]:
    """The setup remembered in `out`'s run.json (empty when there is none)."""
    path = Path(out) / RUN_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def check_run_settings(out: Path, settings: Mapping[str, Any]) -> None:
    """Refuse to add to `out` when it holds results of another setup; remember this setup otherwise."""
    path = out / RUN_FILE
    old = run_settings(out)
    if old:
        differ = {k: (old.get(k), v) for k, v in settings.items() if k in old and old[k] != v}
        if differ:
            details = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
            raise CacheBlendError(f"{out} holds results of another setup ({details}); use another --out")
    merged = {**old, **settings}
    path.write_text(json.dumps(merged, indent=2) + "\n")


def take_records(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    settings: Mapping[str, Any],
    filename: str,
    keep: Callable[[Mapping[str, Any]], bool],
) -> int:
    """Append to `out`'s records those of `src` for which `keep(record)` is true and that `out` lacks (by data set,
    case and method), when `src` ran the same setup (`settings`). -> how many were taken.

    A new variant measured beside methods another run already measured (e.g. `fidelity.py --take-records`) then
    computes only what is new; pairing still checks each record's reference answer where the reader does."""
    theirs = run_settings(src)
    differ = {k: (theirs.get(k), v) for k, v in settings.items() if theirs.get(k) != v}
    if differ:
        details = ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
        raise CacheBlendError(f"{src} holds results of another setup ({details}); its records cannot be taken")
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    check_run_settings(target, settings)
    have = {(r["dataset"], r["case_id"], r["method"]) for r in load_records(target, repair=True, filename=filename)}
    taken = 0
    for r in load_records(src, filename=filename):
        if (r["dataset"], r["case_id"], r["method"]) not in have and keep(r):
            append_record(target / filename, r)
            taken += 1
    return taken
