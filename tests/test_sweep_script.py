"""benchmarks/sweep.py end to end on a tiny random-weight model: JSON layout, a TTFT per mode and point, the figure.

No timing is compared: only that every point was measured with the chunks warm, and that a point beyond the
model's context is skipped with a message rather than a traceback.
"""

from __future__ import annotations

import json

# Small enough to time in well under a second per point on CPU; a short context so that one point cannot fit.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,  # the default blend checks layers 1..3
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=160,
)


def test_sweep_measures_every_mode_per_point_and_skips_overlong(tmp_path, monkeypatch, capsys, load_script):
    sweep = load_script("sweep")
    monkeypatch.setitem(sweep.ttft.RANDOM_SHAPES, "tiny", TINY_SHAPE)
    argv = [
        "--random-weights", "--model-shape", "tiny",
        "--counts", "1,2", "--chunk-tokens", "16",
        "--lengths", "8,32,70", "--chunks", "2",  # 2 x 70 tokens + prefix and question > 160: skipped
        "--ratios", "0.15", "0.3", "--repeats", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 chunks x 70 tokens" in printed and "exceeds the model's limit of 160" in printed

    report = json.loads((tmp_path / "sweep.json").read_text())
    modes = ["full", "prefix", "reuse", "blend r=0.15", "blend r=0.30"]
    assert report["modes"] == modes and report["ratios"] == [0.15, 0.3]
    counts, lengths = report["sweeps"]["chunk_count"], report["sweeps"]["chunk_length"]
    assert counts["varies"] == "chunks" and counts["chunk_tokens"] == 16
    assert lengths["varies"] == "chunk_tokens" and lengths["chunks"] == 2
    assert [(p["chunks"], p["chunk_tokens"]) for p in counts["points"]] == [(1, 16), (2, 16)]
    assert [(p["chunks"], p["chunk_tokens"]) for p in lengths["points"]] == [(2, 8), (2, 32)]
    assert counts["skipped"] == [] and [(s["chunks"], s["chunk_tokens"]) for s in lengths["skipped"]] == [(2, 70)]
    for p in counts["points"] + lengths["points"]:
        assert p["prompt_tokens"] >= p["chunks"] * p["chunk_tokens"]
        assert list(p["ttft_s"]) == modes and all(t > 0 for t in p["ttft_s"].values())
        assert set(p["speedup"]) == {"blend r=0.15", "blend r=0.30"} and all(s > 0 for s in p["speedup"].values())
        assert p["chunks_missed"] == 0, "every timed cached run should find its chunks in the store"

    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
