"""Draws docs/figures/how_it_works.png, the picture in docs/how-it-works.md.

    python docs/figures/how_it_works.py            # needs matplotlib (the `eval` extra)

Left: what happens once per chunk (prefill alone, store the KV). Right: one request as a grid of layers x prompt
tokens, coloured by what the fusor does there: loaded and kept (the reused KV), recomputed, or exact (the shared
prefix). The recomputed sets follow the engine's real schedule (`BlendConfig().schedule()`: layer 0 for all,
shrinking sets on the check layers, r on the rest); which chunk tokens are picked is drawn at random here,
whereas the engine picks the tokens whose fresh KV deviates most from the loaded one.
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

from cacheblend_rag import BlendConfig

PREFIX, CHUNK, QUESTION = 6, 22, 8  # tokens per part in the drawing (not to scale)
CHUNKS = 3
LAYERS = 12
COLORS = {"kept": "#d9d9d9", "exact": "#9ecae1", "recomputed": "#e6550d", "question": "#fd8d3c"}


def recompute_grid(config: BlendConfig, seed: int = 0) -> np.ndarray:
    """[LAYERS, N] codes: 0 loaded and kept, 1 exact prefix, 2 recomputed chunk token, 3 question (always)."""
    n_reused = CHUNKS * CHUNK
    n = PREFIX + n_reused + QUESTION
    grid = np.zeros((LAYERS, n), dtype=int)
    grid[:, :PREFIX] = 1
    grid[:, PREFIX + n_reused :] = 3
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


def draw(out: Path) -> None:
    config = BlendConfig()
    fig = plt.figure(figsize=(14, 5.8))
    left = fig.add_axes([0.01, 0.05, 0.30, 0.86])
    left.set_xlim(0, 10.6)
    left.set_ylim(0, 10)
    left.axis("off")
    left.set_title("once per chunk (precompute, or on first miss)", fontsize=11)
    for i in range(CHUNKS):
        y = 7.6 - i * 2.4
        box(left, (0.2, y), 2.6, 1.3, f"[prefix] chunk {i + 1}", "#f0f0f0")
        arrow(left, (2.9, y + 0.65), (4.0, y + 0.65))
        box(left, (4.1, y), 2.2, 1.3, "prefill\nalone", "#fff7bc")
        arrow(left, (6.4, y + 0.65), (7.1, y + 0.65))
        box(left, (7.2, y), 2.4, 1.3, f"K, V of chunk {i + 1}\n(keys before RoPE)", COLORS["kept"], 8)
    box(left, (4.0, 0.3), 5.8, 1.4, "store: memory -> disk -> Redis\nsafetensors, sha256 per layer", "#e5f5e0")
    for i in range(CHUNKS):  # every chunk's KV goes to the store
        y = 7.6 - i * 2.4 + 0.65
        left.add_patch(
            FancyArrowPatch(
                (9.6, y), (9.3, 1.75), arrowstyle="-|>", mutation_scale=12, lw=1.0, color="#333333",
                connectionstyle=f"arc3,rad=-{0.25 + 0.1 * (CHUNKS - i)}",
            )
        )  # fmt: skip

    right = fig.add_axes([0.45, 0.22, 0.53, 0.68])
    grid = recompute_grid(config)
    cmap = ListedColormap([COLORS["kept"], COLORS["exact"], COLORS["recomputed"], COLORS["question"]])
    right.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest", vmin=0, vmax=3, origin="upper")
    bounds = [PREFIX + CHUNK * i for i in range(CHUNKS + 1)]
    for b in bounds:
        right.axvline(b - 0.5, color="white", lw=2)
    for layer in config.check_layers:
        right.axhline(layer - 0.5, color="#333333", lw=0.6, ls=":")
        right.axhline(layer + 0.5, color="#333333", lw=0.6, ls=":")
    labels = [PREFIX / 2] + [bounds[i] + CHUNK / 2 for i in range(CHUNKS)] + [bounds[-1] + QUESTION / 2]
    right.set_xticks(np.array(labels) - 0.5)
    right.set_xticklabels(["prefix"] + [f"chunk {i + 1}" for i in range(CHUNKS)] + ["question"])
    right.set_yticks(range(LAYERS))
    ticks = []
    for layer in range(LAYERS):
        if layer == 0:
            ticks.append("0: all")
        elif layer in config.check_layers:
            share = config.schedule()[config.check_layers.index(layer)]
            ticks.append(f"{layer}: check, keep {share:.0%}")
        else:
            ticks.append(f"{layer}: r = {config.recompute_ratio:.0%}")
    right.set_yticklabels(ticks, fontsize=8)
    right.set_ylabel("layer")
    title = "one request: chunk KV loaded at real positions (keys re-rotated), fused layer by layer"
    right.set_title(title, fontsize=11)
    right.legend(
        handles=[
            Patch(color=COLORS["kept"], label="loaded chunk KV, kept"),
            Patch(color=COLORS["recomputed"], label="chunk token recomputed (most deviating)"),
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
    args = parser.parse_args()
    draw(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
