"""The figures the package's design is held to (`benchmarks/structure.py`) stay within their limits: the hops from
`engine.generate` down to `fusion.fuse`, the lines naming `after_layer`, the engine's mixins, `EngineConfig`'s fields,
the modules of `engine/serving`, module and docs lengths, and the integrations' imports."""

from __future__ import annotations

import structure


def test_every_structure_figure_is_within_its_limit(capsys):
    assert structure.main([]) == 0, capsys.readouterr().out
