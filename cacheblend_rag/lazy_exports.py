"""Names a package exports without importing their modules until first use (PEP 562 module `__getattr__`).

The engine, the store and the measuring code import torch and transformers, which take seconds; the command
line's `--help`, argument errors and profile reading need none of it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_getattr(package: str, namespace: dict[str, Any], modules: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `modules` (relative name -> the names it exports) on the
    first use of one of their names and keeps the value in `namespace` (the package's globals())."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        namespace[name] = value
        return value

    return __getattr__
