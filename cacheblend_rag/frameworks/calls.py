"""A call's arguments and a response's metadata, under the engine's names."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..config import PrefillMode
from ..engine import Request
from ..engine.request.request import ALIASES as REQUEST_ALIASES

# -- per-call arguments ----------------------------------------------------------------------------------------

# The engine's names of what a call may set; a model object holds a default for each.
CALL_ARGUMENTS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "mode", "recompute_ratio")
# Other names of the same settings that the frameworks' users write: the engine's own (`Request`).
ALIASES = REQUEST_ALIASES


def call_arguments(
    defaults: Mapping[str, Any], overrides: Mapping[str, Any], *, framework: Collection[str] = ()
) -> dict[str, Any]:
    """`engine.generate` / `engine.stream` keyword arguments of one call.

    `defaults` holds the model object's setting for every name in `CALL_ARGUMENTS`; `overrides` holds the call's
    keyword arguments (engine names or `ALIASES`); names in `framework` are the framework's own (e.g. LangChain's
    `chunks`) and are left to the caller. An unknown name raises TypeError listing the accepted ones. `stop`
    None means no stop strings; `recompute_ratio` applies to blend mode only. The values are checked as the
    engine checks a request (`cacheblend_rag.Request`), before any compute.
    """
    missing = set(CALL_ARGUMENTS) - set(defaults)
    if missing:
        raise TypeError(f"defaults lack {sorted(missing)}; give a default for every name in CALL_ARGUMENTS")
    args = {name: defaults[name] for name in CALL_ARGUMENTS}
    given: dict[str, str] = {}
    for key, value in overrides.items():
        if key in framework:
            continue
        name = ALIASES.get(key, key)
        if name not in args:
            accepted = sorted({*CALL_ARGUMENTS, *ALIASES, *framework})
            raise TypeError(
                f"unexpected keyword argument {key!r}; a call accepts {accepted} (other settings are given when "
                "the model is built)"
            )
        if name in given:
            raise TypeError(f"{given[name]!r} and {key!r} set the same thing; pass one of them")
        given[name] = key
        args[name] = value
    if PrefillMode.parse(args["mode"]) is not PrefillMode.BLEND:
        args["recompute_ratio"] = None
    request = Request.from_options("a call", args)  # one check, one message per mistake, as the engine's
    args["stop"] = request.sampling.stop  # in the engine's form: a tuple of strings
    return args


def setting_aliases(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A model object's constructor arguments with `ALIASES` (`max_tokens`) under the engine's names
    (`max_new_tokens`); both names at once raise ValueError, since one would be dropped unseen."""
    out = dict(settings)
    for alias, name in ALIASES.items():
        if alias in out:
            if name in out:
                raise ValueError(f"{alias} and {name} set the same thing (the longest answer, in tokens); pass one")
            out[name] = out.pop(alias)
    return out


# -- response metadata -----------------------------------------------------------------------------------------

# RequestMetrics fields left out of a response's metadata unless detailed metrics are asked for: one number per
# layer, where the totals (recomputed_tokens, compute_share) say what a reader needs.
DETAILED_METRICS = ("recomputed_per_layer",)


def metrics_metadata(metrics: Any, *, detailed: bool = False) -> dict[str, Any]:
    """A request's `RequestMetrics.to_dict()` for a response's metadata: compact unless `detailed`."""
    d = metrics.to_dict()
    if not detailed:
        for name in DETAILED_METRICS:
            d.pop(name, None)
    return d
