"""Profile files on disk: read one safely (a regular file, small, UTF-8 JSON of the expected format) and write one
so that a reader never finds it half-written. Shared by the loading and the fidelity profile."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


def write_profile_json(path: str | os.PathLike[str], data: dict[str, Any], indent: int) -> None:
    """Write `data` as JSON to `path` (its folder made as needed) through a temporary file beside it, replaced
    into place at the end. NaN and infinity are refused (JSON has neither)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, allow_nan=False) + "\n")
    tmp.replace(path)  # never leave a half-written profile behind


def load_profile_json(
    path: str | os.PathLike[str], what: str, fmt: str, max_bytes: int, redo: str, build: Callable[[dict[str, Any]], T]
) -> T:
    """`build` applied to the JSON object of the profile file `path` (`read_profile_json`). What `build` refuses
    (ConfigError) or cannot find in it (a missing key, a value of the wrong kind) becomes a ConfigError naming the
    path, with `redo`: how to write one."""
    path = Path(path)
    data = read_profile_json(path, what, fmt, max_bytes, redo)
    try:
        return build(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}; {redo}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path} is missing fields of {what} ({exc}); {redo}") from exc


def read_profile_json(path: Path, what: str, fmt: str, max_bytes: int, redo: str) -> dict[str, Any]:
    """The JSON object of a profile file whose "format" is `fmt`; ConfigError naming `path` and `what` it should
    be for anything else (see `read_small_text_file`), with `redo`: how to write one."""
    text = read_small_text_file(path, what, max_bytes, redo)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not {what} (invalid JSON: {exc}); {redo}") from None
    except RecursionError:
        raise ConfigError(f"{path} is not {what} (JSON nested too deeply); {redo}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise ConfigError(f"{path} is not a {fmt} file; {redo}")
    return data


def read_small_text_file(path: Path, what: str, max_bytes: int, redo: str | None = None) -> str:
    """The UTF-8 text of the regular file `path`, refused before reading when it is anything else or too large.
    `redo`: how to write one, for the error messages (default: the loading profile's command)."""
    redo = redo or f"write it with `cacheblend-rag profile --out {path}`"
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. fstat then tells what it is.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"no {what} at {path}; {redo}") from None
    except OSError as exc:
        raise ConfigError(f"cannot open {what} {path} ({exc.strerror}); {redo}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ConfigError(f"{path} is {kind}, not {what}; {redo}")
        if info.st_size > max_bytes:
            raise ConfigError(
                f"{path} is {info.st_size} bytes, above the {max_bytes} bytes limit for {what}; it is not one, {redo}"
            )
        parts, size = [], 0
        while size <= max_bytes and (part := os.read(fd, max_bytes + 1 - size)):
            parts.append(part)
            size += len(part)
        data = b"".join(parts)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while being read
        raise ConfigError(f"{path} is above the {max_bytes} bytes limit for {what}; {redo}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not {what} (binary, not UTF-8 text); {redo}") from None
