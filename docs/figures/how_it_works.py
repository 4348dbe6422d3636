"""Draws docs/figures/how_it_works.png, the picture in docs/how-it-works.md.

    python docs/figures/how_it_works.py            # needs matplotlib (the `eval` extra)
    python docs/figures/how_it_works.py --rule gradual --out /tmp/gradual.png

Left: what precompute stores, as `EngineConfig().chunk_context` says (the default, "grouped": the corpus chained
by similarity into groups, each group prefilled once and each chunk after a group's first stored as the group's
prefill computed it, beside every chunk's KV computed alone; `--chunk-context isolated` draws chunks cached alone
only). Right: one request as a grid of layers x prompt
tokens, coloured by what the fusor does there: loaded and kept (the reused KV), recomputed, or exact (the shared
prefix). The default rule (`attention`) is drawn with its first pass, a strip of the attention the question
pays to each chunk token; the tokens it ranks highest are recomputed on every layer. `--rule gradual` draws a
deviation rule instead, with the engine's real schedule (`schedule()`: layer 0 for all, shrinking sets on the
check layers, r on the rest). Scores are made up here; the engine measures them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from cacheblend_rag import RULE_NAMES, BlendConfig, EngineConfig, blend_rule

PREFIX, CHUNK, QUESTION = 6, 22, 8  # tokens per part in the drawing (not to scale)
CHUNKS = 3
LAYERS = 12
COLORS = {"kept": "#d9d9d9", "exact": "#9ecae1", "recomputed": "#e6550d", "question": "#fd8d3c"}


def attention_scores(seed: int = 0) -> np.ndarray:
    """[chunk tokens] made-up attention of the question: a few spans it reads (the evidence), noise elsewhere."""
    rng = np.random.default_rng(seed)
    n_reused = CHUNKS * CHUNK
    scores = rng.gamma(1.0, 0.25, n_reused)
    for start, width in ((9, 5), (CHUNK + 15, 4), (2 * CHUNK + 4, 3)):  # the spans that answer the question
        scores[start : start + width] += rng.uniform(1.5, 2.5, width)
    return scores


def recompute_grid(config: BlendConfig, seed: int = 0) -> np.ndarray:
    """[LAYERS, N] codes: 0 loaded and kept, 1 exact prefix, 2 recomputed chunk token, 3 question (always)."""
    n_reused = CHUNKS * CHUNK
    n = PREFIX + n_reused + QUESTION
    grid = np.zeros((LAYERS, n), dtype=int)
    grid[:, :PREFIX] = 1
    grid[:, PREFIX + n_reused :] = 3
    if config.uses_attention_pass:  # the picks of the first pass, recomputed on every layer
        picks = np.argsort(-attention_scores(seed))[: max(1, round(config.recompute_ratio * n_reused))]
        grid[:, PREFIX + picks] = 2
        return grid
    if config.rule == "epic":  # EPIC: the first tokens of every chunk
        for i in range(CHUNKS):
            grid[:, PREFIX + i * CHUNK : PREFIX + i * CHUNK + max(1, round(config.recompute_ratio * CHUNK))] = 2
        return grid
    rng = np.random.default_rng(seed)
    # deviation score per chunk token: higher near chunk starts, where the missing cross-attention shows most
    base = rng.gamma(1.2, 1.0, n_reused) + np.tile(np.linspace(1.5, 0, CHUNK), CHUNKS)
    candidates = np.arange(n_reused)
    schedule = dict(zip(config.check_layers, config.schedule(), strict=True))
    for layer in range(LAYERS):
        if layer in schedule:
            keep = max(1, round(schedule[layer] * n_reused))
            noisy = base[candidates] + rng.normal(0, 0.3, len(candidates))
            candidates = np.sort(candidates[np.argsort(-noisy)[:keep]])
        grid[layer, PREFIX + candidates] = 2
    return grid


def box(ax, xy, w, h, text, color, fontsize=9):
    ax.add_patch(FancyBboxPatch(xy, w, h, boxstyle="round,pad=0.02", fc=color, ec="#333333", lw=0.8))
    ax.text(xy[0] + w / 2, xy[1] + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax, a, b):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, lw=1.0, color="#333333"))


def draw_isolated(left) -> None:
    """Each chunk prefilled alone after the prefix, its KV stored."""
    left.set_title("once per chunk: prefilled alone, stored", fontsize=11)
    for i in range(CHUNKS):
        y = 7.6 - i * 2.4
        box(left, (0.2, y), 2.6, 1.3, f"[prefix] chunk {i + 1}", "#f0f0f0")
        arrow(left, (2.9, y + 0.65), (4.0, y + 0.65))
        box(left, (4.1, y), 2.2, 1.3, "prefill\nalone", "#fff7bc")
        arrow(left, (6.4, y + 0.65), (7.1, y + 0.65))
        box(left, (7.2, y), 2.9, 1.3, f"K, V of chunk {i + 1}\n(keys before RoPE)", COLORS["kept"], 8)
    arrow(left, (8.65, 2.8), (8.65, 1.75))


def draw_grouped(left) -> None:
    """Grouped precompute: one prefill per group of similar chunks, and each chunk alone."""
    left.set_title("once per corpus: grouped precompute (the default)", fontsize=11)
    box(left, (0.2, 8.3), 10.6, 1.2, "corpus chained by similarity, cut into groups of up to 3,072 tokens",
        "#f7f7f7", 8)  # fmt: skip
    box(left, (0.2, 6.2), 4.6, 1.3, "[prefix] chunk 1 | chunk 2 | chunk 3\n(one group of similar chunks)", "#f0f0f0", 8)
    arrow(left, (4.9, 6.85), (5.6, 6.85))
    box(left, (5.7, 6.2), 1.9, 1.3, "prefill the\ngroup once", "#fff7bc", 8)
    arrow(left, (7.7, 6.85), (8.1, 6.85))
    box(left, (8.2, 6.2), 2.6, 1.3, "K, V of chunks 2, 3\nas in the group", COLORS["kept"], 8)
    box(left, (0.2, 3.7), 4.6, 1.3, "[prefix] chunk i, for every chunk", "#f0f0f0", 8)
    arrow(left, (4.9, 4.35), (5.6, 4.35))
    box(left, (5.7, 3.7), 1.9, 1.3, "prefill\nalone", "#fff7bc", 8)
    arrow(left, (7.7, 4.35), (8.1, 4.35))
    box(left, (8.2, 3.7), 2.6, 1.3, "K, V of chunk i\nalone", COLORS["kept"], 8)
    note = "a prompt's first chunk reads its entry alone; a later chunk its grouped entry\n"
    note += "(keys stored before RoPE, rotated to the prompt's positions when read)"
    left.text(0.2, 2.55, note, ha="left", fontsize=7.5)
    left.add_patch(FancyArrowPatch((10.8, 6.85), (10.5, 1.75), arrowstyle="-|>", mutation_scale=12, lw=1.0,
                                   color="#333333", connectionstyle="arc3,rad=-0.35", clip_on=False))  # fmt: skip
    arrow(left, (9.9, 3.7), (9.9, 1.75))


def draw(out: Path, config: BlendConfig, chunk_context: str) -> None:
    probe = config.uses_attention_pass
    fig = plt.figure(figsize=(14, 5.8))
    left = fig.add_axes([0.01, 0.05, 0.34, 0.86])
    left.set_xlim(0, 11.0)
    left.set_ylim(0, 10)
    left.axis("off")
    if chunk_context == "isolated":
        draw_isolated(left)
    else:
        draw_grouped(left)
    box(left, (4.0, 0.3), 6.8, 1.4, "store: memory, then disk and Redis (int8 by default)", "#e5f5e0", 8)

    right = fig.add_axes([0.45, 0.22, 0.53, 0.52 if probe else 0.68])
    grid = recompute_grid(config)
    if probe:  # the first pass: the question reads all loaded chunk KV; its attention ranks the chunk tokens
        strip = fig.add_axes([0.45, 0.79, 0.53, 0.06], sharex=right)
        row = np.full((1, grid.shape[1]), np.nan)
        row[0, PREFIX : PREFIX + CHUNKS * CHUNK] = attention_scores()
        strip.imshow(row, aspect="auto", cmap="Purples", interpolation="nearest", origin="upper")
        strip.set_yticks([0])
        strip.set_yticklabels(["attention of the question"], fontsize=8)
        strip.tick_params(axis="x", labelbottom=False)
        strip.set_title(
            "one request. 1) first pass: the question alone, over all loaded chunk KV (positions re-rotated)\n"
            f"2) the top {config.recompute_ratio:.0%} of chunk tokens by its attention are recomputed on every layer",
            fontsize=10,
        )
    cmap = ListedColormap([COLORS["kept"], COLORS["exact"], COLORS["recomputed"], COLORS["question"]])
    right.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest", vmin=0, vmax=3, origin="upper")
    bounds = [PREFIX + CHUNK * i for i in range(CHUNKS + 1)]
    for b in bounds:
        right.axvline(b - 0.5, color="white", lw=2)
    for layer in config.check_layers if config.uses_check_layers else ():
        right.axhline(layer - 0.5, color="#333333", lw=0.6, ls=":")
        right.axhline(layer + 0.5, color="#333333", lw=0.6, ls=":")
    labels = [PREFIX / 2] + [bounds[i] + CHUNK / 2 for i in range(CHUNKS)] + [bounds[-1] + QUESTION / 2]
    right.set_xticks(np.array(labels) - 0.5)
    right.set_xticklabels(["prefix"] + [f"chunk {i + 1}" for i in range(CHUNKS)] + ["question"])
    right.set_yticks(range(LAYERS))
    ticks = []
    for layer in range(LAYERS):
        if probe:
            ticks.append(f"{layer}: r = {config.recompute_ratio:.0%}")
        elif layer == 0 and config.uses_check_layers:
            ticks.append("0: all")
        elif layer in config.check_layers:
            share = config.schedule()[config.check_layers.index(layer)]
            ticks.append(f"{layer}: check, keep {share:.0%}")
        else:
            ticks.append(f"{layer}: r = {config.recompute_ratio:.0%}")
    right.set_yticklabels(ticks, fontsize=8)
    right.set_ylabel("layer")
    if not probe:
        title = "one request: chunk KV loaded at real positions (keys re-rotated), fused layer by layer"
        right.set_title(title, fontsize=11)
    picked = "most deviating" if config.uses_check_layers else "chunk start"
    picked = "most attended by the question" if probe else picked
    right.legend(
        handles=[
            Patch(color=COLORS["kept"], label="loaded chunk KV, kept"),
            Patch(color=COLORS["recomputed"], label=f"chunk token recomputed ({picked})"),
            Patch(color=COLORS["question"], label="question: always computed"),
            Patch(color=COLORS["exact"], label="shared prefix: exact, never recomputed"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("how_it_works.png"))
    parser.add_argument("--rule", choices=RULE_NAMES, default=None, help="a named rule (default: BlendConfig())")
    parser.add_argument("--chunk-context", choices=("grouped", "isolated"), default=None,
                        help="what the left panel draws (default: EngineConfig().chunk_context)")  # fmt: skip
    args = parser.parse_args()
    context = args.chunk_context or ("isolated" if EngineConfig().chunk_context == "isolated" else "grouped")
    draw(args.out, BlendConfig() if args.rule is None else blend_rule(args.rule), context)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
