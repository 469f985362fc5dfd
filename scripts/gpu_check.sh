#!/usr/bin/env bash
# Runs on the GPU machine (see scripts/gpu_bundle.sh): installs the carried wheels, then the CUDA
# and kvikio tests, the GPU benchmarks and compute-sanitizer, logging to ${OUT:-/tmp/kvplug-gpu}.
# Each step is bounded (seconds: TESTS_S, BENCH_S per benchmark, SANITIZER_S per tool) so the whole
# run fits one call of a lent machine; steps run most important first, and a step cut short says
# so in its log ("== exit 124").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvplug-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1

step() {  # step SECONDS COMMAND...: run it bounded, and say how it ended
  local limit=$1
  shift
  echo "== $*"
  timeout --kill-after=5 "$limit" "$@" 2>&1
  echo "== exit $? after at most ${limit}s: $*"
}

nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import kvikio, kvikio.defaults as d; print('kvikio', kvikio.__version__, 'compat', d.get('compat_mode'))" \
  | tee -a "$OUT/device.txt"
step "${TESTS_S:-600}" python3 -m pytest -q -ra -p no:cacheprovider tests/unit/test_gpu_cuda.py \
  tests/unit/test_gpu_blocks.py tests/unit/test_gpu_paged.py tests/unit/test_kv_harness.py \
  tests/backends/test_gds_kvikio.py tests/backends/test_gds_logic.py \
  tests/backends/test_posix_conformance.py | tee "$OUT/tests.log"
before=$([ -d .whl/gpu-before ] && echo .whl/gpu-before)
{
  # the connector's job shape: 32 chunk jobs of 16 blocks, bulk and layer-wise, and the layer-wise
  # overlap with a load and with a load + store; then host time per layer step (goal <= 100 us with
  # 32 jobs) beside the per-job gpu/ that scripts/gpu_bundle.sh exported; then the whole
  # posix/gds path into GPU memory; then one-job transfers and the older rows
  step "${BENCH_S:-600}" python3 -m benchmarks.bench_gpu_harness --only chunk-jobs
  step "${BENCH_S:-600}" python3 -m benchmarks.bench_host_cost --device cuda --rounds 9 --before "$before"
  step "${BENCH_S:-600}" python3 -m benchmarks.bench_gds
  step "${BENCH_S:-600}" python3 -m benchmarks.bench_gpu_harness --only one-job
  step "${BENCH_S:-600}" python3 -m benchmarks.bench_gpu_transfer
} | tee "$OUT/bench.log"
# the harness's overlapped CUDA runs under compute-sanitizer (the negative controls race on purpose)
for tool in racecheck synccheck; do
  step "${SANITIZER_S:-600}" compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/unit/test_kv_harness.py tests/unit/test_gpu_cuda.py \
    -k "cuda and (byte_exact and bf16 or repeated or layerwise or zeroed or chunk)"
done | tee "$OUT/sanitizer.log"
