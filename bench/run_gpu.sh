#!/usr/bin/env bash
# The GPU checks of one lent-device session, in one command (issue 23): the CUDA tests, then the
# codec and training-step benches, which write docs/results/{codec_cuda,activations_cuda}.*.
# Runs on the device image's own python (torch + triton there), the library from src/ (the C
# extension is not built there: only the CPU fallback needs it). BENCH_COMMIT names the commit.
# SKIP_TESTS=1 / SKIP_CODEC=1 leave those parts out; ACT_ARGS goes to the step bench (--models resnet18); if the step bench dies (a CUDA error ends the
# process), it is run again without the captured rows (RERUN=0: not), so the eager rows are still measured.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider -o addopts= \
    tests/test_codec_triton.py tests/test_graphed_step.py tests/test_activations.py tests/test_backrazor.py \
    tests/test_codec_bitmap.py -k "cuda or Cuda or replay or capture" 2>&1 | tail -40 | tee "$OUT/cuda_tests.txt"
fi
if [ "${SKIP_CODEC:-0}" != 1 ]; then
  timeout 90 python3 bench/codec_cuda.py 2>&1 | tail -30 | tee "$OUT/codec_cuda.log"
  cp docs/results/codec_cuda.* "$OUT/"
fi
timeout "${ACT_TIMEOUT:-330}" python3 bench/activations_cuda.py --budget-s "${ACT_BUDGET:-270}" ${ACT_ARGS:-} > "$OUT/activations_cuda.log" 2>&1
rc=$?
tail -60 "$OUT/activations_cuda.log"
if [ $rc != 0 ] && [ "${RERUN:-1}" = 1 ]; then
  echo "step bench ended with $rc: again without the captured rows"
  ACT_NO_CAPTURED=1 timeout "${ACT_TIMEOUT:-330}" python3 bench/activations_cuda.py --budget-s "${ACT_BUDGET:-270}" ${ACT_ARGS:-} \
    > "$OUT/activations_eager.log" 2>&1
  tail -40 "$OUT/activations_eager.log"
fi
cp docs/results/activations_cuda.* "$OUT/" 2>/dev/null
ls -la "$OUT"
