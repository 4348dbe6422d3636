"""What the benchmark scripts' command lines share: where results go, the engine options, checks made before a
model loads, and the setup a run remembers in its run.json."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cacheblend_rag import CacheBlendEngine, EngineConfig
from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.evaluation.datasets import canonical_dataset_name
from cacheblend_rag.models import DEFAULT_PRESET
from cacheblend_rag.models.presets import find_preset

RESULTS_ROOT = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results


def results_dir(name: str) -> Path:
    """The default output folder of the benchmark `name`: benchmarks/results/NAME, wherever it is run from."""
    return RESULTS_ROOT / name


def model_name(model: str | None) -> str:
    """The real name of `--model`: the preset's own name (aliases and the default resolved), else the path."""
    preset = find_preset(model or DEFAULT_PRESET)
    return preset.name if preset is not None else str(model)


def cpu_name() -> str:
    """The CPU's model name and its AVX-512 / AMX flags (or "no AVX-512/AMX"), for every timing table."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    for line in text.splitlines():
        if line.startswith("model name"):
            extra = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text]
            return f"{line.split(':', 1)[1].strip()} ({', '.join(extra) or 'no AVX-512/AMX'})"
    return platform.processor() or "unknown CPU"


def require_eval_deps() -> None:
    """CacheBlendError naming the missing packages when Rouge-L or the figures cannot be made."""
    missing = [m for m in ("rouge_score", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise CacheBlendError(f"the benchmarks need {', '.join(missing)}: pip install 'cacheblend-rag[eval]'")


def dataset_names(text: str, limit: int | None) -> list[str]:
    """The canonical, de-duplicated names of --datasets, after checking --limit (both before any model loads)."""
    if limit is not None and limit < 1:
        raise CacheBlendError(f"--limit must be >= 1, got {limit}")
    names = list(dict.fromkeys(canonical_dataset_name(n) for n in text.split(",") if n.strip()))
    if not names:
        raise CacheBlendError("--datasets names no data set; e.g. musique,wikimqa")
    return names


def parse_ratios(text: str) -> list[float]:
    """ "0.05,0.15" -> recompute ratios in (0, 1], duplicates dropped."""
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CacheBlendError(f"--ratios must be comma-separated numbers in (0, 1], got {text!r}") from None
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise CacheBlendError(f"--ratios must be comma-separated numbers in (0, 1], got {text!r}")
    return list(dict.fromkeys(ratios))


def add_out_argument(parser: argparse.ArgumentParser, name: str, what: str) -> None:
    """--out, by default benchmarks/results/NAME."""
    parser.add_argument("--out", type=Path, default=results_dir(name), help=f"{what} (default: {results_dir(name)})")


def add_engine_arguments(parser: argparse.ArgumentParser, folders: str, *, dtype_help: str | None = None) -> None:
    """--data-dir, --model, --device and --dtype, the arguments every benchmark that loads a model takes."""
    parser.add_argument("--data-dir", help=f"folder with {folders} (default: $CACHEBLEND_RAG_DATA)")
    parser.add_argument("--model", help="preset name or local checkpoint (default: the default preset)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help=dtype_help)


def dataset_benchmark(
    doc: str,
    name: str,
    *,
    datasets: str,
    datasets_help: str,
    methods: str,
    methods_help: str,
    out_help: str,
    folders: str,
) -> argparse.ArgumentParser:
    """The command line a benchmark over data sets starts from: the script's docstring as its description,
    --datasets, --methods, --limit (first N cases), --out (benchmarks/results/NAME) and the engine arguments.
    The script adds its own, then runs `run_guarded(run, parser.parse_args(argv))`; its run begins with
    `checked_datasets(args)`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default=datasets, help=datasets_help)
    p.add_argument("--methods", default=methods, help=methods_help)
    p.add_argument("--limit", type=int, help="first N cases of each data set (default: all)")
    add_out_argument(p, name, out_help)
    add_engine_arguments(p, folders)
    return p


def checked_datasets(args: argparse.Namespace) -> list[str]:
    """What a benchmark over data sets checks first, before any model loads: the evaluation packages
    (`require_eval_deps`), --limit and --datasets. The canonical data set names."""
    require_eval_deps()
    return dataset_names(args.datasets, args.limit)


def load_engine(args: argparse.Namespace) -> CacheBlendEngine:
    """The engine of --model/--device/--dtype, its load time reported on stderr."""
    t = time.perf_counter()
    engine = CacheBlendEngine.from_pretrained(args.model, config=EngineConfig(device=args.device, dtype=args.dtype))
    print(f"model {model_name(args.model)} ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return engine


def run_settings_of(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """What a run's results depend on besides its methods and cases (the model by its real name, --dtype,
    --device): kept with the results, so that a resumed run cannot mix setups (`records.check_run_settings`),
    and named in the figures."""
    return {"model": model_name(args.model), "dtype": args.dtype, "device": args.device, **extra}


def write_results(out: Path, report: dict[str, Any], summary: str) -> None:
    """OUT/results.json (the report) and OUT/summary.md (its table), then the table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "summary.md").write_text(summary + "\n")
    print(summary)


def report_written(files: dict[str, Path]) -> None:
    print("wrote " + ", ".join(str(p) for p in files.values()), file=sys.stderr)


def run_guarded(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`command(args)`, with a CacheBlendError (bad input, missing data) told on stderr as exit status 2."""
    try:
        return command(args)
    except CacheBlendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class Transcript:
    """What a benchmark prints, kept to be written to OUT/summary.txt as well."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def write(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "summary.txt"
        path.write_text("\n".join(self.lines) + "\n")
        print(f"wrote {path}")
        return path


def number_list(
    p: argparse.ArgumentParser, option: str, text: str, kind: type, ok: Callable[[Any], bool], want: str
) -> list:
    """A comma-separated option of numbers of `kind`, each passing `ok` (else a usage error naming `want`)."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(ok(v) for v in values):
        p.error(f"{option} must be comma-separated {want}, got {text!r}")
    return list(dict.fromkeys(values))


def gap_list(p: argparse.ArgumentParser, text: str) -> list[float | None]:
    """--token-gaps (`ServingConfig.max_token_gap_s` values): 'none' or seconds >= 0, comma-separated."""
    gaps: list[float | None] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            gap = None if item == "none" else float(item)
        except ValueError:
            gap = -1.0
        if gap is not None and not 0 <= gap < float("inf"):
            p.error(f"--token-gaps must be comma-separated 'none' or seconds >= 0, got {text!r}")
        gaps.append(gap)
    if not gaps:
        p.error(f"--token-gaps must name at least one gap ('none' or seconds), got {text!r}")
    return list(dict.fromkeys(gaps))
