"""How easy the package is to follow, counted in one run: the figures the design is held to, each against its limit.

    python benchmarks/structure.py            # prints each figure, its limit and PASS/FAIL; exit 1 on any FAIL

- frames: call hops inside the package from `engine.generate` down to `fusion.fuse`, in one blended request on a
  tiny random model (read from the live stack when `fuse` is entered);
- after_layer: lines of the package that name `after_layer` (layer events reach one object, not a parameter
  threaded through many signatures);
- mixins: classes the engine is assembled from besides itself (`CacheBlendEngine.__mro__`, package classes only);
- integration imports: imports in the two integration packages (tests aside) of package modules other than the
  public API (`cacheblend_rag`, `cacheblend_rag.frameworks`, `cacheblend_rag.errors`);
- EngineConfig fields; modules in `engine/serving/`; product modules over 350 lines (a few lines of slack: 360);
- docs: lines of `docs/*.md`, of `docs/benchmarks.md` and of the README;
- outside paths: product modules that name `../shared`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cacheblend_rag"
PUBLIC = {"cacheblend_rag", "cacheblend_rag.frameworks", "cacheblend_rag.errors"}
MODULE_LINES = 360  # "no module over about 350 lines"

# (name, limit): each figure must be at most its limit.
LIMITS = {
    "frames generate -> fuse": 6,
    "lines naming after_layer": 4,
    "mixins in CacheBlendEngine": 0,
    "internal imports in the integrations": 0,
    "EngineConfig fields": 12,
    "modules in engine/serving": 12,
    f"product modules over {MODULE_LINES} lines": 0,
    "docs/*.md lines": 2500,
    "docs/benchmarks.md lines": 600,
    "README lines": 160,
    "product modules naming ../shared": 0,
}


def _product_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def frames_generate_to_fuse() -> int:
    """Hops between the frame of `generate` and the frame of `fuse`, package frames only, in a blended request."""
    from cacheblend_rag import CacheBlendEngine, EngineConfig
    from cacheblend_rag.fusion import fusor
    from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer

    engine = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(device="cpu"))
    chunks = ["w3 w4 w5 w6 w7 w8 w9 w10 " * 4, "w11 w12 w13 w14 w15 w16 " * 4]
    engine.precompute(chunks)
    chains: list[list[str]] = []
    target = inspect.unwrap(fusor.fuse).__code__  # the function itself, not a decorator's wrapper

    def watch(frame, event, arg):  # sys.setprofile: every call on this thread
        if event == "call" and frame.f_code is target:
            chain = []
            while frame is not None:
                if Path(frame.f_code.co_filename).resolve().is_relative_to(PACKAGE):
                    chain.append(frame.f_code.co_name)
                frame = frame.f_back
            chains.append(chain)

    sys.setprofile(watch)
    try:
        engine.generate(chunks, "w20 w21?", mode="blend", max_new_tokens=1)
    finally:
        sys.setprofile(None)
        engine.close()
    if not chains or "generate" not in chains[0]:
        raise SystemExit(f"fuse was not reached from generate on the calling thread: {chains}")
    chain = chains[0][: chains[0].index("generate") + 1]
    print("path:", " <- ".join(chain), file=sys.stderr)
    return len(chain) - 1  # chain[0] is fuse itself: the index of generate counts the hops


def lines_naming(word: str) -> int:
    return sum(line.count(word) > 0 for p in _product_modules() for line in p.read_text().splitlines())


def engine_mixins() -> int:
    from cacheblend_rag import CacheBlendEngine

    ours = [c for c in CacheBlendEngine.__mro__[1:] if c.__module__.startswith("cacheblend_rag")]
    return len(ours)


def integration_imports() -> int:
    pattern = re.compile(r"^\s*(?:from|import)\s+(cacheblend_rag[\w.]*)", re.MULTILINE)
    root = ROOT / "integrations"
    return sum(
        module not in PUBLIC
        for path in root.rglob("*.py")
        if "tests" not in path.parts and "__pycache__" not in path.parts
        for module in pattern.findall(path.read_text())
    )


def lines(paths) -> int:
    return sum(len(Path(p).read_text().splitlines()) for p in paths)


def report() -> dict[str, int]:
    from cacheblend_rag import EngineConfig

    serving = [p for p in (PACKAGE / "engine" / "serving").glob("*.py") if p.name != "__init__.py"]
    return {
        "frames generate -> fuse": frames_generate_to_fuse(),
        "lines naming after_layer": lines_naming("after_layer"),
        "mixins in CacheBlendEngine": engine_mixins(),
        "internal imports in the integrations": integration_imports(),
        "EngineConfig fields": len(dataclasses.fields(EngineConfig)),
        "modules in engine/serving": len(serving),
        f"product modules over {MODULE_LINES} lines": sum(lines([p]) > MODULE_LINES for p in _product_modules()),
        "docs/*.md lines": lines((ROOT / "docs").glob("*.md")),
        "docs/benchmarks.md lines": lines([ROOT / "docs" / "benchmarks.md"]),
        "README lines": lines([ROOT / "README.md"]),
        "product modules naming ../shared": sum("../shared" in p.read_text() for p in _product_modules()),
    }


def main(argv: list[str] | None = None) -> int:
    figures = report()
    failed = 0
    for name, value in figures.items():
        ok = value <= LIMITS[name]
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value} (at most {LIMITS[name]})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
