"""Retrieval set-up of `cacheblend-rag ask --docs`: a first ask, a second over the unchanged folder, a third after one
file changed.

Each ask runs in a fresh Python process, as a user's would, and times what `ask` does before its first question:
loading the embedding model, then finding the files, hashing them, and loading, updating or building the folder's
index (`cli.sources.read_sources` + `build_index`, with --kv-dir in a temporary folder, so the index is kept beside
the chunk KV). The LLM's tokenizer is loaded before the clock starts (`ask` has it with the model). The folder is
copied to a temporary folder first and the copy's --change file gets a paragraph before the third ask; the folder
given is never written.

    python benchmarks/ask_index.py --docs docs --out benchmarks/results/ask-index
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib.cli import add_out_argument, cpu_name, model_name, write_results

ASKS = ("first ask", "second ask, folder unchanged", "third ask, one file changed")


def one_ask(docs: str, kv_dir: str, model: str | None, extra: list[str]) -> dict:
    """One ask's retrieval set-up, in this process (a fresh one): seconds and what the index reused."""
    from cacheblend_rag.cli.args import build_parser, check_kv_dir
    from cacheblend_rag.cli.plan import tokenizer_and_config
    from cacheblend_rag.cli.sources import build_index, read_sources
    from cacheblend_rag.retrieval import load_embedder

    argv = ["ask", "--docs", docs, "--kv-dir", kv_dir, *(["--model", model] if model else []), *extra, "q?"]
    args = build_parser().parse_args(argv)
    check_kv_dir(args)  # `ask` checks (and marks) its KV folder before anything else
    tokenizer, _ = tokenizer_and_config(args.model)
    t0 = time.perf_counter()
    load_embedder()
    t1 = time.perf_counter()
    sources = read_sources(args)
    index = build_index(args, sources, tokenizer)
    t2 = time.perf_counter()
    update = sources.update
    assert update is not None, "--docs is compared with its kept index"
    size = sum((Path(docs) / f.source).stat().st_size for f in update.files)
    return {"embedder_s": t1 - t0, "index_s": t2 - t1, "chunks": len(index), "bytes": size,
            "reused": len(update.reused), "reindexed": list(update.reindexed), "removed": list(update.removed),
            "summary": update.summary()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", required=True, help="a folder of text files (read as `ask --docs` reads it)")
    p.add_argument("--change", help="the file (relative to --docs) changed before the third ask (default: the first)")
    p.add_argument("--model", help="whose tokenizer splits the files (default: the default preset)")
    p.add_argument("--ask-option", action="append", default=[], metavar="OPT",
                   help="another option for `ask`, e.g. --ask-option=--glob=**/*.1; repeat for several")  # fmt: skip
    p.add_argument("--one-ask", metavar="KV_DIR", help=argparse.SUPPRESS)  # the child process: one ask over --docs
    add_out_argument(p, "ask-index", "results.json and summary.md")
    args = p.parse_args(argv)
    if args.one_ask:
        print(json.dumps(one_ask(args.docs, args.one_ask, args.model, args.ask_option)))
        return 0

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "docs"
        shutil.copytree(args.docs, docs, symlinks=True)
        change = docs / (args.change or sorted(p.relative_to(docs) for p in docs.rglob("*") if p.is_file())[0])
        for i, label in enumerate(ASKS):
            if i == 2:
                with change.open("a", encoding="utf-8") as f:
                    f.write("\n\nA paragraph added before the third ask, so this file is indexed again.\n")
            child = [sys.executable, __file__, "--docs", str(docs), "--one-ask", str(Path(tmp) / "kv"),
                     *(["--model", args.model] if args.model else []),
                     *(f"--ask-option={o}" for o in args.ask_option)]  # fmt: skip
            done = subprocess.run(child, capture_output=True, text=True, env=os.environ)
            if done.returncode:
                sys.exit(f"the {label} failed:\n{done.stderr}")
            runs.append({"ask": label, **json.loads(done.stdout.splitlines()[-1])})
            print(f"{label}: {runs[-1]['summary']}", file=sys.stderr)

    report = dict(cpu=cpu_name(), docs=args.docs, kilobytes=round(runs[0]["bytes"] / 1024),
                  model=model_name(args.model), changed=str(change.relative_to(docs)), runs=runs)  # fmt: skip
    rows = "\n".join(
        f"| {r['ask']} | {r['reused']} | {len(r['reindexed'])} | {r['embedder_s']:.2f} | {r['index_s']:.2f} | "
        f"{r['embedder_s'] + r['index_s']:.2f} |"
        for r in runs
    )
    first = runs[0]
    text = (f"`ask --docs {args.docs}` ({len(first['reindexed'])} files, {report['kilobytes']} KB, {first['chunks']} "
            f"chunks of the {report['model']} tokenizer; {report['changed']} changed before the third) on "
            f"{report['cpu']}; each ask a fresh process\n\n"
            "| ask | files reused | files indexed | embedder load (s) | index (s) | retrieval set-up (s) |\n"
            f"|---|---:|---:|---:|---:|---:|\n{rows}")  # fmt: skip
    write_results(args.out, report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
