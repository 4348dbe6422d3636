#!/usr/bin/env bash
# The GPU check, ready to run as it is on a lent GPU machine (about 6-8 minutes on one H100/H200):
#   1. the CUDA tests (r = 1 equals a full prefill, r = 0 full reuse, bf16 generation, contextual KV, batched decoding
#      of mixed lengths equal to the model's own forward);
#   2. on random weights of a Llama-2-7B shape (benchmarks/gpu_check.py): each mode's prefill alone and its TTFT
#      through generate at 3.1k and 7.7k tokens, the top ops of a full and a blend prefill, decode steps of one
#      request and of 8 requests with caches of 8 lengths, and one answer's decode rate; reuse and the blends again
#      with each prefill layer's row-wise work replayed as CUDA graphs (prefill_graphs=True);
#   3. the load benchmark: batched decoding at 1 / 8 / 32 concurrent clients, of the blend with eager steps and with
#      steps replayed as CUDA graphs, and of full prefills (LOAD=0 skips it; SERIAL=1 adds serial decoding).
# The package need not be installed: the repository goes on PYTHONPATH. Wheels in ./.whl (for a machine with no
# package index: transformers>=5.24 at least, see pyproject.toml) are installed to a scratch folder first.
# Output goes to ${OUT:-/tmp/gpu-check}: one log per step, the batched load run's results and latest.json, the
# headline figures (prefill ms per mode and length with each one's floor, decode tokens/s by clients): copy it to
# benchmarks/results/gpu-h200/latest.json and paste the summaries into docs/benchmarks.md ("On a GPU").
# Run it as `COMMIT=<the commit> bash benchmarks/gpu_check.sh`: the lent machine gets the tree without its history.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
py="${PYTHON:-$(command -v python3 || command -v python)}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cacheblend-site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/cacheblend-site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -m1 "Model name"
  "$py" -c "import torch, transformers; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__)"; } 2>&1 | tee "$out/gpu.txt"
timeout "${CUDA_TESTS_S:-60}" "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 \
  | tee "$out/cuda-tests.txt" | tail -15
cd benchmarks
timeout "${TTFT_S:-180}" "$py" gpu_check.py --model-shape 7b --dtype bfloat16 --profile --out /tmp/gpu-check-ttft \
  --latest "$out/latest.json" --commit "${COMMIT:-unknown}" 2>&1 \
  | tee "$out/ttft.txt" | grep -v "^-*$" | awk 'NR <= 90'  # awk reads to the end: head would stop the run
[ "${LOAD:-1}" = 1 ] || exit 0  # LOAD=0: the tests and gpu_check.py only
load=(--random-weights --model-shape 7b --device cuda --dtype bfloat16 --memory-gb 40 --per-client 1 --chunk-tokens 512
  --new-tokens 128 --batch 32)
# serial decoding (SERIAL=1; one request at a time, the old baseline) at 32 clients would take ~200 s: it stops at 8
[ "${SERIAL:-0}" = 1 ] && timeout "${SERIAL_S:-110}" "$py" load.py "${load[@]}" --concurrency 1,8 \
  --settings blend-serial --out /tmp/gpu-check-load-serial 2>&1 | tee "$out/load-serial.txt" | tail -4
timeout "${LOAD_S:-240}" "$py" load.py "${load[@]}" --concurrency 1,8,32 --settings blend-batched,blend-graphed,full-batched \
  --out "$out/load" 2>&1 | tee "$out/load.txt" | tail -8
[ -f "$out/latest.json" ] && [ -f "$out/load/results.json" ] \
  && "$py" -m benchlib.gpu_latest "$out/latest.json" "$out/load/results.json"
