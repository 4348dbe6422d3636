"""How an error's advice names an option: as the Python argument (`suffixes=['.txt']`) or, inside the command line
(`cli_option_names()`), as its flag (`--suffix .txt`), so that each reader sees the form they typed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

PYTHON: Mapping[str, str] = {
    "suffixes": "suffixes=[{!r}]",
    "globs": "globs=[{!r}]",
    "encoding": "encoding={!r}",
    "max_document_bytes": "max_document_bytes={}",
}
CLI: Mapping[str, str] = {
    "suffixes": "--suffix {}",
    "globs": "--glob '{}'",
    "encoding": "--encoding {}",
    "max_document_bytes": "--max-doc-mb {}",
}
_NAMES: ContextVar[Mapping[str, str]] = ContextVar("cacheblend_option_names", default=PYTHON)


def option(name: str, example: object) -> str:
    """The option `name` given `example`, in the form of whoever called: `suffixes=['.log']` or `--suffix .log`."""
    return _NAMES.get()[name].format(example)


@contextlib.contextmanager
def cli_option_names() -> Iterator[None]:
    """Within the block, advice names the command line's flags."""
    token = _NAMES.set(CLI)
    try:
        yield
    finally:
        _NAMES.reset(token)
