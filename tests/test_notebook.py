"""examples/rag_demo.ipynb is committed with its outputs (readable without running it), and still runs headless,
start to end, on the small packaged model, drawing its trade-off and fidelity plots."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "rag_demo.ipynb"
MUSIQUE = EXAMPLES.parents[1] / "shared" / "data" / "musique" / "musique_s.json"
MODEL = "smollm2-135m-instruct"
PLOT_TAGS = ("tradeoff-plot", "fidelity-plot")

# Run first in the kernel (in memory only): what the test must know about the kernel process itself.
PROBE = (
    "import json, os, sys\n"
    "print(json.dumps({'executable': sys.executable, 'model': os.environ.get('CACHEBLEND_DEMO_MODEL'),"
    " 'questions': os.environ.get('CACHEBLEND_DEMO_QUESTIONS')}))"
)
# What must not reach a reader: paths of the machine that ran it, terminal escapes (progress bars).
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|home|root|work|Users|var|private)/")
ANSI = re.compile(r"\x1b\[|\r")


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell["outputs"] if o["output_type"] == "stream")


def _joined(text: str | list[str]) -> str:  # nbformat JSON stores multi-line text as a list of lines
    return text if isinstance(text, str) else "".join(text)


def _tagged(cells, tag: str) -> list:
    return [c for c in cells if tag in c.get("metadata", {}).get("tags", [])]


def _images(cell) -> list:
    return [o for o in cell["outputs"] if "image/png" in o.get("data", {})]


def test_committed_notebook_shows_its_outputs():
    """On GitHub the notebook reads as a report: every code cell ran, in order, without errors, the plots are
    there, and the outputs carry no local paths or progress-bar escapes."""
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"run the whole notebook once, top to bottom; counts {counts}"
    for c in code:
        errors = [o for o in c["outputs"] if o["output_type"] == "error" or o.get("name") == "stderr"]
        assert not errors, f"a committed cell shows an error or stderr: {''.join(c['source'])[:80]!r}: {errors}"
        shown = "".join(_joined(o.get("text", "")) + _joined(o.get("data", {}).get("text/plain", ""))
                        + _joined(o.get("data", {}).get("text/markdown", "")) for o in c["outputs"])  # fmt: skip
        path = MACHINE_PATH.search(shown)
        assert not path, f"an output shows a path of the machine that ran it: {shown[path.start() - 40 :][:120]!r}"
        assert not ANSI.search(shown), f"an output has terminal escapes (progress bars?): {shown[:200]!r}"
    for tag in PLOT_TAGS:
        cells = _tagged(nb["cells"], tag)
        assert len(cells) == 1 and _images(cells[0]), f"the committed {tag!r} cell shows no image"


@pytest.mark.real_model
def test_rag_demo_notebook_runs_and_plots(monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="executing the notebook needs nbformat: pip install nbformat")
    nbclient = pytest.importorskip("nbclient", reason="executing the notebook needs nbclient: pip install nbclient")
    pytest.importorskip("ipykernel", reason="executing the notebook needs a Python kernel: pip install ipykernel")

    # The kernel is a subprocess of this one and inherits its environment.
    monkeypatch.setenv("CACHEBLEND_DEMO_MODEL", MODEL)
    monkeypatch.setenv("CACHEBLEND_DEMO_QUESTIONS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # One torch thread in the kernel: on a busy 2-core machine its spinning OpenMP workers made the run ~6x
    # slower (8 min against 80 s); the notebook's result does not depend on it.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    committed = NOTEBOOK.read_bytes()
    # Executed in memory: the committed outputs are dropped first, so every output checked below is this run's.
    nb = nbformat.reads(committed.decode(), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE))

    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    assert NOTEBOOK.read_bytes() == committed, "running the test must leave the committed notebook as it is"

    probe = json.loads(_text(nb.cells[0]))
    # "python3" must resolve to this interpreter (the venv with cacheblend-rag), not some other Python on PATH.
    assert Path(probe["executable"]).resolve() == Path(sys.executable).resolve()
    assert probe["model"] == MODEL and probe["questions"] == "1"
    assert f"loaded {MODEL}" in "".join(_text(c) for c in nb.cells if c.cell_type == "code")

    for tag in PLOT_TAGS:
        plots = _tagged(nb.cells, tag)
        assert len(plots) == 1, f"tag one cell {tag!r}"
        if MUSIQUE.is_file():
            assert _images(plots[0]), f"the {tag!r} cell drew no image; its outputs: {plots[0].outputs}"
        else:  # without the data set the notebook skips MuSiQue, and says so
            assert "nothing to plot" in _text(plots[0])
