"""Size checks on a saved FAISS flat index, made before FAISS reads it.

`faiss.read_index` allocates whatever the file's header claims before it notices that the file is shorter: a 3 KB
file that claims 2^28 floats costs about 1 GB of memory first. A flat index (`IndexFlatIP` / `IndexFlatL2`, what
every index of this project and its integrations is) has a fixed 45-byte header followed by its vectors, so the
header can be checked against the file's length, and the vectors against what the caller expects, for the price
of one 45-byte read.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

# fourcc, d, ntotal, two unused int64, is_trained, metric type, number of floats that follow (faiss >= 1.7).
_FLAT_HEADER = struct.Struct("<4siqqqBiQ")
_FLAT_KINDS = {b"IxFI": 0, b"IxF2": 1}  # fourcc -> its metric type (faiss.METRIC_INNER_PRODUCT, METRIC_L2)


def flat_index_problem(path: str | Path, *, dim: int | None = None, count: int | None = None) -> str | None:
    """What is wrong with the FAISS flat-index file at `path`, or None when FAISS can read it without surprises.

    Checks the header's own consistency and that its vectors fill exactly the rest of the file (so reading it
    allocates at most the file's size), then `dim` and `count` when given.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_FLAT_HEADER.size)
    if len(head) < _FLAT_HEADER.size:
        return f"it is {size} bytes long, too short for a FAISS flat index"
    fourcc, d, ntotal, _, _, _, metric, floats = _FLAT_HEADER.unpack(head)
    if fourcc not in _FLAT_KINDS:
        return f"it is not a FAISS flat index (type {fourcc!r}; only IndexFlatIP and IndexFlatL2 are read)"
    if _FLAT_KINDS[fourcc] != metric or d <= 0 or ntotal < 0 or floats != d * ntotal:
        return f"its header is inconsistent (dimension {d}, {ntotal} vectors, {floats} values, metric {metric})"
    if _FLAT_HEADER.size + 4 * floats != size:
        return f"its header describes {ntotal} vectors of dimension {d}, but the file holds {size} bytes"
    if dim is not None and d != dim:
        return f"it holds vectors of dimension {d}, expected {dim}"
    if count is not None and ntotal != count:
        return f"it holds {ntotal} vectors, expected {count}"
    return None


def import_faiss() -> Any:
    try:
        import faiss
    except ImportError as exc:
        raise ImportError("the retriever needs FAISS; install it with `pip install 'faiss-cpu>=1.8'`") from exc
    return faiss
