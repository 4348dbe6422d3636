#!/usr/bin/env bash
# The GPU check, ready to run as it is on a lent GPU machine (about 6-8 minutes on one H100/H200):
#   1. the CUDA tests (r = 1 equals a full prefill, r = 0 full reuse, bf16 generation, contextual KV);
#   2. TTFT per mode and decode speed on random weights of a Llama-2-7B shape (benchmarks/gpu_check.py);
#   3. the load benchmark at 1 / 8 / 32 concurrent clients, serial vs batched decoding.
# Output goes to ${OUT:-/tmp/gpu-check}; paste its summaries into docs/benchmarks.md ("On a GPU").
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
timeout 180 python -m pytest -q tests/test_cuda.py 2>&1 | tail -5 | tee "$out/cuda-tests.txt"
cd benchmarks
timeout 180 python gpu_check.py --model-shape 7b --dtype bfloat16 --out "$out/ttft" 2>&1 | tail -25
timeout 240 python load.py --random-weights --model-shape 7b --device cuda --dtype bfloat16 --memory-gb 40 \
  --concurrency 1,8,32 --per-client 1 --chunk-tokens 512 --new-tokens 128 --batch 32 \
  --settings blend-serial,blend-batched,full-batched --out "$out/load" 2>&1 | tail -12
