"""The tables of docs/benchmarks.md that are rebuilt from committed results files, one builder per table.

Each builder reads files under `benchmarks/results/` and returns the Markdown table (header, rule, rows); the
`TABLES` registry maps the name a table carries in the doc's markers (`<!-- table:NAME -->`) to its builder and
the files it reads. `benchmarks/tables.py` writes them into the doc and checks them.
"""

from __future__ import annotations

import re
from pathlib import Path

from benchlib.doc_cells import SET_NAMES, SETS, Table
from benchlib.doc_cells import ci as _ci
from benchlib.doc_cells import head as _head
from benchlib.doc_cells import json_file as _json
from benchlib.doc_cells import row as _row
from benchlib.doc_cells import signed_ci as _signed_ci


def md_tables(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """Every table of a Markdown report with the title of the last heading above it (rows as header -> cell)."""
    tables: list[tuple[str, list[dict[str, str]]]] = []
    heading, header, rows = "", None, None
    for line in path.read_text(encoding="utf-8").splitlines() + [""]:
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header, rows = cells, []
            elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(dict(zip(header, cells, strict=False)))
            continue
        if header is not None:
            tables.append((heading, rows))
            header = rows = None
    return tables


def md_table(path: Path, heading: str, column: str) -> list[dict[str, str]]:
    """The first table under a heading starting with `heading` that has `column`."""
    for title, rows in md_tables(path):
        if title.startswith(heading) and rows and column in rows[0]:
            return rows
    raise ValueError(f"{path}: no table with a {column!r} column under a heading {heading!r}")


# -- time to first token ----------------------------------------------------------------------------------------

_TTFT_MODES = (
    ("full", "full recompute"),
    ("prefix", "prefix caching"),
    ("reuse", "full KV reuse"),
    ("attention r=0.05", "**blend, `attention` (default) r = 0.05**"),
    ("attention r=0.15", "**blend, `attention` (default) r = 0.15**"),
    ("paper r=0.05", "blend, `paper` r = 0.05"),
    ("paper r=0.15", "blend, `paper` r = 0.15"),
)


def ttft(results: Path) -> list[str]:
    times = _json(results, "ttft/ttft.json")["results"]["float32"]
    lines = _head("mode", "TTFT (ms)", "full / mode")
    for key, label in _TTFT_MODES:
        lines.append(_row(label, f"{times[key] * 1000:,.0f}", f"{times['full'] / times[key]:.2f}"))
    return lines


def ttft_bf16(results: Path) -> list[str]:
    runs = _json(results, "ttft-bf16/ttft.json")["results"]
    lines = _head("mode", "fp32 TTFT (ms)", "full / mode", "bf16 TTFT (ms)", "full / mode")
    labels = {"full": "full recompute", "prefix": "prefix caching", "reuse": "full KV reuse"}
    for key in ("full", "prefix", "reuse", "blend r=0.05", "blend r=0.15"):
        cells = [labels.get(key, key.replace("r=", "r = "))]
        for dtype in ("float32", "bfloat16"):
            t = runs[dtype]
            cells += [f"{t[key] * 1000:,.0f}", f"{t['full'] / t[key]:.2f}"]
        lines.append(_row(*cells))
    return lines


def dtype_fidelity(results: Path) -> list[str]:
    rows = md_table(results / "dtype-fidelity/summary.md", "", "comparison")
    lines = _head("comparison", "mean KL (nats)", "first-token agreement", "top-1 agreement")
    return lines + [_row(*r.values()) for r in rows]


# -- fidelity ---------------------------------------------------------------------------------------------------

_FIDELITY_METHODS = ("reuse", "attention@0.05", "attention@0.15", "gradual@0.15", "paper@0.05", "paper@0.15")


def fidelity(results: Path) -> list[str]:
    rows = {(r["dataset"], r["method"]): r for r in _json(results, "fidelity/summary.json") if r["group"] == 0}
    lines = _head("method", *(f"{SET_NAMES[s]} ({rows[s, 'reuse']['n']})" for s in SETS), numeric_from=9)
    for method in _FIDELITY_METHODS:
        label = f"**{method} (default)**" if method == "attention@0.15" else method
        cells = []
        for s in SETS:
            r = rows[s, method]
            cells.append(
                f"{_ci(r['kl_mean'], r['kl_ci'])} / {r['top1']:.3f} / {r['first_token']:.2f} / {r['compute_share']:.3f}"
            )
        lines.append(_row(label, *cells))
    return lines


def _guard_rows(report: Path, wanted: tuple[str, ...]) -> list[dict[str, str]]:
    pooled = md_table(report, "pooled", "setting")
    by_setting = {r["setting"].replace(" (0.15 -> 1)", ""): r for r in pooled}
    return [by_setting[w] | {"setting": w} for w in wanted]


_GUARD_SETTINGS = (
    "reuse (r=0)",
    "r=0.05",
    "r=0.15",
    "guard KL to reuse > 1",
    "guard margin < 0.02",
    "guard KL to reuse > 0.5",
    "guard margin < 0.05",
    "guard margin < 0.1",
    "guard margin < 0.2",
    "full recompute",
)


def guard(results: Path) -> list[str]:
    lines = _head("setting", "first token", "top-1", "mean KL", "compute", "escalated", "further than reuse",
                  "speed-up mean / p90")  # fmt: skip
    for r in _guard_rows(results / "guard/guard.md", _GUARD_SETTINGS):
        names = {"guard margin < 0.1": "**`Guard()`: margin < 0.1**", "r=0.15": "r=0.15 (default)"}
        name = names.get(r["setting"], r["setting"])
        lines.append(
            _row(
                name,
                r["first-token agreement"],
                r["top-1 agreement"].split(" ")[0],
                r["mean KL (nats)"],
                r["compute share"],
                r["escalated"],
                r["cases worse than reuse"],
                r["speed-up vs full, mean / p90"],
            )
        )
    return lines


def guard_grouped(results: Path) -> list[str]:
    report = results / "guard-grouped-apart/guard.md"
    per_set = {s: {r["setting"].replace(" (0.15 -> 1)", ""): r for r in md_table(report, f"{s} (", "setting")}
               for s in SETS}  # fmt: skip
    wanted = ("r=0.05", "r=0.15", "guard margin < 0.02", "guard margin < 0.05", "guard margin < 0.1")
    wanted += ("guard margin < 0.2", "guard KL to reuse > 0.5")
    lines = _head("setting", "first token, pooled", "MultiNews / MuSiQue / SAMSum / 2WikiMQA", "compute", "mean KL")
    for r in _guard_rows(report, wanted):
        firsts = " / ".join(per_set[s][r["setting"]]["first-token agreement"].split(" ")[0] for s in SETS)
        name = "**`Guard()`: margin < 0.1**" if r["setting"] == "guard margin < 0.1" else r["setting"]
        kl = r["mean KL (nats)"].split(" ")[0]
        lines.append(_row(name, r["first-token agreement"], firsts, r["compute share"], kl))
    return lines


def _codec_table(results: Path, path: str, codecs: tuple[str, str], base: tuple[str, str],
                 cells: list[tuple[str, str]]) -> list[str]:  # fmt: skip
    """Each (set, method) of `cells`: the KL with exact KV (named base[0]) and each codec's paired difference from
    it (named `codec - base[1]`)."""
    rows = {(r["dataset"], r["codec"], r["method"]): r for r in _json(results, path)}
    lines = _head("set (cases)", "method", f"KL {base[0]}", *(f"{c} - {base[1]} [95% CI]" for c in codecs),
                  numeric_from=2)  # fmt: skip
    for s, method in cells:
        pair = [rows[s, c, method] for c in codecs]
        name = f"{SET_NAMES.get(s, 'all')} ({pair[0]['n']})"
        lines.append(_row(name, method, f"{pair[0]['kl_native']:.4f}",
                          *(_signed_ci(r["kl_diff"], r["kl_diff_ci"]) for r in pair)))  # fmt: skip
    return lines


def codecs(results: Path) -> list[str]:
    pooled = [("pooled", m) for m in ("reuse", "attention@0.05", "attention@0.15")]
    return _codec_table(results, "guard/codecs.json", ("int8", "int4"), ("uncompressed", "native"),
                        pooled + [(s, "attention@0.15") for s in SETS])  # fmt: skip


def codecs_pca(results: Path) -> list[str]:
    """int8 and pca against exact KV on one bf16 run: each set at r = 0.15, then all sets pooled (and full reuse)."""
    cells = [(s, "attention@0.15") for s in (*SETS, "pooled")] + [("pooled", "reuse")]
    return _codec_table(results, "fidelity-pca/codecs.json", ("int8", "pca"), ("exact KV", "exact"), cells)


def codec_bytes(results: Path) -> list[str]:
    report = _json(results, "codec-bytes/results.json")
    lines = _head("codec", "bits per corpus value", "precompute (s)", "warm TTFT from disk (ms)",
                  "first token = exact KV's", "encode / decode (MB/s)", numeric_from=1)  # fmt: skip
    for name, r in report["codecs"].items():
        lines.append(_row(f"`{name}`", f"{r['bits_per_corpus_value']:.2f}", f"{r['precompute_s']:.1f}",
                          f"{r['ttft_s'] * 1000:.0f}", f"{r['first_token_as_native']}/{r['cases']}",
                          f"{r['encode_mb_s']:.0f} / {r['decode_mb_s']:.0f}"))  # fmt: skip
    return lines


# -- serving and traffic ----------------------------------------------------------------------------------------


def traffic_real(results: Path) -> list[str]:
    lines = _head("run", "requests", "hit rate (real = simulated)", "mean TTFT, real / simulated (s)",
                  "full prefill (s)", "speed-up, real / simulated", "answered in full")  # fmt: skip
    for r in (r for r in _json(results, "traffic-bf16/real_vs_simulated.json") if r["requests"] == 500):
        stream, _, budget, _ = r["run"].split("-")
        cells = [f"{r['mean_ttft_s']:.2f} / {r['sim_mean_ttft_s']:.2f}", f"{r['mean_full_s']:.2f}"]
        cells += [f"{r['speedup']:.2f}x / {r['sim_speedup']:.2f}x", r["full_modes"]]
        run = f"{stream}, {float(budget[1:]) * 100:.0f}%"
        lines.append(_row(run, r["requests"], f"{r['hit_rate'] * 100:.1f}%", *cells))
    return lines


def traffic_simulated(results: Path) -> list[str]:
    rows = md_table(results / "traffic/report.md", "Simulated", "policy")
    by = {(r["stream"], r["budget"], r["policy"]): r for r in rows}
    lines = _head("stream", "budget (of corpus KV)", "LRU hit rate", "LFU hit rate", "LFU, share of unbounded",
                  "LFU speed-up")  # fmt: skip
    for stream, budget, _ in [k for k in by if k[2] == "lfu" and k[1] in ("10%", "25%", "50%", "100%")]:
        lru, lfu = by[stream, budget, "lru"], by[stream, budget, "lfu"]
        lines.append(_row(stream, budget, lru["hit rate (seeds: min-max)"], lfu["hit rate (seeds: min-max)"],
                          lfu["of unbounded"], lfu["speed-up"]))  # fmt: skip
    return lines


_LOAD_NAMES = {
    "blend-serial-int8": "blend, serial, int8 decode",
    "blend-batched-int8": "**blend, batched, int8 decode**",
    "full-batched-int8": "full recompute, batched, int8 decode",
}


def load(results: Path) -> list[str]:
    report = _json(results, "load-avx512/results.json")
    lines = _head("setting", "answers/min, per repeat", "generated tok/s, per repeat", "TTFT p90 (s), per repeat",
                  "s per token", "longest gap (s)")  # fmt: skip
    for row in report["rows"]:
        runs = row["runs"]

        def each(key: str, digits: int, runs: list[dict[str, float]] = runs) -> str:
            return ", ".join(f"{run[key]:.{digits}f}" for run in runs)

        s = row["summary"]
        lines.append(_row(_LOAD_NAMES.get(row["setting"], row["setting"]), each("answers_per_min", 2),
                          each("tokens_per_s", 2), each("ttft_p90", 1), f"{s['tpot_s']['mean']:.3f}",
                          f"{s['gap_max_s']['mean']:.2f}"))  # fmt: skip
    return lines


def llamacpp(results: Path) -> list[str]:
    ours = [_json(results, f"decode-epyc-zen5/{p}results.json")["settings"]["int8"] for p in ("", "second-run/")]
    theirs = [_json(results, f"llamacpp-epyc-zen5/{p}results.json")["rows"] for p in ("", "second-run/")]
    lines = _head("engine, weights", "TTFT, 3,143 tokens (s)", "decode tok/s, empty context",
                  "decode tok/s, after the prompt", "last token, 128 (s)", "last token, 256 (s)")  # fmt: skip
    names = {"shipped": "llama.cpp, Q4_K_M (shipped)", "q8_0": "llama.cpp, q8_0", "f16": "llama.cpp, f16"}
    for key, name in names.items():
        runs = [t[key] for t in theirs]

        def each(field: str, digits: int, runs: list[dict[str, float]] = runs) -> str:
            return ", ".join(f"{r[field]:.{digits}f}" for r in runs)

        fields = ("ttft_s", "decode_tokens_per_s_empty", "decode_tokens_per_s", "last_token_128_s", "last_token_256_s")
        lines.append(_row(name, *(each(f, 1) for f in fields)))
    cells = [", ".join(f"{r[k]:.{d}f}" for r in ours) for k, d in (("ttft_s", 2), ("tokens_per_s", 1))]
    last = ", ".join(f"{r['last_token_s']:.1f}" for r in ours)
    lines.append(_row("**cacheblend-rag, blend, int8 decode (bf16)**", f"**{cells[0]}**", "", f"**{cells[1]}**",
                      f"**{last}**", ""))  # fmt: skip
    return lines


def sweep(results: Path) -> list[str]:
    report = _json(results, "sweep/sweep.json")
    lines = _head("chunks x tokens", "prompt tokens", "full (ms)", "prefix (ms)", "reuse (ms)",
                  "blend r = 0.15 (ms)", "full / blend")  # fmt: skip
    seen: set[tuple[int, int]] = set()
    for points in (s["points"] for s in report["sweeps"].values()):
        for p in points:
            if (p["chunks"], p["chunk_tokens"]) in seen:  # the point both sweeps share
                continue
            seen.add((p["chunks"], p["chunk_tokens"]))
            t = p["ttft_s"]
            times = [f"{t[m] * 1000:.0f}" for m in ("full", "prefix", "reuse", "blend r=0.15")]
            lines.append(_row(f"{p['chunks']} x {p['chunk_tokens']}", p["prompt_tokens"], *times,
                              f"{p['speedup']['blend r=0.15']:.2f}"))  # fmt: skip
    return lines


def throughput(results: Path) -> list[str]:
    lines = _head("asks per question", "method", "own TTFT p50 (s)", "mean service (s)", "capacity (req/s)",
                  "chunk hit rate", "highest rate with p90 TTFT <= 60 s", numeric_from=2)  # fmt: skip
    for folder in ("throughput", "throughput-repeats6"):
        report = _json(results, f"{folder}/results.json")
        for m in report["methods"]:
            lines.append(_row(report["settings"]["repeats"], m["method"], f"{m['own_ttft_p50_s']:.1f}",
                              f"{m['service_mean_s']:.2f}", f"{m['capacity_rps']:.3f}", f"{m['hit_rate']:.2f}",
                              f"{m['max_rate_within_slo']:.3f}"))  # fmt: skip
    return lines


def precompute_cost(results: Path) -> list[str]:
    lines = _head("corpus", "CPU", "chunks (tokens)", "each chunk alone (s)", "grouped, the default (s)",
                  "grouped / alone", "entries kept, alone / grouped", numeric_from=2)  # fmt: skip
    for folder, corpus in (("precompute-cost", "86 Debian copyright files"), ("precompute-cost-squad", "SQuAD dev")):
        r = _json(results, f"{folder}/results.json")
        cpu = r["cpu"].split(" (")[0]
        alone, grouped = min(r["runs"]["isolated"]), min(r["runs"]["grouped"])
        entries = f"{r['counts']['isolated']['entries']} / {r['counts']['grouped']['entries']}"
        lines.append(_row(corpus, cpu, f"{r['chunks']} ({r['chunk_tokens']:,})", f"{alone:.1f}", f"{grouped:.1f}",
                          f"{r['ratio']:.2f}x", entries))  # fmt: skip
    return lines


def ask_index(results: Path) -> list[str]:
    lines = _head("ask", "files reused", "files indexed", "embedder load (s)", "index (s)", "retrieval set-up (s)")
    for r in _json(results, "ask-index/results.json")["runs"]:
        total = r["embedder_s"] + r["index_s"]
        lines.append(_row(r["ask"], r["reused"], len(r["reindexed"]), f"{r['embedder_s']:.2f}", f"{r['index_s']:.2f}",
                          f"{total:.2f}"))  # fmt: skip
    return lines


TABLES: dict[str, Table] = {
    "ttft": Table(("ttft/ttft.json",), ttft),
    "ttft-bf16": Table(("ttft-bf16/ttft.json",), ttft_bf16),
    "dtype-fidelity": Table(("dtype-fidelity/summary.md",), dtype_fidelity),
    "fidelity": Table(("fidelity/summary.json",), fidelity),
    "guard": Table(("guard/guard.md",), guard),
    "guard-grouped": Table(("guard-grouped-apart/guard.md",), guard_grouped),
    "codecs": Table(("guard/codecs.json",), codecs),
    "codecs-pca": Table(("fidelity-pca/codecs.json",), codecs_pca),
    "codec-bytes": Table(("codec-bytes/results.json",), codec_bytes),
    "traffic-real": Table(("traffic-bf16/real_vs_simulated.json",), traffic_real),
    "traffic-simulated": Table(("traffic/report.md",), traffic_simulated),
    "load": Table(("load-avx512/results.json",), load),
    "llamacpp": Table(("decode-epyc-zen5/", "llamacpp-epyc-zen5/"), llamacpp),
    "sweep": Table(("sweep/sweep.json",), sweep),
    "throughput": Table(("throughput/results.json", "throughput-repeats6/results.json"), throughput),
    "ask-index": Table(("ask-index/results.json",), ask_index),
    "precompute-cost": Table(("precompute-cost/results.json", "precompute-cost-squad/results.json"), precompute_cost),
}
