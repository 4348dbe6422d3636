"""What the benchmark scripts in `benchmarks/` share: the compared methods (`methods`), the quality runner and report
(`quality`), the fidelity runner and report (`fidelity_run`, `fidelity_report`), the throughput workload, queue
and report (`workload`, `queueing`, `throughput*`), the load benchmark's requests and report (`load_requests`,
`load_report`), the timing helpers (`timing`), resumable records (`records`), tables and figures (`report`), the
command-line pieces (`cli`) and a throwaway Redis (`redis_server`).

Imported as `from benchlib.quality import ...`: a script's own folder is on `sys.path`, and the tests get
`benchmarks/` from pytest's `pythonpath` option. The library's own measures (data sets, scoring, the fidelity
measure) are `cacheblend_rag.evaluation`.
"""

import os

# The benchmarks read models from the local cache only, never the network: set before anything imports
# huggingface_hub (which reads it once), so a script that imports `benchlib` first needs nothing of its own.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
