"""The number checks shared by the settings (`config`) and a request's arguments (`engine.request`), and
`mask_url`, which shows a URL in an error without its password.

It imports nothing but `errors`, so that the settings can use it without loading the engine, the store or torch.
Each check raises a `ConfigError` that names the setting, the value given and, where it helps, what the number
counts; a bool is never read as a number (True is not 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..errors import ConfigError


def check_count(name: str, value: object, minimum: int, hint: str = "") -> None:
    """An integer of at least `minimum` (a bool, a float, NaN or a string such as '1GB' is refused).

    `hint` says what the number counts, shown in parentheses, e.g. "a number of bytes".
    """
    what = f" ({hint})" if hint else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= {minimum}{what}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}{what}, got {value}")


def check_real(name: str, value: object, ok: Callable[[float], bool], rule: str) -> None:
    """A finite int or float for which `ok` holds; `rule` says which values those are, e.g. "in (0, 1]"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or not ok(value):
        raise ConfigError(f"{name} must be {rule}, got {value!r}")


def check_ratio(name: str, value: object) -> None:
    """A share: a real number in [0, 1]."""
    check_real(name, value, lambda r: 0 <= r <= 1, "in [0, 1]")


def mask_url(url: object) -> str:
    """A URL as it may be shown (repr, errors, logs): any password replaced by `***`
    (`redis://:secret@host:6379/0` -> `redis://:***@host:6379/0`); anything else unchanged."""
    from urllib.parse import urlsplit, urlunsplit

    text = str(url)
    try:
        parts = urlsplit(text)
        if parts.password is None:
            return text
    except ValueError:  # not a URL at all: show it only up to any '@' (what precedes it may be a secret)
        return text.rsplit("@", 1)[-1] if "@" in text else text
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
