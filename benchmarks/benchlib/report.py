"""What the benchmark reports share: number formatting, markdown tables, JSON files and matplotlib figures.

Used by `quality`, `fidelity_report` and `throughput_report`: each turns its typed results (dataclasses) into rows
of this module's tables and panels, so all read and format alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["cases_text", "ci_text", "comparable_cases", "fmt", "jsonable", "markdown_table", "plot_panels", "pyplot",
           "save_figure", "write_json"]  # fmt: skip


def fmt(x: float | None, spec: str) -> str:
    """`x` formatted with `spec` for a table: "-" when missing (None or nan), "any" when infinite (e.g. a TTFT
    target met at every rate)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "any"
    return format(x, spec)


def ci_text(ci: tuple[float, float], spec: str) -> str:
    """An interval for a table: "[lo, hi]", each bound formatted with `spec`."""
    return f"[{ci[0]:{spec}}, {ci[1]:{spec}}]"


def markdown_table(header: Sequence[str], align: str, rows: Sequence[Sequence[str]]) -> list[str]:
    """Lines of a markdown table; `align` holds one character per column, "l" (left) or "r" (right)."""
    if len(align) != len(header):
        raise ValueError(f"{len(header)} columns but {len(align)} alignment characters")
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def jsonable(x: Any) -> Any:
    """Dataclasses as dicts; nan and inf as null (JSON has neither: a target met at any rate is null there)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_json(path: str | os.PathLike[str], value: Any, *, indent: int = 1) -> Path:
    """Write `value` (see `jsonable`) atomically: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(value), indent=indent) + "\n")
    os.replace(tmp, path)
    return path


def cases_text(n: int, kind: str = "") -> str:
    """'1 case', '5 common cases'."""
    return f"{n} {kind}case{'' if n == 1 else 's'}"


def comparable_cases(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[set[str], list[str], list[str]]]:
    """Per data set: (the common cases, the methods compared on them, the methods left out), from the records
    of finished measurements (`dataset`, `method`, `case_id`).

    A method measured on half the cases of the best-covered one or fewer is left out (a later, narrower run
    must not shrink a table or figure); the others are compared on the cases they all finished.
    """
    by: dict[str, dict[str, set[str]]] = {}
    for r in records:
        by.setdefault(r["dataset"], {}).setdefault(r["method"], set()).add(r["case_id"])
    out = {}
    for ds, methods in by.items():
        most = max(len(c) for c in methods.values())
        kept = [m for m, c in methods.items() if 2 * len(c) > most]
        cases = set.intersection(*(methods[m] for m in kept))
        out[ds] = (cases, kept, [m for m in methods if m not in kept])
    return out


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files only (the Agg backend), with an install hint when it is missing."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the benchmark figures need matplotlib: pip install 'cacheblend-rag[eval]'") from e
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 120, **savefig: Any) -> Path:
    """Lay `fig` out, write it to `path` and close it (pyplot keeps every open figure otherwise)."""
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=dpi, **savefig)
    pyplot().close(fig)
    return out


def plot_panels(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    x: str,
    y: str,
    panel: str = "dataset",
    series: str | None = None,
    label: str | None = None,
    hlines: Mapping[str, str] | None = None,
    hline_key: str = "method",
    xlabel: str | None = None,
    ylabel: str | Mapping[Any, str] | None = None,
    title: str | None = None,
    panel_titles: Mapping[Any, str] | None = None,
    style: str | None = None,
    yerr: tuple[str, str] | None = None,
) -> Path:
    """A row of panels (one per value of `panel`), each plotting `y` against `x`.

    Rows with the same `series` value are joined by a line (sorted by x); without `series`, each row is a
    point named by its `label` field in a legend under its panel (names never overlap the data); points with
    the same `style` field value (default: the label) share a color and marker in every panel. `hlines` maps
    values of `hline_key` (e.g. "full") to a legend name: those rows are drawn as horizontal reference lines at
    their `y`, not as points. `panel_titles` maps a panel's value to its title; `ylabel` is one label for every
    panel or a mapping from a panel's value to its own (e.g. each data set's metric). Rows missing x or y (None or
    nan) are left out. `yerr` names the fields of each point's interval (low, high), drawn as an error bar.
    Enough for the paper's Fig. 12 (quality vs TTFT, one point per method), Fig. 16 (quality
    vs recompute ratio) and Fig. 15 (quality or TTFT vs chunk count / length).
    """
    plt = pyplot()

    def ok(v: Any) -> bool:
        return v is not None and not (isinstance(v, float) and math.isnan(v))

    panels = list(dict.fromkeys(r[panel] for r in rows))
    if not panels:
        raise ValueError("nothing to plot: no rows")
    hlines = hlines or {}
    point_rows = [r for r in rows if r.get(hline_key) not in hlines]
    style = style or label
    styled = series is None and style is not None
    keys = list(dict.fromkeys(str(r[style]) for r in point_rows)) if styled else []
    markers = "osD^vP*Xh<>"
    looks = {k: (f"C{i % 10}", markers[i % len(markers)]) for i, k in enumerate(keys)}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        sub = [r for r in rows if r[panel] == name]
        refs = [r for r in sub if r.get(hline_key) in hlines and ok(r.get(y))]
        pts = [r for r in sub if r.get(hline_key) not in hlines and ok(r.get(x)) and ok(r.get(y))]
        if series is not None:
            for s in dict.fromkeys(r[series] for r in pts):
                line = sorted((r for r in pts if r[series] == s), key=lambda r: r[x])
                ax.plot([r[x] for r in line], [r[y] for r in line], marker="o", label=str(s))
        else:
            for r in pts:
                color, marker = looks.get(str(r[style]), ("C0", "o")) if styled else ("C0", "o")
                legend_name = str(r[label]) if label is not None else None
                if yerr is not None and ok(r.get(yerr[0])) and ok(r.get(yerr[1])):
                    err = [[r[y] - r[yerr[0]]], [r[yerr[1]] - r[y]]]
                    ax.errorbar(r[x], r[y], yerr=err, fmt=marker, color=color, capsize=3, label=legend_name)
                else:
                    ax.scatter(r[x], r[y], s=40, color=color, marker=marker, label=legend_name)
        for i, r in enumerate(refs):
            ax.axhline(r[y], linestyle="--", linewidth=1, color=f"C{(i + 3) % 10}", label=hlines[r[hline_key]])
        ax.set_title((panel_titles or {}).get(name, str(name)))
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel((ylabel.get(name, y) if isinstance(ylabel, Mapping) else ylabel) or y)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            if series is None and label is not None:  # many points: the legend goes under the panel
                ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False)
            else:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path, bbox_inches="tight")
