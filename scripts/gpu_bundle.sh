#!/usr/bin/env bash
# Prepares .whl/ for a GPU machine that has PyTorch (cp312, CUDA 13) but no network and no vLLM:
# kvplug itself (a pure-Python wheel) and the dependencies that image lacks, kvikio for the gds
# tier included. Run on a machine with pip access; then run scripts/gpu_check.sh over there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
rm -f .whl/*.whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl \
  'pydantic==2.*' 'pydantic-core' 'annotated-types' 'typing-inspection' 'typing-extensions>=4.16' \
  'cbor2' 'pyzmq' 'msgspec' 'cryptography' 'cffi' 'pycparser' 'kvikio-cu13==26.10.*' 'libkvikio-cu13==26.10.*' 'rapids-logger==0.3.*'
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
# the per-job gpu/ that benchmarks/bench_host_cost.py measures beside this one (no git over there)
before=$(sed -n 's/^BEFORE = "\([0-9a-f]*\)".*/\1/p' benchmarks/bench_host_cost.py)
rm -rf .whl/gpu-before && mkdir -p .whl/gpu-before && git archive "$before" gpu | tar -x --strip-components=1 -C .whl/gpu-before
du -sh .whl
ls .whl
