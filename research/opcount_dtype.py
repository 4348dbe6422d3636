"""The shared op counter (`../shared/tools/opcount.py`) in a chosen precision, on any CPU.

The tool builds its engine with `dtype="auto"`: bf16 on a CPU with bf16 instructions (and on a GPU), fp32 on other
CPUs, so its counts depend on the host (bf16 runs more casts around the norms). This runs the tool unchanged with
"auto" deciding the precision named. Deterministic. Run from the project's root:

    python research/opcount_dtype.py float32             # as on an AVX2 host
    python research/opcount_dtype.py bfloat16            # as on a GPU, or a CPU with AMX or AVX-512-BF16
    python research/opcount_dtype.py float32 --cpu-path  # the tool's own flags pass through
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "tools"))

import opcount  # noqa: E402

from cacheblend_rag import cpu  # noqa: E402

CHOICES = {"float32": False, "bfloat16": True}

if len(sys.argv) < 2 or sys.argv[1] not in CHOICES:
    sys.exit(f"usage: python {sys.argv[0]} {{float32,bfloat16}} [--cpu-path]")
bf16 = CHOICES[sys.argv.pop(1)]
cpu.cpu_has_bf16 = lambda: bf16  # what "auto" reads (config/dtype.py)
print("dtype:", "bfloat16" if bf16 else "float32")
sys.exit(opcount.main())
