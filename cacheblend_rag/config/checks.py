"""The number checks shared by the settings (`config`) and a request's arguments (`engine.request`), `mask_url`,
which shows a URL in an error without its password, and `check_redis_url`, what a Redis URL's text alone shows.

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


def check_redis_url(url: object) -> None:
    """ConfigError, naming the URL without its password and what to check, for a Redis URL whose text alone shows
    it cannot work: another scheme than redis://, rediss:// or unix://, or a port that is not a number in 0-65535.
    Whether a server answers there is learnt when the store connects."""
    from urllib.parse import urlsplit

    shown, text = mask_url(url), str(url)
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, got {shown!r}")
    if text.startswith("unix://"):
        return
    try:
        urlsplit(text).port  # noqa: B018 (parsed when read)
    except ValueError as exc:  # "Port out of range 0-65535", "Port could not be cast to integer value"
        raise ConfigError(
            f"redis_url {shown!r} has no usable port ({exc}): check the port, a number up to 65535 (Redis listens "
            "on 6379 unless told otherwise), e.g. redis://127.0.0.1:6379/0"
        ) from None
