#!/usr/bin/env bash
# Runs on the GPU machine (see scripts/gpu_bundle.sh): installs the carried wheels, then the CUDA
# and kvikio tests and the GPU benchmarks, logging to ${OUT:-/tmp/kvplug-gpu}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvplug-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import kvikio, kvikio.defaults as d; print('kvikio', kvikio.__version__, 'compat', d.get('compat_mode'))" \
  | tee -a "$OUT/device.txt"
python3 -m pytest -q -ra -p no:cacheprovider tests/unit/test_gpu_cuda.py tests/unit/test_gpu_blocks.py \
  tests/unit/test_gpu_paged.py tests/unit/test_kv_harness.py tests/backends/test_gds_kvikio.py \
  tests/backends/test_gds_logic.py tests/backends/test_posix_conformance.py 2>&1 | tee "$OUT/tests.log"
for b in bench_gpu_transfer bench_gpu_harness bench_gds; do
  echo "== benchmarks.$b"; python3 -m "benchmarks.$b" 2>&1
done | tee "$OUT/bench.log"
# host time per layer step with 1, 16 and 32 chunk jobs (goal: <= 100 us with 32), beside the
# per-job gpu/ that scripts/gpu_bundle.sh exported
echo "== benchmarks.bench_host_cost --device cuda" | tee -a "$OUT/bench.log"
python3 -m benchmarks.bench_host_cost --device cuda --rounds 9 \
  --before "$( [ -d .whl/gpu-before ] && echo .whl/gpu-before )" 2>&1 | tee -a "$OUT/bench.log"
# the harness's overlapped CUDA runs under compute-sanitizer (the negative controls race on purpose)
for tool in racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool"
  timeout 600 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/unit/test_kv_harness.py tests/unit/test_gpu_cuda.py -k "cuda and (byte_exact and bf16 or repeated or layerwise or zeroed)" 2>&1 | tail -n 30
done | tee "$OUT/sanitizer.log"
