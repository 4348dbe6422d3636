"""Every ```python block of the user-facing docs runs as pasted, each in a fresh interpreter.

The blocks of README.md, docs/quickstart.md and the two integration READMEs run on SmolLM2-135M (the small
packaged model) instead of the default preset: `CACHEBLEND_RAG_MODEL` names the model loaded when a snippet
names none. A block that needs what a test machine lacks (a GPU, a Redis server, a user's folder) opens with a
marker line saying so, `# snippet: skip (needs a Redis server)`, and is reported as skipped with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (
    "README.md",
    "docs/quickstart.md",
    "integrations/langchain-cacheblend/README.md",
    "integrations/llama-index-cacheblend/README.md",
)
SNIPPET_MODEL = "smollm2-135m-instruct"
TIMEOUT_S = 300
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SKIP = re.compile(r"#\s*snippet:\s*skip\s*\((?P<reason>[^)]+)\)")


def python_blocks(document: str) -> list[tuple[str, str]]:
    """(id "file:line", code) of each ```python block of a document."""
    text = (ROOT / document).read_text(encoding="utf-8")
    return [(f"{document}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)) for m in _BLOCK.finditer(text)]


SNIPPETS = [snippet for document in DOCUMENTS for snippet in python_blocks(document)]


def skip_reason(code: str) -> str | None:
    """The reason of a block's `# snippet: skip (...)` marker, which must be its first line; None without one."""
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    match = _SKIP.match(first)
    return match.group("reason") if match else None


def test_the_extractor_finds_the_blocks_and_markers():
    assert len(SNIPPETS) >= len(DOCUMENTS)  # every document has at least one block
    assert skip_reason("# snippet: skip (needs a Redis server)\nx = 1\n") == "needs a Redis server"
    assert skip_reason("x = 1  # snippet: skip (not first)\n") is None


@pytest.mark.real_model
@pytest.mark.parametrize("code", [code for _, code in SNIPPETS], ids=[name for name, _ in SNIPPETS])
def test_snippet_runs_as_pasted(code, tmp_path):
    reason = skip_reason(code)
    if reason is not None:
        pytest.skip(reason)
    env = {
        **os.environ,
        "CACHEBLEND_RAG_MODEL": SNIPPET_MODEL,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # In a scratch folder: files a snippet writes (an index, a profile) stay out of the repository.
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, f"the snippet failed:\n{done.stderr[-3000:]}"
