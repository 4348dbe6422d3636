"""`cacheblend-rag models`: list the packaged model presets."""

from __future__ import annotations

import argparse

__all__ = ["cmd_models"]


def cmd_models(args: argparse.Namespace) -> int:
    from ..models import DEFAULT_PRESET, PRESETS

    for name, preset in PRESETS.items():
        mark = " (default)" if name == DEFAULT_PRESET else ""
        print(f"{name}{mark}: {preset.description}")
    return 0
