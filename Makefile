# `make demo` and `make test` are the two commands README.md starts with.
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m kvplug.connector.demo

test: setup
	.venv/bin/python -m pytest -q -ra --durations=25 -n 2 --dist loadfile

lint: setup
	.venv/bin/ruff check sdk backends gpu connector tests benchmarks

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; .venv/bin/python $$b || exit 1; done
