"""`cacheblend-rag calibrate`: fit the recompute ratio and the fidelity guard to a sample of the user's questions,
and `ask --fidelity-profile`, which applies the result.

The sample is either questions over the user's documents (each question's top-k chunks retrieved from the index
`ask` builds) or the cases of a benchmark data set. Every question is measured against full recompute
(`controller.measure_fidelity`); the table of settings, the setting chosen for the target, a held-back check of
that choice and the time per question are printed, and the profile is written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CacheBlendError
from .args import check_kv_dir, check_model_name, check_numbers

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..controller import Estimate, FidelityChoice, FidelityProfile, SampleQuestion


def _targets(args: argparse.Namespace) -> dict[str, float | None]:
    return {"target_first_token": args.target_first_token, "target_top1": args.target_top1, "max_kl": args.target_kl}


@dataclass(frozen=True)
class AppliedProfile:
    profile: FidelityProfile
    choice: FidelityChoice


def apply_fidelity_profile(args: argparse.Namespace, config: EngineConfig) -> tuple[EngineConfig, AppliedProfile]:
    """`ask --fidelity-profile`: the engine config with the chosen ratio and guard (checked before any model
    loads, except the model fingerprint: `AppliedProfile.profile.check_model` once the engine is built)."""
    from ..controller import FidelityProfile
    from ..errors import ConfigError

    if args.ratio is not None:
        raise ConfigError("--ratio pins r and --fidelity-profile chooses it: give one of them")
    if args.guard or args.guard_margin is not None:
        raise ConfigError("--guard sets the guard and --fidelity-profile chooses it: give one of them")
    profile = FidelityProfile.load(args.fidelity_profile)
    if profile.dtype != config.dtype:
        profile.check_model(profile.model, config.dtype)  # the dtype part of the check, before loading
    choice = profile.choose(**_targets(args))
    print(f"fidelity profile {args.fidelity_profile}: {choice.describe()}", file=sys.stderr)
    return choice.engine_config(config), AppliedProfile(profile, choice)


MAX_QUESTIONS_BYTES = 4 * 1024**2  # far more questions than a calibration measures (each costs a full prefill)


def _sample(args: argparse.Namespace) -> tuple[list[SampleQuestion] | None, list[str], str]:
    """(data set questions, or None and the questions over --docs, what the sample is drawn from)."""
    from ..controller import SampleQuestion

    if bool(args.dataset) == bool(args.docs or args.index):
        raise CacheBlendError("give either --dataset NAME (with --data-dir) or --docs DIR with --questions FILE")
    if args.dataset:
        from ..evaluation import load_dataset

        data = load_dataset(args.dataset, args.data_dir, limit=args.limit)
        items = [
            SampleQuestion(c.id, c.chunks, c.question, data.spec.template, data.spec.max_new_tokens) for c in data.cases
        ]
        return items, [], f"data set {data.spec.name}"
    if not args.questions:
        raise CacheBlendError("--docs needs --questions FILE: the questions to calibrate on, one per line")
    from ..controller.profile import read_small_text_file

    redo = "give a UTF-8 text file of questions, one per line"
    lines = read_small_text_file(Path(args.questions), "a --questions file", MAX_QUESTIONS_BYTES, redo).splitlines()
    questions = [q.strip() for q in lines if q.strip()][: args.limit]
    if not questions:
        raise CacheBlendError(f"--questions {args.questions!r} holds no question; write one per line")
    return None, questions, f"{len(questions)} questions of {args.questions} over {args.docs or args.index}"


def format_table(table: list[Estimate]) -> str:
    def ci(value: float, bounds: tuple[float, float]) -> str:
        return f"{value:.3f} [{bounds[0]:.3f}, {bounds[1]:.3f}]"

    w = max([len("setting"), *(len(e.setting.name) for e in table)])
    rows = [f"{'setting':<{w}} {'first-token':<22} {'top-1':<22} {'mean KL (nats)':<22} compute  escalated"]
    for e in table:
        rows.append(
            f"{e.setting.name:<{w}} {ci(e.first_token, e.first_token_ci):<22} {ci(e.top1, e.top1_ci):<22} "
            f"{ci(e.kl_mean, e.kl_ci):<22} {e.compute_share:7.2f}  {e.escalated:9.0%}"
        )
    return "\n".join(rows)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..config import BlendConfig, EngineConfig, StoreConfig
    from ..controller import Targets, check_grid, measure_fidelity
    from ..engine import CacheBlendEngine
    from ..retrieval import MIN_CHUNK_TOKENS
    from .sources import build_index, index_context, read_sources

    # Arguments, paths and the sample first: loading the model takes seconds, a typo should not.
    check_numbers(
        ("--limit", args.limit, 1),
        ("--top-k", args.top_k, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--chunk-tokens", args.chunk_tokens, MIN_CHUNK_TOKENS),
        ("--max-doc-mb", args.max_doc_mb, 0),
        ("--held-back", args.held_back, 0),
    )
    if not args.held_back < 1:
        raise CacheBlendError(f"--held-back must be a share below 1 (0: no check), got {args.held_back}")
    check_grid(args.ratios, args.thresholds, args.ratio, args.ladder, args.margins)
    Targets(args.target_first_token, args.target_top1, args.target_kl)
    check_model_name(args.model)
    check_kv_dir(args)
    items, questions, source = _sample(args)
    sources = read_sources(args) if items is None else None
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        blend=BlendConfig(args.ratio),
        store=StoreConfig(disk_dir=args.kv_dir, redis_url=args.redis_url),
        chunk_context=args.chunk_context,
    )
    t = time.perf_counter()
    engine = CacheBlendEngine.from_pretrained(args.model, config=config)
    context = "auto"  # a sample's own chunks are its corpus, unless an index gives the whole one
    print(f"model {args.model or 'default preset'} ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    if items is None:
        from ..controller import SampleQuestion

        assert sources is not None
        index = build_index(args, sources, engine.tokenizer)
        context = index_context(engine)  # as `ask` will run
        items = [
            SampleQuestion(
                f"q{i}", tuple(h.chunk.text for h in index.search(q, k=args.top_k)), q, None, args.max_new_tokens
            )
            for i, q in enumerate(questions)
        ]

    header = {"model": engine.fingerprint, "dtype": config.dtype, "source": source, "context": context,
              "chunk_context": config.chunk_context}  # fmt: skip
    journal = Journal(Path(f"{args.out}.partial.jsonl"), header)
    if journal.done:
        print(f"resuming: {len(journal.done)} questions already measured in {journal.path}", file=sys.stderr)

    def progress(record: dict) -> None:
        journal.append(record)  # on disk before the next question: a killed run loses at most the one in flight
        print(f"  {record['id']}: {record['prompt_tokens']} tokens, {record['seconds']:.1f}s", file=sys.stderr)

    print(f"measuring {len(items)} questions ({source})", file=sys.stderr)
    t = time.perf_counter()
    profile = measure_fidelity(
        engine, items, ratios=args.ratios, thresholds=args.thresholds, margins=args.margins, base_ratio=args.ratio,
        ladder=args.ladder, source=source, on_question=progress, context=context, done=journal.done,
    )  # fmt: skip
    elapsed = time.perf_counter() - t
    profile.save(args.out)
    journal.path.unlink(missing_ok=True)
    print(f"\n{format_table(profile.table())}\n")
    print(f"chosen: {profile.choose(**_targets(args)).describe()}")
    cut = len(items) - round(len(items) * args.held_back)
    if 0 < cut < len(items):
        print(f"held back: {profile.held_back_check(cut / len(items), **_targets(args)).describe()}")
    else:
        print(f"held back: no check ({len(items)} questions and --held-back {args.held_back} leave one side empty)")
    print(f"{elapsed / len(items):.1f}s per question ({len(items)} in {elapsed:.0f}s); profile written to {args.out}")
    engine.store.flush()
    return 0


class Journal:
    """The records of a calibration measured so far, one JSON line each after a header of what they depend on,
    appended and synced per question; a rerun with the same header resumes from them, another starts afresh."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.done = path, {}
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []
        if lines and _json_or_none(lines[0]) == {"journal": header}:
            for line in lines[1:]:  # a line cut by a kill is not JSON: that question is measured again
                record = _json_or_none(line)
                if isinstance(record, dict) and isinstance(record.get("id"), str):
                    self.done[record["id"]] = record
        else:
            self._write(json.dumps({"journal": header}) + "\n", mode="w")

    def append(self, record: dict) -> None:
        self._write(json.dumps(record) + "\n", mode="a")

    def _write(self, text: str, mode: str) -> None:
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def _json_or_none(line: str) -> object:
    try:
        return json.loads(line)
    except ValueError:
        return None
