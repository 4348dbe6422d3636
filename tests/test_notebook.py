"""examples/rag_demo.ipynb runs headless, start to end, on the small packaged model and draws its trade-off plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="executing the notebook needs nbformat: pip install nbformat")
nbclient = pytest.importorskip("nbclient", reason="executing the notebook needs nbclient: pip install nbclient")
pytest.importorskip("ipykernel", reason="executing the notebook needs a Python kernel: pip install ipykernel")

pytestmark = pytest.mark.real_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "rag_demo.ipynb"
MUSIQUE = EXAMPLES.parents[1] / "shared" / "data" / "musique" / "musique_s.json"
MODEL = "smollm2-135m-instruct"

# Run first in the kernel (in memory only): what the test must know about the kernel process itself.
PROBE = (
    "import json, os, sys\n"
    "print(json.dumps({'executable': sys.executable, 'model': os.environ.get('CACHEBLEND_DEMO_MODEL'),"
    " 'questions': os.environ.get('CACHEBLEND_DEMO_QUESTIONS')}))"
)


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_rag_demo_notebook_runs_and_plots(monkeypatch):
    # The kernel is a subprocess of this one and inherits its environment.
    monkeypatch.setenv("CACHEBLEND_DEMO_MODEL", MODEL)
    monkeypatch.setenv("CACHEBLEND_DEMO_QUESTIONS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # One torch thread in the kernel: on a busy 2-core machine its spinning OpenMP workers made the run ~6x
    # slower (8 min against 80 s); the notebook's result does not depend on it.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE))

    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails

    probe = json.loads(_text(nb.cells[0]))
    # "python3" must resolve to this interpreter (the venv with cacheblend-rag), not some other Python on PATH.
    assert Path(probe["executable"]).resolve() == Path(sys.executable).resolve()
    assert probe["model"] == MODEL and probe["questions"] == "1"
    assert f"loaded {MODEL}" in "".join(_text(c) for c in nb.cells if c.cell_type == "code")

    plots = [c for c in nb.cells if "tradeoff-plot" in c.get("metadata", {}).get("tags", [])]
    assert len(plots) == 1, "tag the trade-off cell 'tradeoff-plot'"
    images = [o for o in plots[0].outputs if "image/png" in o.get("data", {})]
    if MUSIQUE.is_file():
        assert images, f"the trade-off cell drew no image; its outputs: {plots[0].outputs}"
    else:  # without the data set the notebook skips MuSiQue, and says so
        assert "nothing to plot" in _text(plots[0])
