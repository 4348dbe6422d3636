"""The command line's arguments: the parser of `cacheblend-rag` and the checks made before anything loads.

Every option has help text, and `--help` shows each default (None and off flags excepted).
"""

from __future__ import annotations

import argparse
import math

from ..config import CHUNK_CONTEXTS, Guard
from ..errors import CacheBlendError
from ..retrieval.sources import DEFAULT_MAX_DOCUMENT_BYTES

MODES = ("full", "prefix", "reuse", "blend")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` where there is a default to show: not for None or for an off switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def check_numbers(*checks: tuple[str, float | None, float]) -> None:
    """(flag, value, lowest allowed) of numeric flags, checked before anything loads; None is not given."""
    for flag, value, low in checks:
        if value is None:
            continue
        if not math.isfinite(value):
            raise CacheBlendError(f"{flag} must be a finite number >= {low}, got {value}")
        if value < low:
            raise CacheBlendError(f"{flag} must be >= {low}, got {value}")


def _add_document_arguments(parser: argparse._ActionsContainer, *, required: bool) -> None:
    """--docs and how its files are chosen and read (`ask` and `index`)."""
    unless = "" if required else " (not needed with --index of a saved index)"
    parser.add_argument("--docs", required=required, metavar="DIR",
                        help=f"folder (or one file) of text documents to answer from{unless}")  # fmt: skip
    parser.add_argument("--encoding", default="utf-8", help="text encoding of the files, e.g. latin-1")
    parser.add_argument("--suffix", action="append", metavar=".EXT", help="read the files ending in .EXT instead "
                        "of .txt/.md/.rst; repeat for several")  # fmt: skip
    parser.add_argument("--glob", action="append", metavar="PATTERN", help="read the files whose path inside "
                        "--docs matches PATTERN ('**' for any folders, e.g. '**/copyright' for files without a "
                        "suffix); repeat for several. With --glob, .txt/.md/.rst are read only if --suffix names "
                        "them")  # fmt: skip
    parser.add_argument("--follow-links", action="store_true", help="also read symbolic links (to files or "
                        "folders) that lead out of --docs; they are skipped by default")  # fmt: skip
    parser.add_argument("--max-doc-mb", type=float, default=DEFAULT_MAX_DOCUMENT_BYTES / 2**20,
                        help="refuse a document above this many MB (splitting runs at about 0.1 MB/s)")  # fmt: skip
    parser.add_argument("--chunk-tokens", type=int, default=512, help="chunk size, in tokens of the model")


def _add_index_cache_argument(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--no-index-cache", action="store_true", help="index --docs in memory only; by default its "
                        "index is kept (beside --kv-dir's chunk KV, else under $CACHEBLEND_RAG_HOME, default "
                        "~/.cache/cacheblend-rag) and later runs embed only the files that changed")  # fmt: skip


def _add_runtime_arguments(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--model", help="preset, local checkpoint or hub id (default: the default preset)")
    parser.add_argument("--device", default="auto", help="torch device to run the model on: auto (the default: the "
                        "GPU where torch sees one, else the CPU), cpu, cuda or cuda:N")  # fmt: skip
    parser.add_argument("--dtype", default="auto", help="model precision: auto (the default: bfloat16 on a GPU or a "
                        "CPU with AMX / AVX-512-BF16, else float32), float32, bfloat16 or float16")  # fmt: skip
    parser.add_argument("--chunk-context", choices=tuple(CHUNK_CONTEXTS), default="grouped",
                        help="how chunk KV is cached: grouped (each chunk within a group of similar chunks of the "
                        "index, and as full prefills of questions held it), captured (alone, and as full prefills "
                        "held it) or isolated (alone only, the paper's setting)")  # fmt: skip
    parser.add_argument("--kv-dir", help="keep chunk KV on disk in this folder, so later runs reuse it")
    parser.add_argument("--redis-url", help="share chunk KV through this Redis, e.g. redis://127.0.0.1:6379/0")


def add_calibrate_parser(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    from ..controller.fidelity_profile import DEFAULT_LADDER, DEFAULT_MARGINS, DEFAULT_RATIOS, DEFAULT_THRESHOLDS

    cal = sub.add_parser("calibrate", help="measure fidelity to full recompute on a sample of your questions and "
                         "choose the recompute ratio / guard for a target", formatter_class=formatter)  # fmt: skip
    cal.add_argument("--out", required=True, help="where to write the fidelity profile (JSON)")
    cal.add_argument("--questions", help="text file of questions over --docs, one per line")
    _add_document_arguments(cal, required=False)
    cal.add_argument("--index", help="folder for the chunk index of --docs, as for `ask`")
    _add_index_cache_argument(cal)
    cal.add_argument("--top-k", type=int, default=6, help="chunks retrieved per question (with --docs)")
    cal.add_argument("--dataset", help="instead of --docs: a benchmark data set (musique, wikimqa, ...)")
    cal.add_argument("--data-dir", help="folder of the data sets (with --dataset; default: $CACHEBLEND_RAG_DATA)")
    cal.add_argument("--limit", type=int, default=30, help="questions in the sample")
    cal.add_argument("--max-new-tokens", type=int, default=32, help="length of full recompute's reference answer "
                     "(with --docs; a data set has its own)")  # fmt: skip
    _add_runtime_arguments(cal)
    cal.add_argument("--ratio", type=float, default=0.15, help="the base ratio a guard starts from")
    cal.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS), help="fixed ratios measured")
    cal.add_argument("--thresholds", type=float, nargs="+", default=list(DEFAULT_THRESHOLDS),
                     help="the guard's KL trigger: max_kl values (nats) to measure; 0 escalates every "
                     "request")  # fmt: skip
    cal.add_argument("--margins", type=float, nargs="+", default=list(DEFAULT_MARGINS),
                     help="the guard's margin trigger: min_margin values (first-token top-1 minus top-2 "
                     "probability) to measure")  # fmt: skip
    cal.add_argument("--ladder", type=float, nargs="+", default=list(DEFAULT_LADDER), help="the guard's ratios")
    _add_target_arguments(cal)
    cal.add_argument("--held-back", type=float, default=0.33, help="share of the sample (the last questions) "
                     "held back to check the choice made on the others")  # fmt: skip


def _add_target_arguments(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--target-first-token", type=float, default=0.95, help="share of answers whose first "
                        "token must match full recompute's")  # fmt: skip
    parser.add_argument("--target-top1", type=float, help="mean share of answer tokens ranked first by both")
    parser.add_argument("--target-kl", type=float, help="highest mean KL to full recompute, nats")


def add_fidelity_arguments(ask: argparse._ActionsContainer) -> None:
    """`ask`'s options that apply a fidelity profile."""
    ask.add_argument("--fidelity-profile", help="a fidelity profile (`cacheblend-rag calibrate`): the cheapest "
                     "ratio / guard meeting the targets; with --profile it is the floor r_min")  # fmt: skip
    _add_target_arguments(ask)


def check_model_name(model: str | None) -> None:
    """An old preset name given to --model: one `error:` line (exit 2) naming the preset, before anything loads."""
    if model is None:
        return
    from ..models.presets import find_preset, retired_name_message

    preset = find_preset(model)
    if preset is not None and preset.name != model:
        raise CacheBlendError(retired_name_message(model, preset))


def check_kv_dir(args: argparse.Namespace) -> None:
    """A --kv-dir that is a file, not writable or damaged: one `error:` line (exit 2) before any model loads."""
    if args.kv_dir:
        from ..store import check_disk_dir

        check_disk_dir(args.kv_dir)


def build_parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(prog="cacheblend-rag", description="CacheBlend RAG on Hugging Face models")
    sub = p.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer questions over a folder of text files", formatter_class=_HelpFormatter)
    ask.add_argument("questions", nargs="+", help="one or more questions")
    docs = ask.add_argument_group("documents")
    _add_document_arguments(docs, required=False)
    docs.add_argument("--index", help="folder for the chunk index of --docs (instead of the kept one): reused there, "
                     "only new and changed files embedded again; other settings rebuild it; must be new, empty or an "
                     "index")  # fmt: skip
    _add_index_cache_argument(docs)
    _add_runtime_arguments(ask.add_argument_group("model and store"))
    answering = ask.add_argument_group("answering")
    tuning = ask.add_argument_group("tuning and measuring (docs/configuration.md)")
    tuning.add_argument("--decode-weights", choices=("native", "int8"), default="native",
                     help="int8: decode from int8 copies of the weights (CPU; several times faster per token, the "
                     "first token stays exact, later ones may differ; see docs/benchmarks.md)")  # fmt: skip
    tuning.add_argument("--mode", default="blend", choices=MODES, help="how the prompt's KV is built")
    answering.add_argument("--ratio", type=float, help="recompute ratio for blend (default: the engine's, 0.15)")
    tuning.add_argument(
        "--miss-policy",
        default="auto",
        choices=["auto", "blend", "full"],
        help="a question whose chunks are not stored yet: full prefill then store them (full), prefill each chunk "
        "then blend (blend), or whichever costs less compute (auto)",
    )
    answering.add_argument("--guard", action="store_true", help="turn on the fidelity guard: a blend whose first token "
                     "is a near tie (top-1 minus top-2 probability below --guard-margin) is recomputed in "
                     "full")  # fmt: skip
    # Default None, so a margin given without --guard can be refused; the value used is Guard's default.
    answering.add_argument("--guard-margin", type=float, metavar="M", help="with --guard: the first-token margin below "
                     f"which a blend is recomputed in full, in [0, 1] (default: {Guard().min_margin:g})")  # fmt: skip
    answering.add_argument("--top-k", type=int, default=6, help="chunks retrieved per question")
    answering.add_argument("--max-new-tokens", type=int, default=128, help="longest answer, in tokens")
    answering.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    answering.add_argument("--precompute-all", action="store_true", help="after the answers, compute every chunk's "
                           "KV (timed) into --kv-dir / --redis-url for later runs; the questions are answered first, "
                           "their chunks computed in their own requests")  # fmt: skip
    answering.add_argument("--show-sources", action="store_true", help="print the retrieved chunks' sources")
    tuning.add_argument("--profile", help="a loading profile (`cacheblend-rag profile`): r is chosen per request")
    tuning.add_argument("--min-ratio", type=float, default=0.15, help="with --profile: the quality floor r_min")
    add_fidelity_arguments(tuning)

    prof = sub.add_parser("profile", help="measure blend compute and tier read speeds for the loading controller",
                          formatter_class=_HelpFormatter)  # fmt: skip
    prof.add_argument("--out", required=True, help="where to write the profile (JSON)")
    _add_runtime_arguments(prof)
    prof.add_argument("--token-counts", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths timed")
    prof.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.15, 0.5], help="recompute ratios timed")
    prof.add_argument("--chunk-tokens", type=int, default=512, help="chunk size of the timed prompts")
    prof.add_argument("--repeats", type=int, default=2, help="timings per point (their median is kept)")

    add_calibrate_parser(sub, _HelpFormatter)

    idx = sub.add_parser("index", help="build and save a chunk index of a folder", formatter_class=_HelpFormatter)
    _add_document_arguments(idx, required=True)
    idx.add_argument("--out", required=True, help="folder to save the index to: new, empty or an index")
    idx.add_argument("--model", help="whose tokenizer measures chunk sizes (default: the default preset)")

    add_plan_parser(sub, _HelpFormatter)
    sub.add_parser("models", help="list the packaged model presets")
    env = sub.add_parser("env", help="what a bug report needs: versions, CPU and GPU, what device and dtype 'auto' "
                         "pick here and why, a model's family check, reachable store tiers",
                         formatter_class=_HelpFormatter)  # fmt: skip
    env.add_argument("--model", help="also check whether this preset, folder or cached hub id can be blended")
    env.add_argument("--kv-dir", help="also check that this disk tier folder can be used")
    env.add_argument("--redis-url", help="also check that this Redis answers")
    return p


def add_plan_parser(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    plan = sub.add_parser("plan", help="size a chunk store from your documents and sample questions: hit rate "
                          "and expected TTFT speed-up per budget, with no model run",
                          formatter_class=formatter)  # fmt: skip
    plan.add_argument("--questions", required=True, help="text file of questions, one per line, in arrival order")
    _add_document_arguments(plan, required=False)
    plan.add_argument("--index", help="folder for the chunk index of --docs, as for `ask`")
    _add_index_cache_argument(plan)
    plan.set_defaults(kv_dir=None)  # no chunk KV to keep the index beside
    plan.add_argument("--model", help="whose tokenizer and KV shape (default: the default preset)")
    plan.add_argument("--dtype", default="auto", help="the engine's compute dtype (sizes native entries; "
                      "default: what auto picks here)")  # fmt: skip
    plan.add_argument("--codec", default="native", help="the tier's codec: native, fp16, bf16, int8, int4")
    plan.add_argument("--top-k", type=int, default=6, help="chunks retrieved per question")
    plan.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5, 1.0],
                      help="store budgets as shares of the corpus's KV (an unbounded one is always added)")  # fmt: skip
    plan.add_argument("--eviction", choices=("lru", "lfu"), default="lfu", help="the memory tier's eviction")
    plan.add_argument("--order", choices=("as-given", "shuffled"), default="as-given",
                      help="send the questions in the file's order, or shuffled (no topic locality)")  # fmt: skip
    plan.add_argument("--costs", help="a cost model (JSON) measured on the serving machine (default: the reference "
                      "one of the default preset on this project's CPU)")  # fmt: skip
    plan.add_argument("--measure-costs", metavar="OUT", help="load the model, time a few of the questions' prompts "
                      "(about a minute) and save the cost model to OUT before planning")  # fmt: skip


def guard_from_args(args: argparse.Namespace) -> Guard | None:
    """`ask`'s guard: None without --guard; --guard-margin alone is refused (it would silently do nothing)."""
    if args.guard_margin is not None and not args.guard:
        raise CacheBlendError("--guard-margin sets the threshold of the fidelity guard, which is off: add --guard")
    if not args.guard:
        return None
    margin = args.guard_margin
    if margin is None:
        return Guard()
    if not 0.0 <= margin <= 1.0:  # also refuses nan
        raise CacheBlendError(f"--guard-margin must be a probability in [0, 1] (e.g. 0.05), got {margin}")
    return Guard(min_margin=margin)
