"""`ask --precompute-all`: every chunk's KV, computed after the answers, for the later runs that read the store.

Before the first prefill it prints what will be computed and what is reused (the engine's `PrecomputePlan`), and an
estimate of the time: the tokens to prefill at a speed measured in this run (the answers' own prefills) or, without
one, the loading profile's; then a bar with the time left.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..controller import LoadingProfile
    from ..engine import CacheBlendEngine, PrecomputePlan, RequestMetrics
    from ..retrieval import ChunkIndex

__all__ = ["describe_plan", "precompute_after_answers", "prefill_speed"]


def prefill_speed(
    answered: Sequence[RequestMetrics], profile: LoadingProfile | None, tokens: int
) -> tuple[float, str] | None:
    """Prefill tokens per second on this machine, and what the figure is based on: this run's full prefills and
    chunk prefills (those of the answers), else the loading profile's full recompute of `tokens` tokens; None when
    neither is known."""
    done = seconds = count = 0
    for m in answered:
        if m.mode == "full" and m.compute_s > 0:
            done, seconds, count = done + m.prompt_tokens, seconds + m.compute_s, count + 1
        elif m.precompute_s > 0 and m.cold_tokens and not m.chunks_deferred:  # missed chunks prefilled in it
            done, seconds, count = done + m.cold_tokens, seconds + m.precompute_s, count + 1
    if seconds > 0:
        prefills = "prefill" if count == 1 else "prefills"
        return done / seconds, f"this run's {count} {prefills}: {done:,} tokens in {seconds:.1f} s"
    if profile is not None and tokens > 0:
        s = profile.recompute_time(tokens, 1.0)
        if s > 0:
            return tokens / s, f"the loading profile's full prefill of {tokens:,} tokens in {s:.2f} s"
    return None


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def describe_plan(plan: PrecomputePlan, speed: tuple[float, str] | None) -> str:
    """What a precompute is about to do, in a few lines: what it reuses, what it computes and why, how long."""
    grouped = f" in {_count(plan.all_groups, 'group')} of similar chunks" if plan.all_groups else ""
    lines = [f"--precompute-all: {plan.chunks} chunks{grouped}; {plan.stored} have every entry stored (reused), "
             f"{plan.computed} need one computed"]  # fmt: skip
    if plan.partly_stored:
        why = ("each chunk keeps two entries, alone (read at the head of a prompt) and within its group (read "
               "further in), and an answer stores only the one its prompt computed" if plan.all_groups else
               "a chunk with a recorded context keeps two entries, alone and after its context")  # fmt: skip
        lines.append(f"  {plan.partly_stored} of those have an entry stored by earlier answers, which is kept: {why}; "
                     "the missing one is computed now")  # fmt: skip
    work = f"  to compute: {_count(plan.alone, 'chunk')} alone ({plan.alone_tokens:,} tokens)"
    if plan.all_groups:
        work += (f", then {plan.groups} of the {_count(plan.all_groups, 'group')} whole ({plan.group_tokens:,} "
                 "tokens; one prefill of a group gives all its chunks their in-group entries, its stored ones "
                 "computed again)")  # fmt: skip
    lines.append(work)
    if speed is None:
        lines.append(f"  estimate: {plan.tokens:,} tokens; no prefill speed is known yet (no answer prefilled, no "
                     "--profile): the bar shows the time left once the first chunks are done")  # fmt: skip
    else:
        rate, basis = speed
        lines.append(f"  estimate: {plan.tokens:,} tokens, {_duration(plan.tokens / rate)} at {rate:,.0f} "
                     f"tokens/s ({basis}); the bar shows the time left")  # fmt: skip
    return "\n".join(lines)


def precompute_after_answers(
    args: argparse.Namespace, engine: CacheBlendEngine, index: ChunkIndex, context: Any,
    answered: Sequence[RequestMetrics],
) -> None:  # fmt: skip
    """`--precompute-all`: every chunk's KV, computed once the questions are answered (the first answer does not wait
    for the whole folder: its chunks are computed in its own request), for the later runs that read --kv-dir or
    --redis-url; with neither the store ends with the process, so nothing is computed."""
    if not (args.kv_dir or args.redis_url):
        print("--precompute-all: skipped, the chunk KV would live in this process's memory only and end with it; pass "
              "--kv-dir DIR (or --redis-url) to keep it for later runs", file=sys.stderr)  # fmt: skip
        return
    profile = engine.controller.profile if engine.controller is not None else None
    typical = sum(c.token_count for c in index.chunks) // max(len(index), 1) * args.top_k  # a prompt's chunk tokens
    speed = prefill_speed(answered, profile, typical)

    def announce(plan: PrecomputePlan) -> None:
        print(describe_plan(plan, speed), file=sys.stderr, flush=True)

    t = time.perf_counter()
    done = engine.precompute([c.text for c in index.chunks], context=context, show_progress=True, on_plan=announce)
    print(f"precomputed the KV of {len(index)} chunks in {time.perf_counter() - t:.1f}s after the answers "
          f"({done.stored} reused, {done.computed} computed) for later runs", file=sys.stderr)  # fmt: skip
